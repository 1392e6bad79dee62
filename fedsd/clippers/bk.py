"""fedsd's book-keeping (fedsd.bookkeeping): the clipped per-sample gradient sum from one
backward pass; Opacus adds the noise and averages, as for its own ghost clipping."""
from __future__ import annotations

from ..bookkeeping import BookKeepingClipper
from . import Clipper, register


@register
class BookKeeping(Clipper):
    modes = ("bk",)
    channels_last_exact = ("bk",)

    def __init__(self, model, cfg, mode, route=None):
        super().__init__(model, cfg, mode, route)
        # each conv layer's way, as measured on this machine (fedsd.routes), else the flops rule
        self.engine = BookKeepingClipper(model, cfg.clip, conv_routes=route.conv_routes if route else None)

    @property
    def conv_routes(self) -> dict[int, str] | None:
        return self.engine.conv_routes

    @conv_routes.setter
    def conv_routes(self, routes: dict[int, str] | None) -> None:
        self.engine.conv_routes = routes

    @property
    def taken(self) -> dict[int, str]:
        """The way each conv layer went in the last step (benchmarks)."""
        return self.engine.taken

    def backward(self, per_sample_loss):
        loss = per_sample_loss.mean()
        self.engine.backward(loss, len(per_sample_loss))
        return loss
