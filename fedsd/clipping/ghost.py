"""Opacus' ghost clipping: per-sample gradient norms without per-sample gradients, then a second
backward pass of the loss reweighted by the clipping factors."""
from __future__ import annotations

import warnings

from fedsd.clipping.clipper import Clipper, register


@register
class GhostClipping(Clipper):
    modes = ("ghost",)
    auto_layouts = {"ghost": "contiguous"}  # its per-sample norms assume NCHW strides
    # Its second backward pass sums the samples inside autograd, where a sample whose gradient
    # is not finite poisons the sum even at weight 0: it cannot train with secret draws.
    guards_nonfinite = False

    def __init__(self, model, cfg, mode):
        super().__init__(model, cfg, mode)
        from fedsd.clipping import _opacus  # noqa: F401  (first: Opacus without its root-logger handler)
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        self.module = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean",
                                                           max_grad_norm=cfg.clip, use_ghost_clipping=True)

    def set_clip(self, clip: float) -> None:
        super().set_clip(clip)
        self.module.max_grad_norm = self.clip

    def backward(self, per_sample_loss):
        loss = per_sample_loss.mean()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")  # as PerSampleGradients
            # as Opacus' DPTensorFastGradientClipping.backward
            loss.backward(retain_graph=True)
            self.optimizer.zero_grad()
            coeff = self.module.get_clipping_coef()
            self.count(self.module.per_sample_gradient_norms)
            self.module.disable_hooks()
            (coeff.to(per_sample_loss.device) * per_sample_loss).sum().backward()
            self.module.enable_hooks()
        return loss
