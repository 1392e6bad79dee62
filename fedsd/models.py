"""The papers' two CNNs (Opacus' examples), by name. No normalisation layers: DP-SGD needs
per-sample gradients, which BatchNorm's mixing across the batch destroys."""
from __future__ import annotations

import torch
from torch import nn

from .errors import ConfigError, ModelNotPrivateError

MODELS = ("mnist-cnn", "cifar-cnn")
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


def check_private_trainable(model: nn.Module, fix: bool = False) -> nn.Module:
    """Refuse (or, with fix=True, repair via Opacus' ModuleValidator) a model DP-SGD cannot train."""
    from . import _opacus  # noqa: F401  (Opacus without its root-logger handler)
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return model
    if fix:
        return ModuleValidator.fix(model)
    listed = "; ".join(str(e) for e in errors)
    raise ModelNotPrivateError(
        f"model cannot be trained with DP-SGD: {listed}. BatchNorm mixes samples within a batch, so "
        "per-sample gradients do not exist; use GroupNorm (pass fix=True to let Opacus replace it)")


def build_model(name: str, num_classes: int = 10, seed: int | None = None, activation: str = "relu") -> nn.Module:
    """A fresh model; with `seed`, its initial weights depend on that seed only."""
    if name not in MODELS:
        raise ConfigError(f"--model: unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if activation not in ACTIVATIONS:
        raise ConfigError(f"--activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    cls = MnistCNN if name == "mnist-cnn" else CifarCNN
    if seed is None:
        return cls(num_classes, activation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(num_classes, activation)
