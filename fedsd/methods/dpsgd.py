"""DP-SGD (Abadi et al. 2016): cross-entropy, the baseline every other method is measured against."""
from fedsd.methods.base import Method, register


@register
class DPSGD(Method):
    name = "dpsgd"
