"""DP-SGD on label-smoothed cross-entropy: a fedsd method that lives outside fedsd."""
from dataclasses import dataclass

import torch.nn.functional as F

from fedsd.methods import EpochLoss, Method, MethodConfig, register
from fedsd.settings.declared import setting


@dataclass
class SmoothConfig(MethodConfig):
    label_smoothing: float | None = setting(None, "dpsmooth: the cross-entropy's label smoothing", resolve=0.1,
                                            source="the plugin's", check=(lambda v: 0 <= v < 1, "must be in [0, 1)"))


@register
class DPSmooth(Method):
    name = "dpsmooth"
    Settings = SmoothConfig

    def epoch_loss(self, cfg, epoch):
        return EpochLoss(lambda s, t, y: F.cross_entropy(s, y, label_smoothing=cfg.label_smoothing, reduction="none"),
                         False, 1.0)
