"""Step callbacks: what runs around each DP step of one training call, besides the step.

A call's callbacks are made for that call and passed to it (`DPTrainer.local_update(...,
callbacks=...)`), never kept on the trainer, which a Ray worker shares between clients. The
hooks, in the order a step runs them:
  on_call_start(trainer)   before the call's first step
  before_noise(trainer)    the batch's clipped sum is where the optimizer reads it; no noise yet
  after_noise(trainer)     p.grad holds the private (clipped, noised, averaged) gradient
  after_step(trainer)      the weights are updated
  on_call_end(trainer)     after the call's last step
What a callback does after the noise is post-processing of a private gradient and costs no
privacy, as long as it reads no data (FedProx's pull reads weights only).
"""
from __future__ import annotations

import torch


class StepCallback:
    def on_call_start(self, trainer) -> None:
        pass

    def before_noise(self, trainer) -> None:
        pass

    def after_noise(self, trainer) -> None:
        pass

    def after_step(self, trainer) -> None:
        pass

    def on_call_end(self, trainer) -> None:
        pass


class ProximalTerm(StepCallback):
    """FedProx: the term μ(w − w_global) pulls the local weights towards the call's incoming
    student. It depends on weights only, not on data, so it is added after the noise, as
    post-processing: it costs no privacy and is not clipped."""

    def __init__(self, mu: float):
        self.mu, self.anchor = mu, None

    def on_call_start(self, trainer) -> None:
        self.anchor = [p.detach().clone() for p in trainer.model.parameters()]

    def after_noise(self, trainer) -> None:
        for p, anchor in zip(trainer.model.parameters(), self.anchor):
            if p.grad is None:  # a frozen block (--train-layers): it does not move
                continue
            p.grad.add_(p.detach() - anchor, alpha=self.mu)


class ExponentialAverage(StepCallback):
    """θ̄ ← d_t·θ̄ + (1 − d_t)·θ after every step, with d_t = min(d, (1 + t)/(10 + t)) (De et al.
    2022), t counting the data holder's steps since its first call (`first_step` at this call);
    without the warm-up, d_t = d from the first step (d = 0.995 reaches the warm-up's bound
    only after 1,790 steps, longer than many runs)."""

    def __init__(self, average: dict[str, torch.Tensor], decay: float, first_step: int, warmup: bool = True):
        self.average, self.decay, self.t, self.warmup = average, decay, first_step, warmup

    def after_step(self, trainer) -> None:
        d = min(self.decay, (1 + self.t) / (10 + self.t)) if self.warmup else self.decay
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if not p.requires_grad:  # a frozen block: its average is its weights, bit for bit
                    continue
                self.average[name].mul_(d).add_(p.detach(), alpha=1 - d)
        self.t += 1


class TeacherEveryStep(StepCallback):
    """--teacher-every step: the self-distillation teacher is the student's previous iterate,
    the weights as they were before the step just taken (post-processing of private iterates:
    no privacy cost). At a call's first step it is the call's teacher (the round's start)."""

    def __init__(self):
        self.previous: list[torch.Tensor] | None = None

    def before_noise(self, trainer) -> None:
        self.previous = [p.detach().clone() for p in trainer.model.parameters()]

    def after_step(self, trainer) -> None:
        with torch.no_grad():
            for t, p in zip(trainer.teacher.parameters(), self.previous):
                t.copy_(p)
