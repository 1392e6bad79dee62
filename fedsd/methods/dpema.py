"""DP-SGD releasing an exponential moving average of its iterates (De et al. 2022): the EMA is
post-processing of the private iterates, so it costs no privacy."""
from ..settings import check_setting
from . import Method, release_of

# Open in the papers; chosen on FMNIST's validation split at the full 60 epochs
# (results/sweeps/fmnist-dpema-decay-60, results/README.md).
EMA_DECAY = 0.995


class DPEMA(Method):
    """DP-SGD with --release ema: the EMA group and its step callback are every method's
    (methods.release_callbacks), this is their default."""
    name = "dpema"
    groups = ("student", "ema")
    releases = "ema"

    def check(self, cfg):
        check_setting(release_of(cfg) == "ema", "--release",
                      "dpema releases its EMA (for the last iterate, use --method dpsgd)", cfg.release)
