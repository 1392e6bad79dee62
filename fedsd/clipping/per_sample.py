"""Opacus' per-sample gradients (hooks, functorch or expanded weights), clipped by DPOptimizer."""
from __future__ import annotations

import warnings

import torch

from fedsd.clipping.clipper import Clipper, register


@register
class PerSampleGradients(Clipper):
    modes = ("hooks", "functorch", "ew")
    # hooks' im2col assumes NCHW strides (wrong gradients on channels-last: fedsd.settings.run);
    # functorch and expanded weights are exact under either layout.
    channels_last_exact = ("functorch", "ew")
    # each in NCHW under auto: hooks are exact only there, and expanded weights fail on
    # channels-last output gradients at some shapes (mnist-cnn at B = 16)
    auto_layouts = {"hooks": "contiguous", "functorch": "contiguous", "ew": "contiguous"}
    writes_clipped_sum = False

    def __init__(self, model, cfg, mode):
        super().__init__(model, cfg, mode)
        from fedsd.clipping import _opacus  # noqa: F401  (first: Opacus without its root-logger handler)
        from opacus.grad_sample.utils import prepare_module

        self.module = prepare_module(model, mode, batch_first=True, loss_reduction="mean")

    def backward(self, per_sample_loss):
        loss = per_sample_loss.mean()
        with warnings.catch_warnings():
            # Opacus' hooks sit on the first layer, whose input needs no gradient; PyTorch warns
            # about that on every step, and it is expected there: no news to the user.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
        if self.zero_nonfinite:
            self._zero_nonfinite_rows()
        if self.counting:  # the norms Opacus' DPOptimizer clips by (its clip_and_accumulate), once more
            rows = [p.grad_sample.flatten(1) for p in self.model.parameters()
                    if getattr(p, "grad_sample", None) is not None]
            self.count(torch.stack([r.norm(2, dim=1) for r in rows], dim=1).norm(2, dim=1))
        return loss

    def _zero_nonfinite_rows(self) -> None:
        """Each sample's per-sample gradient zeroed, in every layer, where any of its entries is
        not finite: Opacus then clips a zero row (norm 0 ≤ C). The same work for any data."""
        grads = [p for p in self.model.parameters() if getattr(p, "grad_sample", None) is not None]
        if not grads:
            return
        bad = torch.zeros(len(grads[0].grad_sample), dtype=torch.bool, device=grads[0].grad_sample.device)
        for p in grads:
            bad |= ~torch.isfinite(p.grad_sample.flatten(1)).all(1)
        for p in grads:
            p.grad_sample = torch.where(bad.view(-1, *([1] * (p.grad_sample.dim() - 1))),
                                        torch.zeros((), dtype=p.grad_sample.dtype, device=p.grad_sample.device),
                                        p.grad_sample)

    def hold(self) -> None:
        """Physical batches: Opacus clips this part's per-sample gradients into its running sum
        (p.summed_grad, as under its BatchMemoryManager); the noise comes once, after the last."""
        self.optimizer.clip_and_accumulate()
        for p in self.model.parameters():
            p.grad_sample, p.grad = None, None

    def release_held(self) -> None:
        """Nothing to add: the optimizer's step clips the last part into the same running sum."""

    def join_canaries(self, canaries) -> None:
        """As rows of Opacus' per-sample gradients beside the samples', clipped by Opacus with them."""
        rows = canaries.per_sample_rows()
        batch_size = len(next(self.model.parameters()).grad_sample)
        for p in self.model.parameters():
            p.grad_sample = torch.cat([p.grad_sample, p.grad_sample.new_zeros((len(rows), *p.shape))])
        canaries.parameter.grad_sample = torch.cat([rows.new_zeros((batch_size, canaries.count)), rows])
