"""What a finished run released, ready to use: `load_model(run_dir)` (also `fedsd.load_model`)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fedsd.data.client_data import input_stats
from fedsd.settings.run import TrainConfig
from fedsd.errors import DataError
from fedsd.data.features import FeatureMap
from fedsd.models.networks import backbone_for, image_shape_of, model_for
from fedsd.files.results import RunResult


class ReleasedModel(torch.nn.Module):
    """What a run released, ready to use: its network with the weights of model.pt, taking uint8
    images (N, C, H, W) or floats in [0, 1] and normalising them as the run did."""

    def __init__(self, net: torch.nn.Module, mean: tuple[float, ...], std: tuple[float, ...],
                 features: torch.nn.Module | None = None):
        super().__init__()
        self.net = net
        self.features = features  # the run's --features, made on the fly (fedsd.data.features.FeatureMap)
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(torch.float32) / 255.0 if images.dtype == torch.uint8 else images
        x = (x - self.mean) / self.std
        return self.net(x if self.features is None else self.features(x))


def load_model(run_dir: str | os.PathLike) -> ReleasedModel:
    """The model a finished run (`fedsd train`, `fedsd simulate`, a deployment) released in
    `run_dir`: its network (the run's model and activation, as many classes as it was trained
    on) with model.pt's weights and the run's input normalisation, in eval mode (a run on
    --features backbone: its frozen blocks from its --init-weights file). DataError
    naming the file when the folder holds no finished run."""
    run_dir = Path(run_dir)
    result = RunResult.read(run_dir / "result.json")
    if not (run_dir / "model.pt").is_file():
        raise DataError(f"{run_dir / 'model.pt'}: missing; a finished run writes it beside result.json")
    weights = torch.load(run_dir / "model.pt", weights_only=True)
    cfg = TrainConfig.from_dict(result.config)
    classes = next(v.shape[0] for k, v in reversed(list(weights.items())) if k.endswith("weight"))
    net = model_for(cfg, classes)
    net.load_state_dict(weights)
    mean, std = input_stats(cfg)
    feature_map = None
    if cfg.features == "backbone":  # the frozen blocks, from the file (its sha256 checked): model.pt holds the rest
        feature_map = backbone_for(cfg, classes).module
    elif cfg.features != "none":
        feature_map = FeatureMap(image_shape_of(cfg)[1], result.feature_statistics)
    return ReleasedModel(net, mean, std, feature_map).eval()
