"""Per-sample clippers, one file each, registered by their mode names (`register`).

Every clipper computes the same thing, the sum over the batch of each sample's gradient
clipped to norm C, and differs in how: how fast, and the order it sums in, so each gives
weights of its own in the last bits (fedsd.clipping.routes chooses the run's route by a rule and records
it). A clipper owns the Opacus optimizer that adds the noise and
averages, and puts the clipped sum where that optimizer reads it, the empty Poisson batch
included. A new clipper is a subclass of `Clipper` in a file of its own, with its mode names
and the layouts `auto` may run them in, decorated with `@register`; a package outside fedsd
adds one through the entry-point group `fedsd.clippers`.
"""
from __future__ import annotations

from fedsd.clipping.clipper import CLIPPERS, Clipper, register

__all__ = ["CHANNELS_LAST_EXACT", "CLIPPERS", "Clipper", "register"]

from fedsd.clipping import per_sample, ghost, bk  # noqa: E402,F401  (each registers itself)
from fedsd.registry import load_entry_points  # noqa: E402

load_entry_points("fedsd.clippers", register)
CHANNELS_LAST_EXACT = tuple(m for m, cls in CLIPPERS.items() if m in cls.channels_last_exact)
