"""DP-SGD releasing an exponential moving average of its iterates (De et al. 2022): the EMA is
post-processing of the private iterates, so it costs no privacy."""
from ..callbacks import ExponentialAverage
from ..settings import check_setting
from . import Method

# Open in the papers; chosen on FMNIST's validation split at the full 60 epochs
# (results/sweeps/fmnist-dpema-decay-60, results/README.md).
EMA_DECAY = 0.995


class DPEMA(Method):
    name = "dpema"
    groups = ("student", "ema")
    releases = "ema"

    def defaults(self, cfg, paper):
        return dict(ema_decay=EMA_DECAY)

    def check(self, cfg):
        check_setting(0 <= cfg.ema_decay < 1, "--ema-decay", "must be in [0, 1)", cfg.ema_decay)

    def initial_model(self, student):
        return {"student": student, "ema": {k: v.clone() for k, v in student.items()}}

    def step_callbacks(self, cfg, model, steps_so_far, device):
        model["ema"] = {k: v.detach().clone().to(device) for k, v in model["ema"].items()}
        return [ExponentialAverage(model["ema"], cfg.ema_decay, steps_so_far)]
