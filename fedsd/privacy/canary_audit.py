"""One-run privacy auditing (Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training
run", NeurIPS 2023; docs/algorithms.md, "Measured privacy"): an empirical lower bound on ε,
measured from one real run.

m canaries are each included with probability ½, the run trains once, every canary gets a
score, and the auditor guesses the k₊ highest-scoring as included and the k₋ lowest as excluded.
If the run is (ε, δ)-DP with respect to each canary, the number of correct guesses is
stochastically dominated as the paper's Theorem 3 says; the ε at which what was observed has
probability below β is a lower bound on the run's true ε, at confidence 1 − β.

Two kinds of canaries:
- `GradientCanaries` (white-box, the strongest): gradient-space vectors of norm C, each C·e_i on
  a coordinate of its own. An included canary joins a step's clipped sum with the step's
  Poisson rate q, through the same clipping and noise code as the samples (DPTrainer); its score
  is the likelihood ratio of every noised gradient the run released on its coordinate (the
  model updates, all iterates visible: SGD with momentum is an invertible function of them).
- Black-box canaries are input-space samples (mislabelled images) in the training set, scored
  by the final model's loss (fedsd/cli/audit.py builds them; only `guess` and the bound here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from fedsd.training.callbacks import StepCallback


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[≥ v correct out of r guesses] for an (ε, δ)-DP run with m canaries (Theorem 3):
    f(v) + 2mδ·max_{1≤i≤v} (f(v − i) − f(v))/i, with f(v) = P[Binomial(r, e^ε/(1 + e^ε)) ≥ v]."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")
    p = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of ε-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, p))
    if delta == 0 or v == 0:
        return min(1.0, tail)
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))  # P[v − i ≤ B < v], i = 1..v
    return min(1.0, tail + 2 * m * delta * float(np.max(below / np.arange(1, v + 1))))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest ε at which v or more correct guesses has probability below β: with
    confidence 1 − β the run is not (ε', δ)-DP for any ε' below it. 0 when nothing is shown."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2 * hi
        if hi > 200:  # everything right with very many guesses: beyond any ε worth printing
            return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < beta else (lo, mid)
    return lo


# Guesses tried, as fractions of m (half "in" from the top, half "out" from the bottom). Several
# are tried, so each is tested at β / (how many): a union bound keeps the best of them sound.
GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def guess_counts(m: int, fractions=GUESS_FRACTIONS) -> list[int]:
    """k (= k₊ = k₋) for each fraction of m canaries guessed: at least 1, at most m/2."""
    return [min(max(1, int(round(fraction * m / 2))), m // 2) for fraction in fractions]


@dataclass
class AuditOutcome:
    epsilon_lower_bound: float
    guesses: int  # r = k₊ + k₋, with k₊ = k₋
    correct: int  # v


def guess(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95,
          fractions=GUESS_FRACTIONS) -> AuditOutcome:
    """Guess the top k₊ scores as included and the bottom k₋ as excluded (k₊ = k₋ = r/2) for each
    r in `fractions`·m; the best lower bound, each tested at (1 − confidence)/len(fractions)."""
    scores, included = np.asarray(scores, dtype=float), np.asarray(included, dtype=bool)
    m = len(scores)
    order = np.argsort(-scores, kind="stable")  # highest first
    beta = (1 - confidence) / len(fractions)
    best = None
    for k in guess_counts(m, fractions):
        top, bottom = order[:k], order[m - k:]
        correct = int(included[top].sum() + (~included[bottom]).sum())
        eps = epsilon_lower_bound(m, 2 * k, correct, delta, beta)
        if best is None or eps > best.epsilon_lower_bound:
            best = AuditOutcome(eps, 2 * k, correct)
    return best


class GradientCanaries:
    """m white-box canaries (Dirac canaries): canary i is the gradient C·e_i on a coordinate of
    its own, in an audit parameter of m coordinates that the model never reads.

    The run's mechanism is then DP-SGD on (model parameters, audit parameter): the samples'
    gradients are 0 on the audit coordinates, so their norms, clipping and updates are exactly
    what they would be without it, while each canary's per-sample norm is C and it is clipped
    with the samples, and the noise σC is drawn on every coordinate, the audit ones included.
    No sample's gradient crowds a canary's coordinate, so the audit has all the power the
    mechanism leaves it: it measures the clipping, the noise and the accounting, which is what
    a wrong line breaks. Inclusion (½ each) and the per-step participation (rate q) use the
    canaries' own generator, seeded apart from the run's, so a run with canaries samples its
    batches and noise as it would without them."""

    def __init__(self, count: int, clip: float, sample_rate: float, noise_multiplier: float, batch_size: int,
                 seed: int, device="cpu"):
        self.noise_multiplier, self.batch_size = noise_multiplier, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.included = torch.rand(count, generator=self.generator) < 0.5
        self.parameter = torch.nn.Parameter(torch.zeros(count, device=device))
        self.clip, self.sample_rate = clip, sample_rate
        self.scores = torch.zeros(count, dtype=torch.float64)
        self.joins = torch.zeros(count, dtype=torch.int64)
        self._joined = torch.zeros(0, dtype=torch.int64)

    @property
    def count(self) -> int:
        return len(self.included)

    def draw(self) -> None:
        """Choose the included canaries that join this step (each independently with rate q)."""
        joins = self.included & (torch.rand(self.count, generator=self.generator) < self.sample_rate)
        self._joined = joins.nonzero().flatten()
        self.joins[self._joined] += 1

    def per_sample_rows(self) -> torch.Tensor:
        """The joined canaries as per-sample gradients of the audit parameter, one row each."""
        k, p = len(self._joined), self.parameter
        rows = torch.zeros((k, self.count), device=p.device, dtype=p.dtype)
        rows[torch.arange(k), self._joined.to(p.device)] = self.clip
        return rows

    def clipped_sum(self, clip_factor) -> torch.Tensor:
        """The joined canaries' sum, each clipped by `clip_factor(norms)` (the mode's own formula)."""
        rows = self.per_sample_rows()
        norms = rows.norm(dim=1)
        return (rows * clip_factor(norms).unsqueeze(1)).sum(0)

    def observe(self) -> None:
        """Score every canary from the step's released (noised, averaged) gradient g: with
        z = g·B/C, a step is z = J + N(0, σ²), J ~ Bernoulli(q) for an included canary and 0 for
        an excluded one. The score adds the step's log-likelihood ratio of the two,
        log(1 − q + q·exp((2z − 1)/(2σ²))), for the σ the accountant counts: by Neyman–Pearson
        the most powerful score for one canary (a plain sum of z loses most of it when q is small)."""
        z = self.parameter.grad.detach().double().cpu() * (self.batch_size / self.clip)
        q, var = self.sample_rate, self.noise_multiplier ** 2
        self.scores += torch.logaddexp(torch.tensor(math.log1p(-q), dtype=torch.float64),
                                       math.log(q) + (2 * z - 1) / (2 * var))


class AuditedSteps(StepCallback):
    """`fedsd audit`'s step callback on the audited data holder's calls: the white-box
    canaries (or None: black-box) join every step's clipped sum where the trainer's clipping
    route clips (fedsd.clipping), and are scored from each step's released gradient; the noise
    drawn is noise_scale·σ while the accountant still counts σ (noise_scale < 1: a broken
    mechanism, which the audit must catch)."""

    def __init__(self, canaries: GradientCanaries | None, noise_scale: float = 1.0):
        self.canaries, self.noise_scale = canaries, noise_scale

    def on_call_start(self, trainer) -> None:
        groups = trainer.optimizer.original_optimizer.param_groups
        if self.canaries is not None and not any(p is self.canaries.parameter for g in groups for p in g["params"]):
            # its coordinates are clipped, noised and stepped with the model's
            trainer.optimizer.original_optimizer.add_param_group({"params": [self.canaries.parameter]})
        trainer.optimizer.noise_multiplier = trainer.plan.noise_multiplier * self.noise_scale

    def before_noise(self, trainer) -> None:
        if self.canaries is not None:
            self.canaries.draw()
            trainer.clipper.join_canaries(self.canaries)

    def after_step(self, trainer) -> None:
        if self.canaries is not None:
            self.canaries.observe()

    def on_call_end(self, trainer) -> None:
        trainer.optimizer.noise_multiplier = trainer.plan.noise_multiplier
