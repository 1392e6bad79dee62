"""Training settings: the papers' defaults per data set (docs/algorithms.md), and the checks every setting
passes before any work starts.

`TrainConfig` is the run's own settings (`RunConfig`, below) and every registered method's
(fedsd.methods: each method declares its settings in its own file, named for it, such as
`dp3sd_alpha`, with their defaults per data set and their checks; settings every method or every
self-distilling method shares, such as `release`, are declared once in fedsd/methods/base.py). It
is declared once, below, and its method settings join it when fedsd loads, from the methods
registered then (`with_method_settings`): a method's settings class joins it by the method's
registration alone, a plugin's too. A type checker sees it as declared, the run's own settings; a
method's code types its `cfg` by what it reads (fedsd.methods.base.MethodRun). This module names
no method."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TypeVar

from fedsd import clipping as clippers, methods
from fedsd.data.datasets import CUSTOM, DATASET_TITLES, DATASETS
from fedsd.data.features import FEATURE_NORMS, FEATURES, check_features
from fedsd.models.networks import (ACTIVATIONS, DEFAULT_MODEL, MODEL_FORMS, SCATTER_MODELS, check_model_name,
                                   image_shape_of, is_builtin)
from fedsd.models.pretrained import check_train_layers
from fedsd.settings.declared import Setting, check_choices, check_setting, declared_only, setting, settings_of
from fedsd.errors import ConfigError

METHODS = tuple(methods.METHODS)
ACCOUNTANTS = ("rdp", "prv")
DEVICES = ("cpu", "cuda", "auto")
# The clipping routes (fedsd.clipping: Opacus' per-sample gradients, ghost clipping, fedsd's
# book-keeping), and auto: chosen by a rule that reads no clock, and recorded (fedsd.clipping.routes)
GRAD_SAMPLE_MODES = ("auto",) + tuple(clippers.CLIPPERS)
# How images and activations are laid out in memory: channels-last runs this project's
# convolutions about twice as fast on CPU (results/perf.md); "contiguous" is PyTorch's NCHW.
# Opacus' hooks and ghost clipping compute wrong per-sample convolution gradients on
# channels-last tensors (their im2col assumes NCHW strides: weights off by 1e-2 after two
# epochs, tests/clipping/test_grad_sample_modes.py), so "auto" takes channels-last only for the modes
# that are exact under it.
MEMORY_FORMATS = ("auto", "channels-last", "contiguous")
CHANNELS_LAST_EXACT = ("auto",) + clippers.CHANNELS_LAST_EXACT

# The papers' B, η, C, epochs (docs/algorithms.md, "Settings and their defaults"); each method's own
# settings are in its file, fedsd/methods/
PAPER = {
    "mnist": dict(batch_size=1200, lr=0.8, clip=0.1, epochs=60),
    "fmnist": dict(batch_size=1600, lr=3.0, clip=0.1, epochs=60),
    "cifar10": dict(batch_size=1000, lr=3.0, clip=0.1, epochs=100),
}
# Settings the papers leave open: SGD's momentum and the DP runs' length (those of a method,
# such as DPKD's loss and stage split, are in its file).
# Momentum was chosen per data set on a validation split (results/sweeps/*-momentum, dpsgd,
# ε = 3; MNIST and FMNIST 15 epochs, CIFAR-10 30: 0.9 wins on all three; results/README.md
# has the numbers).
OPEN_DEFAULTS = {"momentum": {"mnist": 0.9, "fmnist": 0.9, "cifar10": 0.9}}
# The DP runs' length per data set and ε, chosen on the validation split with dpsgd, one length
# for all methods of a data set at that ε: the shortest within one standard error of the best
# (results/sweeps/*-dpsgd-eps*-length; CIFAR-10: cifar10-dpsgd-length, where 60 beat 100 at
# ε = 3, and cifar10-dpsgd-eps1-length). σ is calibrated to the length, so a smaller budget is
# spent best in fewer, less noisy epochs. A run at an ε between those swept takes the length of
# the largest swept ε below it (below them all: the smallest's). MNIST at ε = 3 keeps the
# papers' 60 (the sweep's best). CIFAR-10 at ε = 2 is not swept: it keeps ε = 3's 60.
EPOCHS_BY_EPSILON = {"mnist": {1: 30, 2: 60, 3: 60}, "fmnist": {1: 15, 2: 20, 3: 30},
                     "cifar10": {1: 15, 2: 60, 3: 60}}


def default_epochs(dataset: str, epsilon: float) -> int:
    """The length chosen on validation for this data set at this ε (EPOCHS_BY_EPSILON)."""
    chosen = EPOCHS_BY_EPSILON[dataset]
    swept = [e for e in sorted(chosen) if e <= epsilon] or [min(chosen)]
    return chosen[swept[-1]]
# The papers give one learning rate, for their batch size. At another B the default lr is
# lr_paper · (B / B_paper)^LR_BATCH_EXPONENT, the exponent chosen on a validation split
# (results/sweeps/fmnist-dp3sd-batch-lr; results/README.md): the papers' lr of 3 at B = 16
# diverges within an epoch.
LR_BATCH_EXPONENT = 1.0


def _epochs_text() -> str:
    """The help text of --epochs' default: the lengths chosen per data set and ε."""
    parts = []
    for d, chosen in EPOCHS_BY_EPSILON.items():
        swept = sorted(chosen)
        if len(swept) == 1:
            parts.append(f"{DATASET_TITLES[d]} {chosen[swept[0]]} at every ε")
            continue
        bounds = [f"ε < {swept[1]:g}"] + [f"{a:g} ≤ ε < {b:g}" for a, b in zip(swept[1:], swept[2:])] + \
                 [f"ε ≥ {swept[-1]:g}"]
        parts.append(f"{DATASET_TITLES[d]} " + ", ".join(f"{chosen[e]} at {b}" for e, b in zip(swept, bounds)))
    return "chosen on validation per data set and ε: " + "; ".join(parts)


def _paper_text(key: str) -> str:
    """The help text of a default that is the paper's value for the data set."""
    values = ", ".join(f"{DATASET_TITLES[d]} {PAPER[d][key]}" for d in PAPER)
    return f"the paper's value for the data set: {values}"


@dataclass
class RunConfig:
    """A training run's own settings, those of every method (TrainConfig adds the methods')."""

    dataset: str = setting("fmnist", "data set; custom: your own images (--data-dir; each deployed client's "
                           "own data), their classes, image size and channels read from the files unless given",
                           choices=DATASETS + (CUSTOM,))
    method: str = setting("dp3sd", "training method", choices=METHODS)
    epsilon: float = setting(3.0, "privacy budget ε of the whole run (a client's, federated)")
    delta: float = setting(1e-5, "privacy δ; must be below 1/n (1e-5: DPDSD's, in its Table 1's caption; DP3SD "
                                 "states none)")
    epochs: int | None = setting(None, "passes over the training data (federated: derived from rounds)",
                                 default_text=_epochs_text())
    batch_size: int | None = setting(None, "expected batch size B (Poisson sampling at q = B/n)",
                                     default_text=_paper_text("batch_size"))
    lr: float | None = setting(None, "learning rate", default_text=_paper_text("lr") + " at the papers' batch "
                               "size; at another B, times (B / B_paper)"
                               + (f"^{LR_BATCH_EXPONENT:g}" if LR_BATCH_EXPONENT != 1 else "")
                               + " (chosen on validation)")
    clip: float | None = setting(None, "per-sample clipping norm C", default_text=_paper_text("clip"))
    clip_quantile: float = setting(0.0, "adaptive clipping (Andrew et al. 2021): --clip is where the clip starts, and "
                                   "it follows this quantile of the per-sample gradient norms, each step's noised "
                                   "count of the norms below it composed into the run's ε; 0: C stays --clip")
    clip_lr: float = setting(0.2, "--clip-quantile: the clip's geometric learning rate η (the paper's 0.2)")
    clip_normalize: bool = setting(False, "--clip-quantile: take each step in units of the clip, the private "
                                   "gradient divided by the clip of the step, so that --lr is the step per unit of "
                                   "clip (a fixed-clip recipe's lr × C) and the clip moves which samples are clipped, "
                                   "not the step's size (post-processing)")
    clip_count_noise: float = setting(0.0, "--clip-quantile: the std σ_b of the noise on each step's count (0: B/20, "
                                      "the paper's); the gradient's noise multiplier is lowered so that the two "
                                      "spend the run's ε (the paper's Theorem 1)")
    momentum: float | None = setting(None, "SGD momentum",
                                     default_text="chosen per data set on validation: 0.9 for MNIST, FMNIST "
                                                  "and CIFAR-10")
    accountant: str = setting("rdp", "Opacus accountant that calibrates σ and reports ε", choices=ACCOUNTANTS)
    subset: int | None = setting(None, "train on a seeded, class-stratified subset of this size",
                                 default_text="the whole training set")
    validation: int = setting(0, "training samples held out (fixed, stratified) for choosing settings")
    seed: int = setting(0, "seed of the model, the sampling and the noise")
    device: str = setting("auto", "where to train: auto = CUDA where torch sees a GPU, else the CPU (each party "
                          "of a federation decides on its own machine)", choices=DEVICES)
    model: str | None = setting(None, f"network: {MODEL_FORMS} (a factory called with num_classes, channels and "
                                "image_size; README: bring your own network)", default_text="the data set's")
    features: str = setting("none", "fixed features each party computes from its own images before training: none, "
                            "or scatter (Tramèr & Boneh's ScatterNet: a wavelet scattering transform, J = 2, L = 8; "
                            "no privacy cost; trains scatter-linear or scatter-cnn), or backbone (with --init-weights: "
                            "the output of the network's frozen blocks, computed once per data set and cached, so "
                            "only the trained blocks run in each step)", choices=FEATURES)
    feature_norm: str = setting("group", "how scatter features are normalised: group (GroupNorm in the network, each "
                                "sample on its own: no privacy cost) or private (Tramèr & Boneh's: the training "
                                "set's mean and variance per channel, released with Gaussian noise; that ε is "
                                "composed into the run's, and DP-SGD's σ calibrated to what is left; central runs)",
                                choices=FEATURE_NORMS)
    feature_norm_noise: float = setting(8.0, "--feature-norm private: the noise multiplier of its two Gaussian "
                                        "releases (Tramèr & Boneh's 8)")
    init_weights: str = setting("", "start from these weights (a public input: a network pretrained on public "
                                "data): a state dict file, or a torchvision or timm weights file, read with "
                                "weights_only=True; its keys and shapes are checked against the network before any "
                                "work, and a head of another shape is made new for the task's classes",
                                default_text="\"\": the network's own random start")
    init_weights_sha256: str = setting("", "the sha256 the --init-weights file must have (another file is "
                                       "refused); filled in from the file where not given, and recorded in "
                                       "result.json's config", default_text="\"\": the file's own")
    train_layers: str = setting("all", "what DP-SGD trains: all, head (the last block), or last:N (the last N of "
                                "the network's top-level blocks that hold weights); the rest is frozen (no "
                                "per-sample gradient, no clipping, BatchNorm in eval mode with its pretrained "
                                "statistics) and spends no ε")
    public_first: int = setting(0, "the first N training images are public (the set --init-weights was pretrained "
                                "on: fedsd pretrain --first N) and are left out of the private training set")
    activation: str = setting("relu", "the network's activation: relu (the papers') or tanh (Tramèr & Boneh's "
                                      "variant)", choices=tuple(ACTIVATIONS))
    threads: int = setting(0, "torch CPU threads; 0 leaves torch's default")
    max_physical_batch_size: int = setting(0, "the most samples one forward and backward pass takes: a larger "
                                           "Poisson batch is trained in parts whose clipped sums are added before "
                                           "its one noisy step (Opacus' BatchMemoryManager; same weights and ε); 0 = "
                                           "what fits in memory, estimated from the model on each machine")
    grad_sample_mode: str = setting("auto", "per-sample clipping route; all give the same weights (to float "
                                    "rounding) and ε (auto: chosen by a rule of the network's shapes and the CPU's "
                                    "instruction set, never by a clock, and recorded with the run: --route gives "
                                    "it back)", choices=GRAD_SAMPLE_MODES)
    memory_format: str = setting("auto", "image and activation layout; auto: channels-last where the "
                                 "clipping mode is exact under it and the network has a convolution",
                                 choices=MEMORY_FORMATS)
    route: str = setting("", "the clipping route to take, as a run records it: MODE:LAYOUT, or for bk "
                         "bk:LAYOUT:INDEX=WAY,... (e.g. bk:channels-last:0=kernel,1=ghost; fedsd train --route-from "
                         "RUN gives a run's back): that run's weights on any machine with the same thread count and "
                         "instruction set", default_text="\"\": --grad-sample-mode's")
    classes: str = setting("", "dataset=custom: the class names in label order, comma-separated",
                           default_text="read from the data: its class folders, sorted, or an .npz's labels 0 … K−1")
    image_size: int = setting(0, "dataset=custom: the square size images are resized to",
                              default_text="the images' own size, when they are all one square size")
    channels: int = setting(0, "dataset=custom: 1 (grey) or 3 (RGB)",
                            default_text="3 if any image is in colour, else 1")
    mean: str = setting("", "normalisation mean per channel, comma-separated; \"\" = the built-in data "
                        "set's standard constants (never statistics of a client's private data)")
    std: str = setting("", "normalisation std per channel, comma-separated (as mean)")
    data_dir: str | None = setting(None, "root holding mnist/, fashion-mnist/, cifar10/; dataset=custom: your "
                                   "folder train/<class>/<image> (optionally test/), a folder <class>/<image> "
                                   "(ImageFolder) or an .npz file",
                                   default_text="FEDSD_DATA_DIR, then Debian's fashion-mnist")
    download: bool = setting(False, "download the data set with torchvision when it is not found")
    extra: dict = field(default_factory=dict)

    def resolved(self):
        """A copy with every open setting filled with the papers' default for this data set."""
        _check_choice("--dataset", self.dataset, DATASETS + (CUSTOM,))
        _check_choice("--method", self.method, METHODS)
        c = dataclasses.replace(self)
        if c.model is None and c.dataset == CUSTOM and c.features == "scatter":
            c.model = "scatter-cnn" if c.channels == 3 else "scatter-linear"
        elif c.model is None and c.dataset == CUSTOM:
            c.model = "mnist-cnn" if (c.channels, c.image_size) == (1, 28) else "cifar-cnn"
        # A custom task takes the papers' settings of the data set its model was made for.
        reference = c.reference_dataset
        paper = PAPER[reference]
        if c.epochs is None:
            c.epochs = default_epochs(reference, c.epsilon)
        for key in ("batch_size", "clip"):
            if getattr(c, key) is None:
                setattr(c, key, paper[key])
        if c.lr is None:
            c.lr = paper["lr"] * (c.batch_size / paper["batch_size"]) ** LR_BATCH_EXPONENT
        if c.momentum is None:
            c.momentum = OPEN_DEFAULTS["momentum"][reference]
        if c.model is None:
            c.model = (("scatter-cnn" if reference == "cifar10" else "scatter-linear") if c.features == "scatter"
                       else DEFAULT_MODEL[c.dataset])
        for s in method_settings(c.method):  # the method's, in its declaration order
            if getattr(c, s.name) is None and s.resolve is not None:
                setattr(c, s.name, _resolved(s.resolve, c, reference))
        return c

    @property
    def reference_dataset(self) -> str:
        """The data set whose papers' settings this run takes (a custom task: the one its
        model was made for)."""
        if self.dataset != CUSTOM:
            return self.dataset
        if is_builtin(self.model) or self.model is None:
            return "fmnist" if (self.model or "mnist-cnn") == "mnist-cnn" else "cifar10"
        return "fmnist" if self.channels == 1 else "cifar10"  # another network: by the images it takes

    @property
    def channels_last(self) -> bool:
        """Whether this run lays its images and activations out channels-last (see MEMORY_FORMATS)."""
        if self.memory_format == "auto":
            return self.grad_sample_mode in CHANNELS_LAST_EXACT
        return self.memory_format == "channels-last"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict):
        """Settings as a run saved them, by any version of fedsd (settings.declared_only; fedsd
        0.1's method settings under their new names, renamed_settings)."""
        return cls(**declared_only(cls, renamed_settings(saved, saved.get("method"))))


# Method settings renamed in fedsd 0.2 (each word means one thing). Each carries its
# method's name, so α, β and τ each mean one method's: {old name: {method: new name}}. The old
# names still work for one release, with a note naming the new one.
RENAMED = {"tau_s": {"dp3sd": "dp3sd_tau_s"}, "tau_t": {"dp3sd": "dp3sd_tau_t"},
           "alpha": {"dp3sd": "dp3sd_alpha", "dpdsd": "dpdsd_alpha", "dpkd": "dpkd_alpha"},
           "kl_reduction": {"dp3sd": "dp3sd_kl_reduction"}, "tau": {"dpdsd": "dpdsd_tau", "dpkd": "dpkd_tau"},
           "beta": {"dpdsd": "dpdsd_beta"}, "kd_teacher_epochs": {"dpkd": "dpkd_teacher_epochs"}}
RENAMED_TYPES = {"kl_reduction": str, "kd_teacher_epochs": int}  # the others are floats
UNSET = (None, -1, -1.0, "")  # an optional setting's "unset" (the flat form writes -1 or "")


def renamed_keys(flat: dict) -> dict:
    """A flat (kebab-case) dict, such as a run config or a recipe, with fedsd 0.1's method-setting
    keys under the run's method's new ones, each said in a note (renamed_settings)."""
    old = {k.replace("-", "_"): v for k, v in flat.items() if k.replace("-", "_") in RENAMED}
    new = renamed_settings(old, flat.get("method"), say="key")
    kept = {k: v for k, v in flat.items() if k.replace("-", "_") not in RENAMED}
    return {**kept, **{k.replace("_", "-"): v for k, v in new.items()}}


def renamed_settings(values: dict, method: str | None, say: str | None = None) -> dict:
    """`values` (by setting name) with each of fedsd 0.1's names under the run's method's new
    name. `say` ("flag" or "key"): what the user typed, said in a note with the new name, and an
    old name the method has no setting for is refused naming the methods that have one; without
    it (a run saved by 0.1 read back) an unset or foreign old name is dropped quietly."""
    import warnings

    from fedsd.errors import FedsdNote

    method = method or RunConfig.method
    out = dict(values)
    for old, by_method in RENAMED.items():
        if old not in out:
            continue
        value, new = out.pop(old), by_method.get(method)
        typed = {"flag": "--" + old.replace("_", "-"), "key": old.replace("_", "-")}.get(say)
        if value in UNSET and (say != "flag" or value is None):
            continue
        if new is None:
            if typed is None:
                continue
            names = ", ".join(f"{'--' if say == 'flag' else ''}{n.replace('_', '-')} ({m})"
                              for m, n in by_method.items())
            raise ConfigError(f"{typed}: renamed in fedsd 0.2, by method: {names}; --method {method} has none")
        if typed is not None:
            shown = ("--" if say == "flag" else "") + new.replace("_", "-")
            warnings.warn(FedsdNote(f"{typed}: renamed {shown} in fedsd 0.2 (the {method} setting); {typed} still "
                                    f"works in this release"), stacklevel=3)
        out.setdefault(new, value)
    return out


def _resolved(resolve, cfg, reference: str):
    """A method setting's default for this run: a value, {data set: value}, or a function of the config."""
    if callable(resolve):
        return resolve(cfg)
    if isinstance(resolve, dict):
        return resolve[reference]
    return resolve


def method_settings(method: str) -> list[Setting]:
    """The settings method `method` declares (its Settings dataclass), in declaration order."""
    return settings_of(methods.METHODS[method].Settings)


def method_groups(parser) -> dict:
    """{method setting: the argument group `--help` lists it in}: each method's own settings
    under its name, and those several methods share under theirs."""
    users: dict[str, list[str]] = {}
    for name in METHODS:
        for s in method_settings(name):
            users.setdefault(s.name, []).append(name)
    titles, groups = {}, {}
    for setting_name, names in users.items():
        title = ("every method's settings" if len(names) == len(METHODS) else
                 f"{names[0]}'s settings (--method {names[0]})" if len(names) == 1 else
                 f"settings {' and '.join(names)} share")
        if title not in titles:
            titles[title] = parser.add_argument_group(title)
        groups[setting_name] = titles[title]
    return groups


def _default_text(s: Setting) -> str | None:
    if s.default_text or s.resolve is None:
        return s.default_text
    if isinstance(s.resolve, dict):
        values = ", ".join(f"{DATASET_TITLES[d]} {v:g}" for d, v in s.resolve.items())
        return f"{s.source} value for the data set: {values}"
    return f"{s.resolve:g}, {s.source}" if s.source else f"{s.resolve:g}"


def _method_fields() -> list[tuple]:
    """TrainConfig's method settings: each declared by the methods that have it, one field per
    name, its help and default text the owners' (a setting several methods declare must have
    one type and one default)."""
    owners: dict[str, list[tuple[str, Setting]]] = {}
    for name in METHODS:
        for s in method_settings(name):
            owners.setdefault(s.name, []).append((name, s))
    fields = []
    for name, declared in owners.items():
        first = declared[0][1]
        kinds = {(s.type, s.optional, s.default, s.choices) for _, s in declared}
        if len(kinds) != 1:
            raise TypeError(f"setting {name!r} is declared differently by {', '.join(m for m, _ in declared)}")
        helps = list(dict.fromkeys(s.help for _, s in declared))
        help_text = helps[0] if len(helps) == 1 else "; ".join(f"{m}: {s.help}" for m, s in declared)
        texts = {_default_text(s) for _, s in declared}
        default_text = (texts.pop() if len(texts) == 1 else
                        "; ".join(f"{m.upper()} {_default_text(s)}" for m, s in declared if _default_text(s)))
        typ = first.type | None if first.optional else first.type
        fields.append((name, typ, setting(first.default, help_text, choices=first.choices, default_text=default_text)))
    return fields


ConfigClass = TypeVar("ConfigClass", bound=type)


def with_method_settings(cls: ConfigClass) -> ConfigClass:
    """Class decorator: `cls` (its bases and body kept) with one more field per setting of every
    registered method (`_method_fields`). A type checker sees `cls` as declared."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    assembled = dataclasses.make_dataclass(cls.__name__, _method_fields(), bases=cls.__bases__, namespace=namespace)
    assembled.__module__, assembled.__qualname__ = cls.__module__, cls.__qualname__
    return assembled


@with_method_settings
class TrainConfig(RunConfig):
    """A training run's settings, central or one client's: the run's own (RunConfig) and every registered
    method's (fedsd.methods), each declared once (fedsd.settings.declared)."""


def paper_batch_and_lr(cfg: TrainConfig) -> tuple[int, float]:
    """The papers' (B, lr) for the data set this run takes its settings from."""
    paper = PAPER[cfg.reference_dataset]
    return paper["batch_size"], paper["lr"]


def _check_choice(option: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{option}: unknown value {value!r}; choose one of {', '.join(map(str, allowed))}")


def check_layout(c: TrainConfig) -> None:
    """Refuse a layout under which the per-sample clipping mode computes wrong gradients."""
    check_setting(c.memory_format != "channels-last" or c.grad_sample_mode in CHANNELS_LAST_EXACT, "--memory-format",
           f"channels-last gives wrong per-sample gradients with --grad-sample-mode {c.grad_sample_mode} "
           f"(Opacus assumes NCHW); use auto, or a mode of {', '.join(CHANNELS_LAST_EXACT)}", c.memory_format)


def check_method_settings(c) -> None:
    """The run's method's settings against their declared checks and choices, then the
    method's own checks across them; a setting only other methods have, set to anything but
    its default, is refused with both named (it would be silently ignored). Its ema-decay and
    ema-warmup apply only to a run that releases an EMA."""
    own = {s.name: s for s in method_settings(c.method)}
    for s in settings_of(type(c)):
        if s.name in own or s.name not in METHOD_SETTING_NAMES:
            continue
        value = getattr(c, s.name)
        if value != s.default:
            owners = [m for m in METHODS if s.name in {x.name for x in method_settings(m)}]
            raise ConfigError(f"{s.flag}: a setting of {_listed(owners)}, not of --method {c.method}; leave it out")
    for s in own.values():
        value = getattr(c, s.name)
        if value is not None and s.check is not None:
            check_setting(s.check[0](value), s.flag, s.check[1], value)
    if methods.release_of(c) != "ema":
        for name in ("ema_decay", "ema_warmup"):
            s = own[name]
            if getattr(c, name) != s.default:
                raise ConfigError(f"{s.flag}: the released EMA's setting; this run releases its "
                                  f"{methods.release_of(c)} (use --method dpema or --release ema)")
    methods.METHODS[c.method].check(c)


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


METHOD_SETTING_NAMES = frozenset(s.name for m in METHODS for s in method_settings(m))


def validate(c: TrainConfig, num_train: int) -> None:
    """Check a resolved config against the data it will train on (`num_train` samples, the
    data set this privacy guarantee protects). Raises ConfigError naming the option."""
    check_choices(c)  # every setting with allowed values, as declared
    check_model_name(c.model)
    check_setting((c.features == "scatter") == (c.model in SCATTER_MODELS), "--features",
                  f"scatter trains {' or '.join(SCATTER_MODELS)}, and they train on it only (--model {c.model})",
                  c.features)
    check_features(c.features, image_shape_of(c)[1])
    check_setting(c.feature_norm == "group" or c.features == "scatter", "--feature-norm",
                  "applies to --features scatter", c.feature_norm)
    check_setting(math.isfinite(c.feature_norm_noise) and c.feature_norm_noise > 0, "--feature-norm-noise",
                  "must be > 0", c.feature_norm_noise)
    check_train_layers(c.train_layers)
    check_setting(c.features != "backbone" or bool(c.init_weights), "--features",
                  "backbone computes the output of pretrained frozen blocks: give --init-weights", c.features)
    check_setting(c.features != "backbone" or c.train_layers != "all", "--features",
                  "backbone needs frozen blocks: give --train-layers head or last:N", c.features)
    check_setting(not c.init_weights_sha256 or bool(c.init_weights), "--init-weights-sha256",
                  "applies to --init-weights", c.init_weights_sha256)
    check_setting(c.public_first >= 0, "--public-first", "must be >= 0", c.public_first)
    check_layout(c)
    if c.route:
        from fedsd.clipping.routes import Route

        # its form here; against the network where the run is planned (fedsd.clipping.routes.given)
        Route.from_spec(c.route)
        check_setting(c.grad_sample_mode == "auto", "--route", "takes the place of --grad-sample-mode; leave that auto",
                      c.route)
    check_setting(math.isfinite(c.epsilon) and c.epsilon > 0, "--epsilon", "must be > 0", c.epsilon)
    check_setting(0 < c.delta < 1.0 / num_train, "--delta",
           f"must be in (0, 1/n) = (0, {1.0 / num_train:.3g}) for n = {num_train} training samples", c.delta)
    check_setting(c.epochs >= 1, "--epochs", "must be >= 1", c.epochs)
    check_setting(c.batch_size >= 1, "--batch-size", "must be >= 1", c.batch_size)
    check_setting(c.batch_size <= num_train, "--batch-size",
           f"must not exceed the {num_train} training samples it samples from", c.batch_size)
    check_setting(math.isfinite(c.lr) and c.lr > 0, "--lr", "must be a finite number > 0", c.lr)
    check_setting(math.isfinite(c.clip) and c.clip > 0, "--clip", "must be a finite number > 0", c.clip)
    check_setting(c.clip_quantile == 0 or 0 < c.clip_quantile < 1, "--clip-quantile",
                  "must be in (0, 1), or 0 for a fixed clip", c.clip_quantile)
    check_setting(math.isfinite(c.clip_lr) and 0 < c.clip_lr <= 10, "--clip-lr", "must be in (0, 10]", c.clip_lr)
    check_setting(not c.clip_quantile or 1e-4 <= c.clip <= 1e6, "--clip", "with --clip-quantile, the clip's start "
                  "must be in [1e-4, 1e6] (fedsd.clipping.adaptive: the bounds float32 clips within)", c.clip)
    check_setting(not c.clip_normalize or bool(c.clip_quantile), "--clip-normalize", "applies to --clip-quantile",
                  c.clip_normalize)
    check_setting(math.isfinite(c.clip_count_noise) and c.clip_count_noise >= 0, "--clip-count-noise",
                  "must be a finite number > 0 (0: B/20)", c.clip_count_noise)
    check_setting(0 <= c.momentum < 1, "--momentum", "must be in [0, 1)", c.momentum)
    check_setting(c.threads >= 0, "--threads", "must be >= 0", c.threads)
    check_setting(c.max_physical_batch_size >= 0, "--max-physical-batch-size", "must be >= 0 (0: what fits)",
                  c.max_physical_batch_size)
    check_method_settings(c)
    if c.subset is not None:
        check_setting(c.subset >= 1, "--subset", "must be >= 1", c.subset)
    check_setting(c.validation >= 0, "--validation", "must be >= 0", c.validation)
