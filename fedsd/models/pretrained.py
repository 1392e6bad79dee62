"""Starting from a pretrained network (`--init-weights FILE`, `--train-layers`, `--features backbone`).

The weights are a public input: a network pretrained on public data, which never saw the
private data. Only what is trained spends ε. This module knows nothing of fedsd's networks; it
works on any `nn.Module` (fedsd.models.networks builds the network and calls it):

- `read_weights`: the file's state dict, read with `weights_only=True` (a plain state dict, a
  torchvision or timm weights file, or a checkpoint that holds one under "state_dict" or
  "model"), and its sha256, which the run records.
- `compare`: its keys and shapes against the network, before anything trains: missing and
  unexpected keys, and shapes that differ, refused by name; where only the head (the last
  block) differs in shape, a new head for the task's classes (initialised as the network's
  own), said in the summary.
- `blocks`, `frozen_blocks`, `freeze`, `frozen_keys`: `--train-layers all | head | last:N` counts the network's
  top-level children that hold weights (its blocks: for the papers' CNNs each layer, for a
  resnet conv1, bn1, layer1 … layer4, fc); the head is the last. The other blocks are frozen:
  their weights need no gradient, so no per-sample gradient and no clipping route, and a
  BatchNorm among them runs in eval mode with its pretrained statistics (`FrozenBatchNorm*`),
  which reads nothing of the private data, so it is private-safe. A trainable BatchNorm is
  replaced by GroupNorm (Opacus' ModuleValidator) as without pretrained weights.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fedsd.errors import ConfigError

TRAIN_LAYERS_FORMS = "all, head or last:N (the last N of the network's top-level blocks that hold weights)"
SHOWN = 6  # names listed in a refusal before "and N more"


def check_train_layers(spec: str) -> None:
    """The form of --train-layers (its N against the network is checked where it is built)."""
    if spec in ("all", "head"):
        return
    kind, _, count = spec.partition(":")
    if kind != "last" or not count.isdigit() or int(count) < 1:
        raise ConfigError(f"--train-layers: {spec!r} is not a choice; give {TRAIN_LAYERS_FORMS}")


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


_READ: dict[tuple, tuple[dict, str]] = {}  # (path, size, mtime) → (state dict, sha256): a run builds its network often


def read_weights(path: str | os.PathLike, expected_sha256: str = "") -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, sha256) of a weights file, read with weights_only=True (no code in it is
    run). ConfigError naming --init-weights for a missing file, one torch cannot read, one that
    holds no state dict, or one whose sha256 is not `expected_sha256` (where given)."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"--init-weights: {path}: cannot be read ({e.strerror or e})") from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _READ:
        sha = sha256_of(path)
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001  (whatever torch raises on a foreign or damaged file)
            raise ConfigError(f"--init-weights: {path}: not a weights file torch reads with weights_only=True "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        for wrapper in ("state_dict", "model"):  # a checkpoint that holds one
            if isinstance(loaded, dict) and isinstance(loaded.get(wrapper), dict):
                loaded = loaded[wrapper]
        if not isinstance(loaded, dict) or not loaded or not all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise ConfigError(f"--init-weights: {path}: holds no state dict (names to tensors); save one with "
                              f"torch.save(model.state_dict(), FILE)")
        _READ.clear()  # one file a process at a time
        _READ[key] = (dict(loaded), sha)
    state, sha = _READ[key]
    if expected_sha256 and sha != expected_sha256.lower():
        raise ConfigError(f"--init-weights: {path} has sha256 {sha}, not the {expected_sha256} this run was "
                          f"told to start from; other weights are refused")
    return state, sha


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The network's blocks: its top-level children that hold weights, in order (the head last)."""
    found = [(name, child) for name, child in model.named_children() if any(True for _ in child.parameters())]
    if not found:
        raise ConfigError("--train-layers: the network has no top-level block with weights")
    return found


def trained_count(spec: str, total: int) -> int:
    """How many of `total` blocks --train-layers trains (the last ones)."""
    if spec == "all":
        return total
    if spec == "head":
        return 1
    count = int(spec.partition(":")[2])
    if count > total:
        raise ConfigError(f"--train-layers: {spec} asks for more blocks than the network's {total}")
    return count


def frozen_blocks(model: nn.Module, spec: str) -> list[str]:
    """The names of the blocks --train-layers `spec` freezes (all but its last ones)."""
    found = blocks(model)
    return [name for name, _ in found[:len(found) - trained_count(spec, len(found))]]


class _Frozen:
    """A BatchNorm of a frozen block: always in eval mode, normalising by its pretrained
    statistics (never the batch's, never updated), whatever mode its network is put in."""

    def train(self, mode: bool = True):
        return super().train(False)

    def _check_input_dim(self, input):
        """None: the network is fixed, and torch.fx can then trace through it (a resnet's
        in-place additions made out of place for Opacus' hooks: fedsd.models.networks.followable_by_hooks)."""


FrozenBatchNorm1d = type("FrozenBatchNorm1d", (_Frozen, nn.BatchNorm1d), {"__module__": __name__})
FrozenBatchNorm2d = type("FrozenBatchNorm2d", (_Frozen, nn.BatchNorm2d), {"__module__": __name__})
FrozenBatchNorm3d = type("FrozenBatchNorm3d", (_Frozen, nn.BatchNorm3d), {"__module__": __name__})
_FROZEN_BN = {nn.BatchNorm1d: FrozenBatchNorm1d, nn.BatchNorm2d: FrozenBatchNorm2d, nn.BatchNorm3d: FrozenBatchNorm3d}


def freeze(model: nn.Module, spec: str) -> list[str]:
    """Freeze every block `spec` does not train, in place: no weight of it requires a gradient,
    and each BatchNorm in it runs in eval mode from now on. Returns the frozen BatchNorms' names."""
    frozen_bn = []
    for name in frozen_blocks(model, spec):
        block = getattr(model, name)
        block.requires_grad_(False)
        for sub_name, module in [("", block), *block.named_modules()]:
            if type(module) in _FROZEN_BN:
                module.__class__ = _FROZEN_BN[type(module)]
                module.eval()
                frozen_bn.append(f"{name}.{sub_name}" if sub_name else name)
    return sorted(set(frozen_bn))


def frozen_keys(model: nn.Module) -> list[str]:
    """The state-dict keys (every parameter and buffer) of a network's frozen blocks: its
    top-level blocks none of whose weights requires a gradient (`freeze`). None with
    --train-layers all, and none in a --features backbone run's trained tail."""
    frozen = {name for name, block in blocks(model) if not any(p.requires_grad for p in block.parameters())}
    return [k for k in model.state_dict() if k.split(".", 1)[0] in frozen]


def is_frozen_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, _Frozen)


@dataclass
class Comparison:
    """A weights file against a network: what fits, what is refused, the head that is new."""
    head: str  # the head block's name
    missing: list[str] = field(default_factory=list)  # the network's keys the file lacks
    unexpected: list[str] = field(default_factory=list)  # the file's keys the network lacks
    mismatched: list[str] = field(default_factory=list)  # "key: file (a, b) ≠ network (c, d)", outside the head
    head_replaced: list[str] = field(default_factory=list)  # the head's keys of another shape: a new head

    def refusal(self) -> str | None:
        parts = []
        for what, names in (("missing from the file", self.missing), ("not in the network", self.unexpected),
                            ("of another shape", self.mismatched)):
            if names:
                shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
                parts.append(f"{len(names)} key(s) {what}: {shown}")
        return "; ".join(parts) or None


def compare(network: dict[str, torch.Tensor], file: dict[str, torch.Tensor], head: str) -> Comparison:
    """`file`'s keys and shapes against `network`'s state dict (the network as built, before any
    layer is replaced). A head (keys under `head.`) whose shapes differ is made new; any other
    difference is listed for refusal."""
    found = Comparison(head)
    found.missing = [k for k in network if k not in file]
    found.unexpected = [k for k in file if k not in network]
    for k in network:
        if k in file and tuple(file[k].shape) != tuple(network[k].shape):
            if k.startswith(head + "."):
                found.head_replaced.append(k)
            else:
                found.mismatched.append(f"{k}: file {tuple(file[k].shape)} ≠ network {tuple(network[k].shape)}")
    if found.head_replaced:  # a new head is new whole: its keys the file also has take the network's own start
        found.head_replaced = [k for k in network if k.startswith(head + ".")]
    return found


def values_to_load(network: nn.Module, file: dict[str, torch.Tensor], replaced: list[str]) -> dict[str, torch.Tensor]:
    """The file's tensors for the network as it finally is (a trainable BatchNorm made GroupNorm
    keeps its affine weights, not its running statistics), less the replaced head's keys."""
    own = network.state_dict()
    return {k: v for k, v in file.items()
            if k in own and k not in replaced and tuple(v.shape) == tuple(own[k].shape)}


def load(network: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy `values` into the network's weights and buffers, bit for bit, in their dtype."""
    own = network.state_dict()
    with torch.no_grad():
        for k, v in values.items():
            own[k].copy_(v.to(own[k].dtype))


def start_line(report: dict | None) -> str | None:
    """One line of `start_report` for a person (the summary, the dry run)."""
    if report is None:
        return None
    parts = []
    if report.get("init_weights"):
        parts.append(f"from {report['init_weights']} (sha256 {report['sha256'][:16]}…)")
    trained = report["trained_blocks"]
    parts.append(f"trains {', '.join(trained) if report['frozen_blocks'] else 'every block'} "
                 f"({report['trained_parameters']:,} weights; {report['frozen_parameters']:,} frozen)")
    if report.get("features") == "backbone":
        parts.append("the frozen blocks' output computed once and cached (--features backbone)")
    if report["head_replaced"]:
        parts.append(f"a new head for the task's classes ({', '.join(report['head_replaced'])}: the file's is "
                     f"of another shape)")
    if report["frozen_batchnorm"]:
        shown = report["frozen_batchnorm"]
        parts.append(f"{len(shown)} frozen BatchNorm(s) in eval mode with their pretrained statistics, which read "
                     f"nothing of the private data ({', '.join(shown[:4])}{' …' if len(shown) > 4 else ''})")
    return "; ".join(parts)
