"""Privacy planning and accounting with Opacus' accountants (SPEC §1, §8).

σ is calibrated once, for every step the protected data set will ever see; one accountant's
history is kept for the whole run (central, or a client across all its rounds) and the spent ε
is always read from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from opacus.accountants import create_accountant
from opacus.accountants.utils import get_noise_multiplier

EPSILON_TOLERANCE = 0.01


class BudgetError(ValueError):
    """A planned run that cannot fit its privacy budget."""


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Opacus' convention (len of its Poisson data loader): ⌈n / B⌉ steps at rate q = B / n."""
    return math.ceil(num_samples / batch_size)


@dataclass(frozen=True)
class PrivacyPlan:
    noise_multiplier: float
    sample_rate: float
    planned_steps: int
    epsilon: float
    delta: float
    accountant: str

    def to_dict(self) -> dict:
        return dict(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                    planned_steps=self.planned_steps, epsilon=self.epsilon, delta=self.delta,
                    accountant=self.accountant)


def plan(epsilon: float, delta: float, num_samples: int, batch_size: int, epochs: int,
         accountant: str = "rdp") -> PrivacyPlan:
    """Calibrate σ so that `epochs` epochs of Poisson-sampled DP-SGD spend at most (ε, δ)."""
    q = batch_size / num_samples
    steps = epochs * steps_per_epoch(num_samples, batch_size)
    try:
        sigma = get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=q,
                                     steps=steps, accountant=accountant,
                                     epsilon_tolerance=EPSILON_TOLERANCE)
    except ValueError as e:  # Opacus: "The privacy budget is too low."
        raise BudgetError(f"--epsilon: no noise level fits ε={epsilon}, δ={delta} for {steps} steps at "
                          f"sample rate {q:.4g} ({e}); raise --epsilon or lower --epochs") from e
    return PrivacyPlan(float(sigma), q, steps, epsilon, delta, accountant)


class Ledger:
    """One Opacus accountant for a whole run; its history is plain data, so it travels in a
    client's state between rounds and in checkpoints."""

    def __init__(self, kind: str = "rdp", history: list | None = None):
        self.kind = kind
        self._accountant = create_accountant(kind)
        self._accountant.history = [tuple(h) for h in (history or [])]

    @property
    def history(self) -> list[list]:
        return [list(h) for h in self._accountant.history]

    @property
    def steps(self) -> int:
        return int(sum(h[2] for h in self._accountant.history))

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        self._accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def epsilon(self, delta: float) -> float:
        if not self._accountant.history:
            return 0.0
        return float(self._accountant.get_epsilon(delta=delta))

    def epsilon_after(self, steps: int, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """ε spent if `steps` more steps were taken (asks a scratch copy; this ledger is unchanged)."""
        scratch = Ledger(self.kind, self.history + [[noise_multiplier, sample_rate, steps]])
        return scratch.epsilon(delta)
