"""DP-SGD (Abadi et al. 2016): cross-entropy, the baseline every other method is measured against."""
from fedsd.methods.base import Method, MethodRun, register


@register
class DPSGD(Method[MethodRun]):
    name = "dpsgd"
