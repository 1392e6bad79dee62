"""Client-level (user-level) DP run by the clients: each clips its own model update and adds its
share of the noise, so the server, which sees only the sum under secure aggregation, never holds
an update that is not already protected (docs/algorithms.md).

This is DP-FedAvg (McMahan et al., ICLR 2018) with the noise moved from the server to the
clients, as Kairouz, Liu & Steinke and Agarwal et al. do: a round is
- each client trains on its own records without noise (`local_update`: plain SGD, E epochs),
  and clips its update θ_global − θ_local to L2 norm S (`clipped_update`);
- quantises it and adds its Skellam share (fedsd.secure.distributed_noise, with S as the clip), masked
  by secure aggregation;
- the server unmasks the sum only, divides it by the number of clients n and applies it with
  learning rate 1 (FedAvg on the clipped, noised updates; `ServerOptimizer` with lr 1).
The unit protected is a whole client, as zero-out adjacency (Kairouz, McMahan, Song, Thakkar,
Thakurta & Xu, ICML 2021): a
client's data replaced by none changes its clipped update, and so the sum, by at most S, with
its noise share still in the sum (the cohort itself is visible to the server; a client that
leaves takes its share with it). Every client takes part in every round (q = 1), so the run is R
Gaussian steps at z_e (the same Skellam-to-Gaussian bound and the same integer-order accountant
as record-level distributed noise). One record of a client that stays can move its clipped
update from S·u to −S·u: each record gets the guarantee at sensitivity 2S (`record_epsilon`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fedsd.clipping.adaptive import COUNT_NOISE_PER_RECORD, QuantileClip
from fedsd.secure import distributed_noise as noise
from fedsd.data.datasets import TensorData
from fedsd.secure.distributed_step import trainable
from fedsd.methods import Weights

COUNT_NOISE_PER_Z = 4.0  # the least default σ_b, in units of the plan's z


def local_update(net: torch.nn.Module, shard: TensorData, start: Weights, epochs: int, batch_size: int, lr: float,
                 momentum: float, generator: torch.Generator, steps: int = 0) -> tuple[np.ndarray, float]:
    """(θ_start − θ_local over the trainable parameters as one float64 vector on the CPU, the
    mean training loss): plain SGD (no clipping, no noise: the unit protected is the whole
    update) on the client's own records, on the device they are on. `steps` > 0: that many steps,
    each on `batch_size` records drawn uniformly with replacement, so the work, and the time it
    takes, does not depend on the number of records (an owner's service, whose time the server
    sees); else `epochs` passes over shuffled batches of its records (a simulation's default)."""
    net.to(shard.x_train.device).load_state_dict(start)
    net.train()
    before = torch.cat([p.detach().reshape(-1).double().cpu() for p in trainable(net)])
    optimizer = torch.optim.SGD(trainable(net), lr=lr, momentum=momentum)
    losses = []
    for batch in _batches(len(shard.y_train), epochs, batch_size, generator, steps):
        batch = batch.to(shard.x_train.device)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(shard.x_train[batch]), shard.y_train[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    after = torch.cat([p.detach().reshape(-1).double().cpu() for p in trainable(net)])
    return (before - after).numpy(), float(np.mean(losses)) if losses else math.nan


def _batches(n: int, epochs: int, batch_size: int, generator: torch.Generator, steps: int):
    """The index batches of a client's local training: `steps` draws of `batch_size` with
    replacement, or `epochs` shuffled passes."""
    if steps > 0:
        for _ in range(steps):
            yield torch.randint(n, (batch_size,), generator=generator)
        return
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(0, n, batch_size):
            yield order[i:i + batch_size]


def clipped_update(update: np.ndarray, clip: float) -> np.ndarray:
    """The update scaled to L2 norm at most `clip`. A local training that diverged (a non-finite
    update) sends zeros: any vector within the clip keeps the sensitivity, and the round goes on
    with the others' updates (the global model it started from may be what diverged)."""
    norm = float(np.linalg.norm(update))
    if not math.isfinite(norm):
        return np.zeros_like(update)
    return update * min(1.0, clip / norm) if norm > 0 else update


def check_plan(plan: noise.NoisePlan, own: noise.NoisePlan) -> None:
    """A plan (from the server) that is not the client's own is refused: another clip would bound
    the update by a sensitivity the noise does not cover, a q below 1 would claim an
    amplification that does not happen (every client is in every round), another n or length
    is not this run, and less noise than the client's own calibration (from its own ε, δ, S,
    rounds and t) would spend more than its ε (an owner's service checks it before its ledger
    is charged, fedsd.app.client.secure_contribution)."""
    noise.check_own(plan, "client-level noise", own.noise_multiplier, clip=own.clip, sample_rate=1.0,
                    expected_batch=own.expected_batch, dim=own.dim)
    if plan.honest > own.honest:  # every share is sized μ / the plan's t: more than the client's t would be less
        raise ValueError(f"client-level noise: the plan's t is {plan.honest}, above this client's own {own.honest}")


def update_contribution(update: np.ndarray, plan: noise.NoisePlan, own: noise.NoisePlan, key: bytes) -> np.ndarray:
    """One client's vector: its update clipped to its own S, quantised, plus its Skellam share
    sized by the plan's t (μ / t, as every client's share is: a share sized by a larger own t
    would leave another client's t honest shares short of μ), as uint64, under a plan (the
    server's) that `check_plan` found to be its own or noisier, with a t no larger than its own."""
    check_plan(plan, own)
    return noise.encode(clipped_update(update, own.clip), plan, noise.generator(key))


@dataclass(frozen=True)
class AdaptiveUpdateClip:
    """--update-clip-quantile: adaptive clipping of the clients' updates (Andrew et al. 2021, the
    setting it was made for) with every client's bit inside its masked vector.

    Client k's vector is (its update clipped to S, (b_k − ½)·λ), b_k = 1 where its update's norm
    is at most S: one coordinate more, within the secure sum and the distributed noise like the
    others, so nothing per client is seen beside its masked vector. The vector's L2 norm is at most
    S' = √(S² + λ²/4), and the noise plan is the run's at clip S' over d + 1 coordinates: the
    zero-out neighbour's vector is zero in every coordinate, the count's too, so the sensitivity is
    S' and the plan's ε covers the update and the count at once (Theorem 1's joint mechanism; a
    Skellam plan's ε does not depend on its clip, which only scales it: fedsd.secure.distributed_noise).
    λ = z·S'/σ_b puts noise σ_b on the count (z the plan's multiplier), and S' = S / √(1 − (z/2σ_b)²)
    keeps S² + λ²/4 = S'². The server reads the count off the unmasked sum's last coordinate and
    moves S by the paper's geometric rule (fedsd.clipping.adaptive.QuantileClip.next_clip), sending
    each round's S' as the plan's clip; every client derives S and λ from S' with its own z and σ_b,
    so a server's S' moves utility, not ε (as its update-clip does with the clip fixed)."""

    rule: QuantileClip
    noise_multiplier: float  # z, the plan's

    @classmethod
    def of(cls, fed, plan: noise.NoisePlan) -> "AdaptiveUpdateClip | None":
        """The rule a run's settings ask for under the client-level `plan` (its z; its n, the
        expected batch; its d, whose 1/√d is the least clip); None: S fixed. ConfigError, naming
        the flag, where σ_b ≤ z/2."""
        if not fed.update_clip_quantile:
            return None
        z, clients = plan.noise_multiplier, plan.expected_batch
        # the paper's n/20, raised to 4z where below it: at z/2σ_b ≤ 1/8 the update's noise is at most
        # 1/√(1 − 1/64) = 1.008× the fixed clip's (at σ_b = z it was 1.155×, which cost the README's
        # whole-client recipe about 1.4 points: results/table-adaptive.md, "Whole clients")
        sigma_b = fed.update_clip_count_noise or max(clients * COUNT_NOISE_PER_RECORD, COUNT_NOISE_PER_Z * z)
        rule = QuantileClip(fed.update_clip_quantile, fed.update_clip_lr, sigma_b, float(clients), fed.update_clip,
                            least=noise.least_clip(plan.dim), flag="--update-clip-count-noise")
        rule.gradient_noise_multiplier(z)
        return cls(rule, z)

    def check_vector_clip(self, vector_clip: float) -> None:
        """A round plan's clip S' (the server's) refused unless S and λ within it are numbers (a
        review playing the attacker sent 1.7e308, whose λ overflowed after the owner's charge)."""
        if not (math.isfinite(vector_clip) and math.isfinite(self.count_scale_within(vector_clip))
                and self.update_clip_within(vector_clip) > 0):
            raise ValueError(f"client-level noise: the plan's clip {vector_clip!r} leaves no finite update clip and "
                             f"bit scale within it")

    def vector_clip(self, update_clip: float) -> float:
        """S': the L2 bound of a client's whole vector at update clip S."""
        return update_clip / self._shrink()

    def update_clip_within(self, vector_clip: float) -> float:
        """S, the update's clip inside a vector bound S'."""
        return vector_clip * self._shrink()

    def count_scale_within(self, vector_clip: float) -> float:
        """λ, the bit's scale inside a vector bound S'."""
        return self.noise_multiplier * vector_clip / self.rule.count_noise

    def _shrink(self) -> float:
        return math.sqrt(1 - (self.noise_multiplier / (2 * self.rule.count_noise)) ** 2)

    def vector(self, update: np.ndarray, vector_clip: float) -> np.ndarray:
        """Within the bound S': the update clipped to S, with its centred bit (a non-finite update:
        zeros, counted below). Its norm is √(S² + λ²/4) = S'."""
        update_clip = self.update_clip_within(vector_clip)
        norm = float(np.linalg.norm(update))
        below = not math.isfinite(norm) or norm <= update_clip
        return np.append(clipped_update(update, update_clip), (below - 0.5) * self.count_scale_within(vector_clip))

    def next_clip(self, update_clip: float, noisy_sum: np.ndarray) -> float:
        """S after a round at S whose unmasked, decoded sum is `noisy_sum` (the count its last coordinate)."""
        count = float(noisy_sum[-1]) / self.count_scale_within(self.vector_clip(update_clip))
        return self.rule.next_clip(update_clip, count)


def round_plan(plan: noise.NoisePlan, adaptive: AdaptiveUpdateClip | None, update_clip: float) -> noise.NoisePlan:
    """The plan of a round at update clip S: the run's, at clip S' where the clip adapts."""
    return plan if adaptive is None else dataclasses.replace(plan, clip=adaptive.vector_clip(update_clip))


def adaptive_contribution(update: np.ndarray, plan: noise.NoisePlan, own: noise.NoisePlan, key: bytes,
                          adaptive: AdaptiveUpdateClip) -> np.ndarray:
    """`update_contribution` with the clip adapting: the vector (update clipped to S, its bit)
    within the round plan's clip S', which is the server's to choose (it moves S by the count it
    read; a Skellam plan's ε does not depend on its clip, and the client derives S and λ from S'
    with its own numbers, so the vector stays within S'), under a plan `check_plan` finds to be
    the client's own in every other field (z at least its own) and whose clip float32 clips
    within the sensitivity (fedsd.secure.distributed_noise.least_clip)."""
    check_plan(plan, dataclasses.replace(own, clip=plan.clip))
    adaptive.check_vector_clip(plan.clip)
    return noise.encode(adaptive.vector(update, plan.clip), plan, noise.generator(key))


def record_epsilon(plan: noise.NoisePlan, rounds: int, delta: float) -> float:
    """What the run gives each single record of a client that stays in it: one record can move
    the clipped update from S·u to −S·u, a sensitivity of 2S, so it is the ε at z_e / 2."""
    return noise.integer_order_epsilon(plan.gaussian_equivalent() / 2, 1.0, rounds, delta)


def calibrate(epsilon: float, delta: float, clip: float, clients: int, rounds: int, honest: int,
              dim: int) -> noise.NoisePlan:
    """The client-level plan: every client in every round (q = 1), the sum divided by n."""
    return noise.calibrate(epsilon, delta, clip, 1.0, float(clients), rounds, honest, dim)


def calibrated(epsilon: float, delta: float, clip: float, clients: int, rounds: int, honest: int,
               dim: int) -> noise.NoisePlan:
    """`calibrate`, kept in memory (an owner's service calibrates once a run, not once a round)."""
    return noise.calibrated(epsilon, delta, clip, 1.0, float(clients), rounds, honest, dim)


def server_lr(fed) -> float:
    """The server's learning rate at client level: FedAvg's 1 on the mean update, or, with
    --update-clip-normalize, --server-lr per unit of the round's clip."""
    return fed.server_lr if fed.update_clip_normalize else 1.0
