"""What every clipper is made of (fedsd.clipping's package documentation says how one is
written): the Clipper base class and the registry of clippers by their mode names."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedsd.clipping.bookkeeping import clip_factor

if TYPE_CHECKING:
    from fedsd.settings.run import RunConfig


class Clipper:
    """One clipper. `module` is what the training step calls forward (the model, or Opacus'
    wrapper of it); `optimizer` is made once by `make_optimizer`."""

    modes: tuple[str, ...] = ()  # the --grad-sample-mode values this clipper serves
    channels_last_exact: tuple[str, ...] = ()  # its modes whose gradients are exact on channels-last tensors
    # The modes a route may take, each with the layout it runs in then (one in which it is exact,
    # and its faster where both are): auto's rule takes bk, else the first of
    # fedsd.clipping.routes.FALLBACK_ORDER that trains the network; --route may name any of them, and
    # `fedsd bench routes --measure` times every one.
    auto_layouts: dict[str, str] = {}
    # True: the route writes the clipped sum into p.grad itself (Opacus' DPOptimizerFastGradientClipping
    # noises and averages it); False: it leaves per-sample gradients in p.grad_sample, which
    # Opacus' DPOptimizer clips, sums, noises and averages.
    writes_clipped_sum = True
    # Whether it can keep a sample whose gradient is not finite out of the clipped sum, in the
    # same work whatever the data (a trainer with secret draws sets zero_nonfinite, below).
    guards_nonfinite = True

    def __init__(self, model: torch.nn.Module, cfg: RunConfig, mode: str):
        self.model, self.cfg, self.mode = model, cfg, mode
        self.module: torch.nn.Module = model
        self.optimizer = None
        # Set by a trainer with secret draws (fedsd.training.loop): every backward pass then zeroes
        # the gradient of each sample whose gradient is not finite, in the same work either way,
        # so that neither the update nor the time taken says whether a sample overflowed.
        self.zero_nonfinite = False
        # The clip norm now: the run's --clip, moved after each step by adaptive clipping
        # (fedsd.clipping.adaptive, set_clip). While `counting`, each backward pass adds its samples'
        # Σ_i (b_i − ½) (b_i = 1 where a sample's gradient norm is at most the clip) to `counted`.
        self.clip = cfg.clip
        self.counting = False
        self.counted = torch.zeros((), dtype=torch.float64)

    def set_clip(self, clip: float) -> None:
        """Clip at `clip` from the next step on, in the clipper and in the optimizer's noise
        (std σ·C); a clipper that clips elsewhere (an engine, Opacus' module) passes it on."""
        self.clip = float(clip)
        if self.optimizer is not None:
            self.optimizer.max_grad_norm = self.clip

    def count(self, norms: torch.Tensor) -> None:
        """Adaptive clipping: add this part of the batch's centred count of norms at most the clip."""
        if self.counting:
            from fedsd.clipping.adaptive import centred_count

            self.counted = self.counted + centred_count(norms.detach(), self.clip).cpu()

    def take(self, route) -> None:
        """What the run's route (fedsd.clipping.routes.Route) says about this clipper beyond its mode and
        layout (book-keeping: each conv layer's way)."""

    def make_optimizer(self, sgd: torch.optim.Optimizer, **dp):
        """Opacus' optimizer for this clipper, whose noise can come from a secret stream
        (fedsd.clipping.optimizers)."""
        from fedsd.clipping.optimizers import SourcedDPOptimizer, SourcedDPOptimizerFastGradientClipping

        kind = SourcedDPOptimizerFastGradientClipping if self.writes_clipped_sum else SourcedDPOptimizer
        self.optimizer = kind(sgd, **dp)
        return self.optimizer


    def backward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """From the batch's per-sample losses, the clipped per-sample gradients where the
        optimizer reads them; returns the mean loss."""
        raise NotImplementedError

    def hold(self) -> None:
        """Physical batches (fedsd.training.physical_batches): keep the clipped sum of the part just backwarded
        aside, so that the next part's backward pass starts from none."""
        held = self.__dict__.setdefault("_held", {})
        for p in self.model.parameters():
            if p.grad is not None:
                held[p] = held[p] + p.grad if p in held else p.grad
            p.grad = None

    def release_held(self) -> None:
        """After the last part: the kept sums added to its own, where the optimizer reads them."""
        for p, grad in self.__dict__.pop("_held", {}).items():
            p.grad = grad if p.grad is None else p.grad + grad

    def empty_batch(self) -> None:
        """An empty Poisson batch still takes a step (noise only), as the accountant assumes:
        zero per-sample gradients and a zero sum."""
        for p in self.model.parameters():
            if not p.requires_grad:  # a frozen block (--train-layers)
                continue
            p.grad_sample = torch.zeros((0, *p.shape), device=p.device)
            p.grad = torch.zeros_like(p)

    def join_canaries(self, canaries) -> None:
        """`fedsd audit` only: the canaries drawn for this step (fedsd.privacy.canary_audit.GradientCanaries)
        join the batch where this clipper clips, so Opacus noises and averages them with it:
        here, clipped by the clipper's own factor into the clipped sum (clippers that give Opacus
        per-sample gradients add them as rows instead)."""
        canaries.parameter.grad = canaries.clipped_sum(lambda norms: clip_factor(norms, self.clip))


CLIPPERS: dict[str, type[Clipper]] = {}  # --grad-sample-mode → its clipper


def register(cls: type[Clipper]) -> type[Clipper]:
    """Class decorator: `cls` serves its `modes` (--grad-sample-mode values)."""
    if not (isinstance(cls, type) and issubclass(cls, Clipper)) or not cls.modes:
        raise TypeError(f"{cls!r}: a clipper is a subclass of fedsd.clipping.Clipper with modes")
    for mode in cls.modes:
        if CLIPPERS.get(mode, cls) is not cls:
            raise ValueError(f"--grad-sample-mode {mode!r} is registered twice ({CLIPPERS[mode].__module__} and "
                             f"{cls.__module__})")
        CLIPPERS[mode] = cls
    return cls
