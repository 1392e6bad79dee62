"""DP-SGD run by a federation with distributed noise over secure aggregation: with every client
honest, central DP-SGD on the union of the clients' data (the same q, σ and steps), whatever
the partition (docs/algorithms.md).

One round is one step:
- each client draws its Poisson batch at the run's q from its own records, clips per sample,
  sums, and sends that sum quantised with its share of the Skellam noise (`contribution`),
  masked by secure aggregation (fedsd.secure.secagg);
- the server unmasks the sum only, divides it by the expected total batch q·N, and applies the
  optimizer, momentum included (`ServerOptimizer`).
The round-start teacher of self-distillation is then the model one step old.

`secure_round` runs one round of the protocol in process, every client's side and the
server's, as a simulation does; a deployment runs the clients' side in the owners' services.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import time

import numpy as np
import torch

from fedsd.secure import distributed_noise as noise
from fedsd.methods import Weights
from fedsd.secure.client_groups import Groups, Workers, release, vector_rows
from fedsd.secure.identity import Identity, Roster
from fedsd.secure.ring import ring_order, sparse_threshold
from fedsd.secure.secagg_primitives import lowest_threshold
from fedsd.secure.secagg_server import RoundAbandoned, SecAggServer
from fedsd.training.loop import DPTrainer, TrainState


# The methods one DP-SGD step a round can run: their objective needs only the round-start teacher.
DISTRIBUTED_METHODS = ("dpsgd", "dp3sd", "dpdsd")


def seeded_key(seed: int, client: int, round_number: int) -> bytes:
    """A simulation's noise key for one client's round: 128 bits derived from the run's seed,
    so a seeded simulation is reproducible (an owner's service draws its key from its secret
    stream instead)."""
    return hashlib.sha256(f"fedsd-distributed-noise|{seed}|{client}|{round_number}".encode()).digest()[:16]


def trainable(net: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters an update or a step covers, in the order the server's optimizer applies them."""
    return [p for p in net.parameters() if p.requires_grad]


def dimension(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in trainable(net))


def check_plan(trainer: DPTrainer, plan: noise.NoisePlan, least_noise: float = 0.0) -> None:
    """A plan (from the server) that does not describe the step this client takes is refused:
    a smaller clip would scale one record past the sensitivity the noise covers, a smaller q
    would under-charge the draw, another length would not be this model's, and less noise than
    the client's own calibration (`least_noise`) would be charged only after the release, which
    could not be taken back."""
    noise.check_own(plan, "distributed noise", least_noise, clip=trainer.cfg.clip,
                    sample_rate=trainer.plan.sample_rate, dim=dimension(trainer.model))


def contribution(trainer: DPTrainer, state: TrainState | None, student: Weights, epoch: int,
                 plan: noise.NoisePlan, key: bytes | None = None, teacher: Weights | None = None,
                 honest: int | None = None, least_noise: float = 0.0,
                 pad_to: int = 0, draw_rate: float | None = None) -> tuple[np.ndarray, TrainState, dict]:
    """One client's part of a round: its clipped sum of one Poisson batch at the trainer's
    q, quantised, plus its Skellam share, as uint64; the new state (its draws, its steps, its
    accountant history charged with the round as the mechanism's Gaussian equivalent) and the
    round's metrics. `key`: the noise generator's 16-byte key; None: 16 bytes of the state's
    secret stream (an own-data client must have one). `honest`: the owner's own t, which sizes
    the share (μ / t) whatever the plan assumes. `least_noise`: the client's own calibration's z;
    a plan (from the server) with less is refused before anything is drawn (`check_plan`).
    `pad_to`: the per-sample work covers this many rows whatever the batch drawn
    (DPTrainer.clipped_sum), so the time taken does not tell the batch; `draw_rate`: the rate its
    records are drawn at, at most the plan's q (the accountant is charged at q either way)."""
    check_plan(trainer, plan, least_noise)
    if honest is not None:
        plan = dataclasses.replace(plan, honest=honest)
    state = copy.deepcopy(state) if state is not None else TrainState(trainer.plan.history_before_training())
    trainer._start_draws(state)
    try:
        if key is None:
            if state.secret is None:
                raise ValueError("contribution: no noise key and no secret stream to draw one from")
            key = state.secret.random_bytes(16)
        trainer.load_student(student)
        if teacher is not None or trainer.method.self_distilling:
            trainer.load_teacher(teacher if teacher is not None else student)
        started = time.perf_counter()
        loss, clipped = trainer.clipped_sum(trainer.method.epoch_loss(trainer.cfg, epoch), pad_to=pad_to,
                                            sample_rate=draw_rate)
        vector = noise.encode(clipped.detach().double().cpu().numpy(), plan, noise.generator(key))
    finally:
        trainer._end_draws(state)
    state.history = state.history + [[plan.gaussian_equivalent(), plan.sample_rate, 1]]
    state.steps += 1
    return vector, state, dict(train_loss=loss, seconds=time.perf_counter() - started)


class ServerOptimizer:
    """The server's half of the step: the unmasked noisy sum over q·N, as the gradient of its
    SGD (momentum included) on the global student."""

    def __init__(self, net: torch.nn.Module, lr: float, momentum: float):
        self.net = net
        self.params = trainable(net)
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum)
        # --update-clip-quantile in a deployment: the clients' update clip S now, which the server
        # moves after each round (fedsd.secure.client_level.AdaptiveUpdateClip), checkpointed with the momentum
        self.update_clip: float | None = None

    def step(self, weights: Weights, noisy_sum: np.ndarray, plan: noise.NoisePlan, unit: float = 1.0) -> Weights:
        """One step on the noisy sum over the plan's expected batch, over `unit` too (the round's
        update clip, with --update-clip-normalize: the mean in units of the clip)."""
        self.net.load_state_dict(weights)
        flat = torch.from_numpy(noisy_sum / plan.expected_batch / unit)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        if offset != len(flat):
            raise ValueError(f"the aggregate has {len(flat)} values, the model {offset}")
        self.optimizer.step()
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        return state if self.update_clip is None else {**state, "update_clip": self.update_clip}

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        if "update_clip" in saved:
            self.update_clip = float(saved.pop("update_clip"))
        self.optimizer.load_state_dict(saved)


def run_roster(clients, identities: dict | None = None) -> tuple[dict, Roster]:
    """Identities and a roster for a simulated federation (its clients' keys are made here, so
    every simulated round runs the authenticated protocol an owners' deployment runs)."""
    identities = dict(identities or {})
    for k in clients:
        identities.setdefault(k, Identity())
    return identities, Roster.of({f"client-{k}": identities[k].public for k in clients})


def secure_round(round_id: bytes, vectors: dict[int, callable], length: int, min_cohort: int = 2,
                 degree: int = 0, drop_before_masking: frozenset = frozenset(),
                 max_colluders: int = 0, identities: dict | None = None,
                 silent_after_masking: frozenset = frozenset(), workers: Workers | None = None
                 ) -> tuple[np.ndarray, dict]:
    """One round of SecAgg+ in process: every client's stages and the server's, each client
    with its identity on the run's roster (`identities`: client → fedsd.secure.identity.Identity, made
    here where absent). `degree` > 0 below the cohort: the round's ring of that k (fedsd.secure.ring),
    its threshold `sparse_threshold(k, max_colluders, min_cohort)`; else the complete graph.
    `vectors`: client → a function that computes its vector (called before the masked-input stage,
    in this process). `drop_before_masking`: clients that send no masked input; `silent_after_masking`:
    clients that send theirs, then neither confirm nor unmask (as members may). `workers`
    (fedsd.secure.client_groups.Workers): the clients' stages run there, spread over the cores.
    Returns the unmasked sum and the round's cost (bytes each way, seconds outside the vectors'
    computation). RoundAbandoned when too few clients go on."""
    started = time.perf_counter()
    identities, roster = run_roster(vectors, identities)
    ids = {k: identities[k].id for k in vectors}
    if 0 < degree < len(vectors) - 1:
        graph = {"k": degree, "honest": min_cohort, "colluders": max_colluders}
        threshold = sparse_threshold(degree, max_colluders, min_cohort)
        order = ring_order(round_id, list(ids.values()), degree)
    else:
        graph, order = None, sorted(ids.values())
        threshold = min(lowest_threshold(len(vectors), max_colluders), len(vectors) - max_colluders)
    server = SecAggServer(round_id, list(ids.values()), length, threshold=threshold, graph=graph,
                          signers={ids[k]: identities[k].public for k in vectors})  # the roster's keys
    going = [(k, i) for k, i in ids.items() if k not in drop_before_masking]
    rows, memory = vector_rows(len(going), length, shared=workers is not None)
    try:
        groups = Groups(round_id, order, {ids[k]: identities[k] for k in vectors}, roster, min_cohort,
                        max_colluders, workers if memory is not None else None)
        server.collect_keys(groups.call("advertise", {i: server.setup(i) for i in order}))
        server.collect_shares(groups.call("share_keys", {i: {"keys": server.keys_for(i)} for i in server.keys}))
        going = [(k, i) for k, i in going if i in server.inbox]
        computing = time.perf_counter()
        for row, (k, _) in enumerate(going):
            rows[row] = vectors[k]()
        computing = time.perf_counter() - computing
        sets = groups.masked({i: (server.shares_for(i), row) for row, (_, i) in enumerate(going)}, rows, memory)
        server.collect_masked({i: rows[row] for row, (_, i) in enumerate(going)}, sets if graph else None)
        talking = [i for k, i in going if i in server.masked and k not in silent_after_masking]
        signatures = server.route_confirmations(groups.call("confirm", {i: server.unmask_request(i) for i in talking}))
        total = server.finish(groups.call("unmask", {i: {"confirmations": signatures.get(i, {}), "masked_sets":
                                                         server.masked_sets_for(i)} for i in talking}))
        cost = dict(bytes_to_server=server.bytes_in, bytes_from_server=server.bytes_out,
                    protocol_seconds=time.perf_counter() - started - computing, survivors=len(server.masked))
    finally:
        server.masked = {}  # views of the rows, which go with the shared memory
        del rows
        release(memory)
    return total, cost


def plain_round(vectors: dict[int, callable], length: int) -> tuple[np.ndarray, dict]:
    """The same round without secure aggregation: the server sums the vectors it sees (the
    baseline of the protocol's cost; each vector then reaches the server alone)."""
    started, computing = time.perf_counter(), 0.0
    total = np.zeros(length, dtype=np.uint64)
    for vector in vectors.values():
        t = time.perf_counter()
        v = vector()
        computing += time.perf_counter() - t
        total += v
    return total, dict(bytes_to_server=8 * length * len(vectors), bytes_from_server=0,
                       protocol_seconds=time.perf_counter() - started - computing, survivors=len(vectors))


__all__ = ["DISTRIBUTED_METHODS", "plain_round", "contribution", "ServerOptimizer", "secure_round", "run_roster",
           "seeded_key", "RoundAbandoned"]
