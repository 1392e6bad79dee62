"""Per-sample clipping routes, one file each, registered by their mode names (`register`).

Every route computes the same thing, the sum over the batch of each sample's gradient clipped
to norm C, and differs in how (and how fast, fedsd.routes measures it). A clipper owns the
Opacus optimizer that adds the noise and averages, and puts the clipped sum where that
optimizer reads it, the empty Poisson batch included. A new route is a subclass of `Clipper`
in a file of its own, with its mode names, decorated with `@register`; a package outside fedsd
adds one through the entry-point group `fedsd.clippers`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..bookkeeping import clip_factor

if TYPE_CHECKING:
    from ..config import TrainConfig


class Clipper:
    """One route. `module` is what the training step calls forward (the model, or Opacus'
    wrapper of it); `optimizer` is made once by `make_optimizer`."""

    modes: tuple[str, ...] = ()  # the --grad-sample-mode values this route serves
    channels_last_exact: tuple[str, ...] = ()  # its modes whose gradients are exact on channels-last tensors
    # True: the route writes the clipped sum into p.grad itself (Opacus' DPOptimizerFastGradientClipping
    # noises and averages it); False: it leaves per-sample gradients in p.grad_sample, which
    # Opacus' DPOptimizer clips, sums, noises and averages.
    writes_clipped_sum = True

    def __init__(self, model: torch.nn.Module, cfg: "TrainConfig", mode: str, route=None):
        self.model, self.cfg, self.mode = model, cfg, mode
        self.module: torch.nn.Module = model
        self.optimizer = None

    def make_optimizer(self, sgd: torch.optim.Optimizer, **dp):
        from .. import _opacus  # noqa: F401  (first: Opacus without its root-logger handler)
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        self.optimizer = (DPOptimizerFastGradientClipping if self.writes_clipped_sum else DPOptimizer)(sgd, **dp)
        return self.optimizer

    def backward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """From the batch's per-sample losses, the clipped per-sample gradients where the
        optimizer reads them; returns the mean loss."""
        raise NotImplementedError

    def empty_batch(self) -> None:
        """An empty Poisson batch still takes a step (noise only), as the accountant assumes:
        zero per-sample gradients and a zero sum."""
        for p in self.model.parameters():
            p.grad_sample = torch.zeros((0, *p.shape), device=p.device)
            p.grad = torch.zeros_like(p)

    def join_canaries(self, canaries) -> None:
        """`fedsd audit` only: the canaries drawn for this step (fedsd.audit.GradientCanaries)
        join the batch where this route clips, so Opacus noises and averages them with it:
        here, clipped by the route's own factor into the clipped sum (routes that give Opacus
        per-sample gradients add them as rows instead)."""
        canaries.parameter.grad = canaries.clipped_sum(lambda norms: clip_factor(norms, self.cfg.clip))


CLIPPERS: dict[str, type[Clipper]] = {}  # --grad-sample-mode → its route


def register(cls: type[Clipper]) -> type[Clipper]:
    """Class decorator: `cls` serves its `modes` (--grad-sample-mode values)."""
    if not (isinstance(cls, type) and issubclass(cls, Clipper)) or not cls.modes:
        raise TypeError(f"{cls!r}: a clipping route is a subclass of fedsd.clippers.Clipper with modes")
    for mode in cls.modes:
        if CLIPPERS.get(mode, cls) is not cls:
            raise ValueError(f"--grad-sample-mode {mode!r} is registered twice ({CLIPPERS[mode].__module__} and "
                             f"{cls.__module__})")
        CLIPPERS[mode] = cls
    return cls


from . import per_sample, ghost, bk  # noqa: E402,F401  (each registers itself)
from ..registry import load_entry_points  # noqa: E402

load_entry_points("fedsd.clippers", register)
CHANNELS_LAST_EXACT = tuple(m for m, cls in CLIPPERS.items() if m in cls.channels_last_exact)
