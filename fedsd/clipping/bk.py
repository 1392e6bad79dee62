"""fedsd's book-keeping (fedsd.clipping.bookkeeping): the clipped per-sample gradient sum from one
backward pass; Opacus adds the noise and averages, as for its own ghost clipping."""
from __future__ import annotations

from fedsd.clipping.bookkeeping import BookKeepingEngine
from fedsd.clipping.clipper import Clipper, register


@register
class BookKeeping(Clipper):
    modes = ("bk",)
    channels_last_exact = ("bk",)

    auto_layouts = {"bk": "channels-last"}  # about twice as fast as NCHW here (results/perf.md)

    def __init__(self, model, cfg, mode):
        super().__init__(model, cfg, mode)
        self.engine = BookKeepingEngine(model, cfg.clip)

    def take(self, route) -> None:
        """Each conv layer's way, as the run's route says (fedsd.clipping.routes: its rule's, or given back);
        else the flops rule."""
        self.conv_ways = route.conv_ways or None

    @property
    def conv_ways(self) -> dict[int, str] | None:
        return self.engine.conv_ways

    @conv_ways.setter
    def conv_ways(self, ways: dict[int, str] | None) -> None:
        self.engine.conv_ways = dict(ways) if ways is not None else None

    @property
    def taken(self) -> dict[int, str]:
        """The way each conv layer went in the last step (benchmarks)."""
        return self.engine.taken

    def backward(self, per_sample_loss):
        loss = per_sample_loss.mean()
        self.engine.backward(loss, len(per_sample_loss), zero_nonfinite=self.zero_nonfinite)
        if self.counting:
            self.count(self.engine.norms)
        return loss

    def set_clip(self, clip: float) -> None:
        super().set_clip(clip)
        self.engine.max_grad_norm = self.clip
