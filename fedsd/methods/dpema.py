"""DP-SGD releasing an exponential moving average of its iterates (De et al. 2022): the EMA is
post-processing of the private iterates, so it costs no privacy. Its settings (--ema-decay,
--ema-warmup) are every method's that releases an EMA (fedsd.methods.MethodConfig)."""
from fedsd.settings.declared import check_setting
from fedsd.methods.base import Method, MethodRun, register, release_of


@register
class DPEMA(Method[MethodRun]):
    """DP-SGD with --release ema: the EMA group and its step callback are every method's
    (methods.release_callbacks), this is their default."""
    name = "dpema"
    groups = ("student", "ema")
    releases = "ema"

    def check(self, cfg: MethodRun) -> None:
        check_setting(release_of(cfg) == "ema", "--release",
                      "dpema releases its EMA (for the last iterate, use --method dpsgd)", cfg.release)
