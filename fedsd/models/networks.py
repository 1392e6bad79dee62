"""The networks fedsd trains, by name (`--model`):

- the papers' two CNNs (Opacus' examples): `mnist-cnn`, `cifar-cnn`;
- a torchvision classification model, `torchvision:NAME` (e.g. `torchvision:resnet18`), built
  untrained for the task's classes, its first convolution made for the task's channels;
- a user's own, `package.module:callable`: called with the task as keywords
  (`num_classes`, `channels`, `image_size`), it returns an `nn.Module` that maps a batch
  (N, channels, image_size, image_size) to (N, num_classes) logits.

Every network goes through Opacus' ModuleValidator: what it can fix (BatchNorm, which mixes
the samples of a batch, so has no per-sample gradients, becomes GroupNorm) is fixed, and said
once; anything else is refused with the layer named. In a deployment, a user's module travels
in the Flower app (README: bring your own network).
"""
from __future__ import annotations

import importlib
import warnings

import torch
from torch import nn

from fedsd.data.datasets import BUILTIN_SHAPES, CUSTOM
from fedsd.data import features
from fedsd.models import pretrained
from fedsd.errors import ConfigError, FedsdNote, ModelNotPrivateError
from fedsd.data.features import feature_shape

BUILTIN_MODELS = ("mnist-cnn", "cifar-cnn")
SCATTER_MODELS = ("scatter-linear", "scatter-cnn")  # on --features scatter (fedsd.data.features)
SCATTER_GROUPS = 27
TORCHVISION = "torchvision:"
MODEL_FORMS = ("mnist-cnn, cifar-cnn, scatter-linear, scatter-cnn (on --features scatter), torchvision:NAME "
               "(e.g. torchvision:resnet18) or package.module:callable")
DEFAULT_MODEL = {"mnist": "mnist-cnn", "fmnist": "mnist-cnn", "cifar10": "cifar-cnn"}
# The papers' networks use ReLU; Tramèr & Boneh (ICLR 2021) found tanh better under DP-SGD (its
# bounded activations keep the clipped gradients informative): a labelled variant, not Table 1.
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class MnistCNN(nn.Sequential):
    """conv(1→16, k8, s2, p3), ReLU, maxpool(2,1), conv(16→32, k4, s2), ReLU, maxpool(2,1),
    fc(512→32), ReLU, fc(32→10) (or tanh for every ReLU)."""

    def __init__(self, num_classes: int = 10, activation: str = "relu"):
        act = ACTIVATIONS[activation]
        super().__init__(
            nn.Conv2d(1, 16, 8, stride=2, padding=3), act(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2), act(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 32), act(), nn.Linear(32, num_classes),
        )


class CifarCNN(nn.Sequential):
    """Four 3×3 convs (32, 64, 64, 128, padding 1) with ReLU, AvgPool(2) after the first three,
    AdaptiveAvgPool(1), fc(128→10) (or tanh for every ReLU)."""

    def __init__(self, num_classes: int = 10, activation: str = "relu"):
        act = ACTIVATIONS[activation]
        super().__init__(
            nn.Conv2d(3, 32, 3, padding=1), act(), nn.AvgPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), act(), nn.AvgPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), act(), nn.AvgPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), act(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
        )


class _Float(nn.Module):
    """Features are kept as float16 (fedsd.data.features); the network computes in float32."""

    def forward(self, x):
        return x.float()


def _flat_size(layers: nn.Sequential, channels: int, image_size: int) -> int:
    with torch.no_grad():
        return layers(torch.zeros(1, channels, image_size, image_size)).numel()


def _input_norm(groups: int, channels: int, group_norm: bool) -> nn.Module:
    """GroupNorm on the scattering channels, or nothing where the features arrive normalised
    (--feature-norm private: fedsd.data.features.private_statistics). GroupNorm without affine has no
    weights, so both networks have the same ones."""
    return nn.GroupNorm(groups, channels, affine=False) if group_norm else nn.Identity()


class ScatterLinear(nn.Sequential):
    """Tramèr & Boneh's ScatterNet + linear: the scattering channels normalised per sample
    (GroupNorm, no affine, 27 groups of three: their FMNIST setting), then one linear layer."""

    def __init__(self, num_classes: int, channels: int, image_size: int, groups: int = SCATTER_GROUPS,
                 group_norm: bool = True):
        super().__init__(_Float(), _input_norm(groups, channels, group_norm), nn.Flatten(),
                         nn.Linear(channels * image_size ** 2, num_classes))


class ScatterCNN(nn.Sequential):
    """Tramèr & Boneh's small CNN on scattering features (their models.py; tanh, GroupNorm on the
    input): grey images' 81 channels: conv(16, k3, s2, p1), conv(32, k3, p1), fc(32), fc(classes);
    colour images' 243 channels: conv(64, k3, p1), maxpool(2), conv(64, k3, p1), fc(classes)."""

    def __init__(self, num_classes: int, channels: int, image_size: int, groups: int = SCATTER_GROUPS,
                 group_norm: bool = True):
        if channels <= 81:
            body = nn.Sequential(nn.Conv2d(channels, 16, 3, stride=2, padding=1), nn.Tanh(),
                                 nn.Conv2d(16, 32, 3, padding=1), nn.Tanh(), nn.Flatten())
            head = [nn.Linear(_flat_size(body, channels, image_size), 32), nn.Tanh(), nn.Linear(32, num_classes)]
        else:
            body = nn.Sequential(nn.Conv2d(channels, 64, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                                 nn.Conv2d(64, 64, 3, padding=1), nn.Tanh(), nn.Flatten())
            head = [nn.Linear(_flat_size(body, channels, image_size), num_classes)]
        super().__init__(_Float(), _input_norm(groups, channels, group_norm), *body, *head)


def is_builtin(name: str | None) -> bool:
    return name in BUILTIN_MODELS


def check_model_name(name: str) -> None:
    """The form of --model (whether it imports is checked where the model is built)."""
    if is_builtin(name) or name in SCATTER_MODELS:
        return
    if name.startswith(TORCHVISION):
        if not name[len(TORCHVISION):]:
            raise ConfigError(f"--model: {name!r} names no torchvision model; e.g. torchvision:resnet18")
        return
    module, _, attribute = name.partition(":")
    if not (module and attribute and all(p.isidentifier() for p in module.split("."))
            and all(p.isidentifier() for p in attribute.split("."))):
        raise ConfigError(f"--model: unknown model {name!r}; give {MODEL_FORMS}")


_SAID: set[str] = set()


def _say_once(note: str) -> None:
    """A FedsdNote, once a process: a run builds its network more than once (planning, training)."""
    if note not in _SAID:
        _SAID.add(note)
        warnings.warn(note, FedsdNote, stacklevel=3)


def check_private_trainable(model: nn.Module, fix: bool = False, name: str = "the model") -> nn.Module:
    """Refuse, naming the layer, a model DP-SGD cannot train per sample; with fix=True, what
    Opacus' ModuleValidator can fix (BatchNorm → GroupNorm) is fixed first and said once (a
    FedsdNote naming the layers)."""
    from fedsd.clipping import _opacus  # noqa: F401  (Opacus without its root-logger handler)
    from opacus.validators import ModuleValidator

    if not ModuleValidator.validate(model, strict=False):
        return model
    if fix:
        before = {n: type(m).__name__ for n, m in model.named_modules()}
        model = ModuleValidator.fix(model)
        after = {n: type(m).__name__ for n, m in model.named_modules()}
        changed = [n for n in before if n in after and before[n] != after[n]]
        if changed:
            kinds = sorted({f"{before[n]} → {after[n]}" for n in changed})
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            _say_once(f"--model {name}: Opacus' ModuleValidator replaced {len(changed)} layer(s) "
                      f"({'; '.join(kinds)}: {shown}); BatchNorm mixes the samples of a batch, so it has no "
                      "per-sample gradients, and GroupNorm normalises each sample on its own")
        if not ModuleValidator.validate(model, strict=False):
            return model
    layers = [(n or type(model).__name__, type(m).__name__, e) for n, m in model.named_modules()
              if not list(m.children()) for e in ModuleValidator.validate(m, strict=False)]
    listed = "; ".join(f"layer {n} ({kind}): {str(e).split('. ')[0]}" for n, kind, e in layers) or \
        "; ".join(str(e).split(". ")[0] for e in ModuleValidator.validate(model, strict=False))
    hint = "" if fix else " (fix=True lets Opacus replace BatchNorm with GroupNorm)"
    raise ModelNotPrivateError(f"--model {name}: cannot be trained with DP-SGD: {listed}{hint}")


def _factory(name: str):
    """A user's network factory, imported from the Python path as it is (fedsd never changes
    sys.path; the `fedsd` command puts the working directory on it, as `python -m` does)."""
    module_name, _, attribute = name.partition(":")
    try:
        found = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model {name}: module {module_name!r} does not import ({e}); it must be on the Python "
                          "path or in the working directory (a deployment: inside the Flower app)") from e
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"--model {name}: {module_name} has no {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"--model {name}: {attribute!r} is not callable; give a function or class that takes "
                          "num_classes, channels and image_size and returns an nn.Module")
    return found


def _torchvision_model(name: str, num_classes: int, channels: int) -> nn.Module:
    import torchvision

    arch = name[len(TORCHVISION):]
    if arch not in torchvision.models.list_models(module=torchvision.models):
        raise ConfigError(f"--model {name}: torchvision has no classification model {arch!r}; e.g. resnet18, "
                          "mobilenet_v3_small, efficientnet_b0 (torchvision.models.list_models)")
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if channels != 3:  # the first convolution, made for the task's channels (same shape otherwise)
        for parent in model.modules():
            for child_name, child in parent.named_children():
                if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                    setattr(parent, child_name, nn.Conv2d(
                        channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                        child.dilation, child.groups, child.bias is not None, child.padding_mode))
                    return model
    return model


def _built(name: str, num_classes: int, activation: str, channels: int, image_size: int,
           feature_norm: str = "group") -> nn.Module:
    if name == "mnist-cnn":
        return MnistCNN(num_classes, activation)
    if name == "cifar-cnn":
        return CifarCNN(num_classes, activation)
    if activation != "relu":
        raise ConfigError(f"--activation {activation}: applies to the papers' networks (mnist-cnn, cifar-cnn), "
                          f"not to --model {name}")
    if name in SCATTER_MODELS:
        return (ScatterLinear if name == "scatter-linear" else ScatterCNN)(num_classes, channels, image_size,
                                                                           group_norm=feature_norm == "group")
    if name.startswith(TORCHVISION):
        return _torchvision_model(name, num_classes, channels)
    try:
        model = _factory(name)(num_classes=num_classes, channels=channels, image_size=image_size)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (the user's code: said with the path, its traceback kept)
        raise ConfigError(f"--model {name}: calling it with num_classes={num_classes}, channels={channels}, "
                          f"image_size={image_size} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {name}: returned {type(model).__name__}, not a torch.nn.Module")
    return model.train()


def build_model(name: str, num_classes: int = 10, seed: int | None = None, activation: str = "relu",
                channels: int | None = None, image_size: int | None = None, feature_norm: str = "group",
                train_layers: str = "all", init_weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A fresh model for a task of `num_classes` classes of (channels, image_size, image_size)
    images (the papers' networks know theirs), made private-trainable (check_private_trainable);
    with `seed`, its initial weights depend on that seed only. `train_layers` freezes the blocks
    it does not train (fedsd.models.pretrained.freeze: before any BatchNorm is replaced, so a frozen
    one stays BatchNorm, in eval mode). `init_weights` (a state dict) is checked against the
    network as built, keys and shapes, and refused naming them; its values are then the
    network's, but for a head of another shape (made new, as the network's own start)."""
    check_model_name(name)
    if activation not in ACTIVATIONS:
        raise ConfigError(f"--activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if not is_builtin(name) and (channels is None or image_size is None):
        raise ValueError(f"build_model({name!r}): a network other than the papers' needs the task's channels and "
                         "image size")
    if seed is None:
        model = _built(name, num_classes, activation, channels, image_size, feature_norm)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _built(name, num_classes, activation, channels, image_size, feature_norm)
    replaced = check_init_weights(model, init_weights, name)
    if train_layers != "all":
        pretrained.freeze(model, train_layers)
    if not is_builtin(name):
        for module in model.modules():  # the same function out of place: Opacus' backward hooks
            if getattr(module, "inplace", False) is True:  # cannot follow an in-place op (resnet's ReLU)
                module.inplace = False
        model = check_private_trainable(model, fix=True, name=name)
        model = followable_by_hooks(model, name, (channels, image_size, image_size))
    if init_weights is not None:
        pretrained.load(model, pretrained.values_to_load(model, init_weights, replaced))
    return model


def check_init_weights(model: nn.Module, init_weights: dict[str, torch.Tensor] | None, name: str) -> list[str]:
    """A weights file's state dict against the network as built (before any layer is replaced):
    ConfigError naming the missing, unexpected and mismatched keys; returns the head's keys that
    are made new (the file's head has another shape: another task's classes)."""
    if init_weights is None:
        return []
    found = pretrained.compare(model.state_dict(), init_weights, pretrained.blocks(model)[-1][0])
    refusal = found.refusal()
    if refusal:
        raise ConfigError(f"--init-weights: does not fit --model {name}: {refusal}")
    return found.head_replaced


# Whether a network (its name, input shape and class) is traced (followable_by_hooks), decided
# on its first build in this process: a run builds its network several times (the
# route's candidates, the memory estimate, the trainer), each the same code with other weights.
_TRACED: dict[tuple[str, tuple[int, ...], str], bool] = {}


def followable_by_hooks(model: nn.Module, name: str, input_shape: tuple[int, ...]) -> nn.Module:
    """The model, or the same function traced with torch.fx where only the trace lets Opacus'
    hooks follow it.

    Opacus' hook modes (hooks, functorch's and ghost clipping's) pass each layer's output through
    its backward hook. An in-place op on that output, as resnet's `out += identity`, is then
    refused by autograd, and only expanded weights could train the network: for resnet18 at
    B = 256 on an H200 its step took 1.5× the hooks' (results/README.md, the GPU checks).
    torch.fx records `+=` on a traced value as an out-of-place add, the same function on the
    same modules and weights (the same state_dict keys). The trace is kept only where the hooks
    fail on the model and follow the trace, and where the trace is one graph in training and in
    evaluation (a forward that branches on self.training is left as it is)."""
    import torch.fx

    key = (name, tuple(input_shape), type(model).__qualname__)
    if key in _TRACED:
        return torch.fx.symbolic_trace(model.train()).train() if _TRACED[key] else model
    _TRACED[key] = False
    if _hooks_follow(model, input_shape):
        return model
    try:
        traced = torch.fx.symbolic_trace(model.train())
        same_in_eval = torch.fx.symbolic_trace(model.eval()).code == traced.code
    except Exception:  # noqa: BLE001  (not traceable: left as it is; expanded weights still train it)
        return model.train()
    model.train()
    if not same_in_eval or not _hooks_follow(traced, input_shape):
        return model
    _TRACED[key] = True
    _say_once(f"--model {name}: traced with torch.fx, which makes its in-place additions out of place, so that "
              "Opacus' per-layer hooks can follow it (the same function and weights)")
    return traced.train()


def traced_for_hooks(cfg, num_classes: int) -> bool:
    """Whether a run's network is traced for Opacus' hooks (followable_by_hooks), as its route's
    hook modes are timed on it: decided on the network's first build in this process (built
    here where it has not been). The papers' networks never are."""
    if is_builtin(cfg.model):
        return False
    channels, size, _ = input_shape_of(cfg)
    network = (cfg.model, (channels, size, size))  # _TRACED's key less the class, which a build gives
    if not any(key[:2] == network for key in _TRACED):
        model_for(cfg, num_classes, seed=0)
    return any(traced for key, traced in _TRACED.items() if key[:2] == network)


def _hooks_follow(model: nn.Module, input_shape: tuple[int, ...]) -> bool:
    """Whether a forward pass through Opacus' hooks runs: False only for autograd's refusal of
    an in-place op on a hooked output (any other failure is said by check_fits_task or when
    the route is measured)."""
    import copy

    from fedsd.clipping import _opacus  # noqa: F401  (Opacus without its root-logger handler)
    from opacus import GradSampleModule

    try:
        probe = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
        with torch.random.fork_rng(devices=[]):  # a dropout draws nothing of the run's
            probe(torch.zeros((2, *input_shape)))
    except RuntimeError as e:
        return "modified inplace" not in str(e)
    except Exception:  # noqa: BLE001
        return True
    return True


def image_shape_of(cfg) -> tuple[int, int]:
    """(channels, side) of a run's square images: a built-in data set's, or a custom task's."""
    return (cfg.channels, cfg.image_size) if cfg.dataset == CUSTOM else BUILTIN_SHAPES[cfg.dataset]


def input_shape_of(cfg) -> tuple[int, int, int]:
    """(channels, height, width) of what a (resolved) run's network takes: its images, or their features."""
    channels, size = image_shape_of(cfg)
    if cfg.features == "backbone":
        return backbone_shape(cfg)
    return feature_shape(channels, size) if cfg.features == "scatter" else (channels, size, size)


def convolutional(model: nn.Module) -> bool:
    """Whether the network has a 2-d convolution, frozen or trained: the layers channels-last is
    for (--memory-format auto lays out every other network NCHW)."""
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def model_for(cfg, num_classes: int, seed: int | None = None, weights: bool = False) -> nn.Module:
    """The network of a (resolved) run, for its task: its trained blocks only under --features
    backbone (the frozen ones compute the features, `backbone_for`). weights=True: with
    --init-weights' values (the run's initial model; the file is read and its sha256 checked
    where the run names one); else the network's own start (its structure is the same)."""
    full = _full_network(cfg, num_classes, seed, weights)
    return _tail(full, cfg.train_layers) if cfg.features == "backbone" else full


def _full_network(cfg, num_classes: int, seed: int | None, weights: bool) -> nn.Module:
    channels, size = image_shape_of(cfg)
    if cfg.features == "scatter":
        channels, size, _ = input_shape_of(cfg)
    init = None
    if weights and cfg.init_weights:
        init = pretrained.read_weights(cfg.init_weights, cfg.init_weights_sha256)[0]
    return build_model(cfg.model, num_classes, seed=seed, activation=cfg.activation, channels=channels,
                       image_size=size, feature_norm=cfg.feature_norm, train_layers=cfg.train_layers,
                       init_weights=init)


# The name of the flattening a backbone's flat features pass through first (no weights)
FLAT_FEATURES = "features_flat"


def _split(full: nn.Module, train_layers: str) -> int:
    """Where a network's frozen blocks end: the position, among its top-level children, of its
    first trained block (--features backbone needs an nn.Sequential: the order of its
    children is the order of its computation)."""
    if not isinstance(full, nn.Sequential):
        raise ConfigError(f"--features backbone: needs a network that is an nn.Sequential (the papers' networks, or "
                          f"your own), where the frozen blocks' output is what the trained ones take; this one is "
                          f"{type(full).__name__}: train it with --train-layers on pixels instead")
    names = list(full._modules)
    return names.index(pretrained.blocks(full)[-pretrained.trained_count(
        train_layers, len(pretrained.blocks(full)))][0])


def _backbone_output(full: nn.Module, cut: int, input_shape: tuple[int, ...]) -> tuple[int, ...]:
    front = nn.Sequential(*list(full.children())[:cut]).eval()
    with torch.no_grad():
        return tuple(front(torch.zeros(1, *input_shape)).shape[1:])


def _tail(full: nn.Module, train_layers: str) -> nn.Module:
    """The trained blocks of a network, under their own names (so their keys are the full
    network's), after a flattening where the frozen blocks give flat features (kept as
    (N, D, 1, 1))."""
    from collections import OrderedDict

    cut = _split(full, train_layers)
    items = list(full._modules.items())[cut:]
    first_input = _first_input_rank(full, cut)
    return nn.Sequential(OrderedDict(([(FLAT_FEATURES, nn.Flatten())] if first_input == 2 else []) + items)).train()


def _first_input_rank(full: nn.Module, cut: int) -> int:
    """The rank of what the first trained block takes: 2 after a Flatten, else 4 (images)."""
    return 2 if any(isinstance(m, nn.Flatten) for m in list(full.children())[:cut]) else 4


_BACKBONE_SHAPES: dict[tuple, tuple[int, int, int]] = {}


def backbone_shape(cfg) -> tuple[int, int, int]:
    """(channels, height, width) of the frozen blocks' output, as the features keep it: flat
    features as (D, 1, 1)."""
    key = (cfg.model, cfg.activation, cfg.train_layers, image_shape_of(cfg))
    if key not in _BACKBONE_SHAPES:
        channels, size = image_shape_of(cfg)
        full = build_model(cfg.model, 10, seed=0, activation=cfg.activation, channels=channels, image_size=size,
                           train_layers=cfg.train_layers)
        shape = _backbone_output(full, _split(full, cfg.train_layers), (channels, size, size))
        _BACKBONE_SHAPES[key] = shape if len(shape) == 3 else (shape[0], 1, 1)
    return _BACKBONE_SHAPES[key]


def backbone_for(cfg, num_classes: int = 10) -> "features.Backbone":
    """The frozen blocks of a --features backbone run with --init-weights' values, in eval
    mode, as fedsd.data.features computes and caches their output (keyed by the file's sha256)."""
    channels, size = image_shape_of(cfg)
    state, sha = pretrained.read_weights(cfg.init_weights, cfg.init_weights_sha256)
    full = build_model(cfg.model, num_classes, seed=0, activation=cfg.activation, channels=channels, image_size=size,
                       train_layers=cfg.train_layers)
    cut = _split(full, cfg.train_layers)
    front = nn.Sequential(*list(full.children())[:cut])
    own = front.state_dict()
    names = list(full._modules)[:cut]
    values = {k: state[f"{names[int(k.split('.')[0])]}.{k.split('.', 1)[1]}"] for k in own}
    pretrained.load(front, values)
    key = f"{sha}-{cfg.model}-{cfg.activation}-{cfg.train_layers}-{channels}x{size}"
    return features.Backbone(front.eval().requires_grad_(False), key, backbone_shape(cfg))


def feature_source(cfg, num_classes: int = 10):
    """What fedsd.data.features.inputs makes a run's inputs with: "none", "scatter", or the
    pretrained frozen blocks (--features backbone)."""
    return backbone_for(cfg, num_classes) if cfg.features == "backbone" else cfg.features


def check_fits_task(model: nn.Module, name: str, num_classes: int, input_shape: tuple[int, ...]) -> None:
    """One forward pass on a single sample: the model takes the task's images and gives one
    logit per class; refused naming both shapes otherwise."""
    x = torch.zeros((1, *input_shape))
    expected = (1, num_classes)
    try:
        with torch.no_grad():
            out = model.eval()(x)
    except Exception as e:  # noqa: BLE001  (the user's network: said with both shapes)
        raise ConfigError(f"--model {name}: does not take the task's input {tuple(x.shape)} (one sample of "
                          f"{input_shape[0]} channel(s), {input_shape[1]}×{input_shape[2]}): "
                          f"{type(e).__name__}: {e}") from e
    finally:
        model.train()
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"--model {name}: on the task's input {tuple(x.shape)} it returns {shape}; expected "
                          f"logits of shape {expected} (one per class)")


def with_pinned_weights(cfg):
    """A run's settings with its --init-weights file pinned: its sha256 filled in (or checked,
    where given: another file is refused), so that every party that reads the file later (a
    simulation's workers, a resumed run, load_model) refuses any other. The path is kept as
    given (relative to the working directory, which a simulation's workers share). The file is
    read with weights_only=True."""
    import dataclasses

    if not cfg.init_weights:
        return cfg
    sha = pretrained.read_weights(cfg.init_weights, cfg.init_weights_sha256)[1]
    return dataclasses.replace(cfg, init_weights_sha256=sha)


def start_report(cfg, num_classes: int) -> dict | None:
    """What a run starts from and trains, for result.json (`pretrained`), the summary and the
    dry run: the weights file and its sha256, the blocks trained and frozen, the head made new
    (its keys), the BatchNorms that run in eval mode with their pretrained statistics, and the
    weights trained and frozen. None for a run of the whole network from its own start."""
    if not cfg.init_weights and cfg.train_layers == "all":
        return None
    channels, size = image_shape_of(cfg)
    if cfg.features == "scatter":
        channels, size, _ = input_shape_of(cfg)
    with torch.random.fork_rng(devices=[]):
        raw = _built(cfg.model, num_classes, cfg.activation, channels, size, cfg.feature_norm)
    replaced = []
    if cfg.init_weights:
        replaced = check_init_weights(raw, pretrained.read_weights(cfg.init_weights, cfg.init_weights_sha256)[0],
                                      cfg.model)
    full = _full_network(cfg, num_classes, 0, False)
    names = [name for name, _ in pretrained.blocks(raw)]
    frozen = pretrained.frozen_blocks(raw, cfg.train_layers)
    return dict(init_weights=cfg.init_weights or None, sha256=cfg.init_weights_sha256 or None,
                train_layers=cfg.train_layers, features=cfg.features,
                trained_blocks=[n for n in names if n not in frozen], frozen_blocks=frozen, head_replaced=replaced,
                frozen_batchnorm=[n for n, m in full.named_modules() if pretrained.is_frozen_batchnorm(m)],
                trained_parameters=sum(p.numel() for p in full.parameters() if p.requires_grad),
                frozen_parameters=sum(p.numel() for p in full.parameters() if not p.requires_grad))

