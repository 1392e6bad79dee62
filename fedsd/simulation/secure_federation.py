"""`fedsd simulate --secure-aggregation --noise distributed`: a federation whose clients add
their shares of the noise under secure aggregation, simulated in this process.

Every round runs the whole protocol (fedsd.secure.secagg: every client's four stages and the
server's), so every simulated round tests it; the clients' steps are those an owner's service
takes (fedsd.secure.distributed_step.contribution). One round is one DP-SGD step of the federation, so the
run is planned as central DP-SGD on the union of the shards: --batch-size is the federation's
expected batch B (q = B / N over all N training samples) and --rounds its steps; σ is
calibrated for --epsilon over those steps (fedsd.secure.distributed_noise). With --privacy-unit
client a round is instead each client's --local-epochs without noise, its update clipped and
its share added (fedsd.secure.client_level), and ε protects whole clients. No Ray: the clients take
their turns in one process, which is what makes a several-hundred-round run take minutes.

The run's folder holds checkpoint.pt (every CHECKPOINT_EVERY rounds and at the end: resumable
with --resume) until result.json is written.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fedsd.secure import client_level
from fedsd.data import datasets as data_lib
from fedsd.secure import distributed_noise
from fedsd.secure.client_groups import Workers
from fedsd.secure.ring import Graph, choose_graph
from fedsd.secure.secagg import MAX_NEIGHBOURS
from fedsd.data.client_data import input_stats, with_custom_task, task_for
from fedsd.settings.run import TrainConfig
from fedsd.secure.distributed_step import (DISTRIBUTED_METHODS, ServerOptimizer, contribution, dimension, plain_round,
                                           run_roster, secure_round, seeded_key)
from fedsd.secure.secagg_primitives import round_digest
from fedsd.secure.secagg_runs_server import InProcessRun
from fedsd.errors import ConfigError, ResumeError
from fedsd.settings.federation import RING_ABOVE, FedConfig
from fedsd.methods import released
from fedsd.models.networks import model_for
from fedsd.privacy.accounting import PrivacyPlan, steps_per_epoch
from fedsd.files.results import RunResult, check_out_dir, fresh_out_dir, save_atomic
from fedsd.training.loop import TrainState, evaluate, initial_model, planned_trainer
from fedsd import dry_run
from fedsd.app.simulated_shards import cut_shards

CHECKPOINT, RESULT = "checkpoint.pt", "result.json"
CHECKPOINT_EVERY = 25
EVALUATIONS = 20  # test evaluations over a run (and the last round)
# The features table's Fashion-MNIST recipe (results/table-features.md), which the distributed
# table and the cost benchmark run as a federation: 400 rounds are its 50 epochs of
# ⌈60000 / 8192⌉ = 8 steps.
FEATURES_RECIPE = dict(dataset="fmnist", features="scatter", model="scatter-linear", method="dpsgd", epsilon=3.0,
                       batch_size=8192, lr=8.0, momentum=0.9, clip=0.1, threads=1)
FEATURES_ROUNDS = 400


def check_options(cfg: TrainConfig, fed: FedConfig) -> None:
    """What distributed noise needs, refused before any work with the option to change."""
    if fed.noise == "distributed" and not fed.secure_aggregation:
        raise ConfigError("--noise distributed: needs --secure-aggregation (without it the server would see each "
                          "client's share, which alone is far below the noise the guarantee counts)")
    if not fed.secure_aggregation:
        return
    if fed.noise != "distributed":
        raise ConfigError("--secure-aggregation: a simulation runs it with --noise distributed (one step a round); "
                          "secure aggregation of local-noise updates runs in a deployment's data services")
    if fed.local_epochs != 1 and fed.privacy_unit == "record":
        raise ConfigError(f"--local-epochs {fed.local_epochs}: --noise distributed takes one local step a round "
                          f"(the server applies each step); leave --local-epochs at 1, or protect whole clients "
                          f"(--privacy-unit client)")
    if fed.fraction_train != 1.0 or fed.strategy != "fedavg" or fed.server_dp_noise > 0:
        raise ConfigError("--noise distributed: every client in every round, --strategy fedavg and no "
                          "--server-dp-noise (the server's step is the optimizer's, on the secure sum)")
    if cfg.method not in DISTRIBUTED_METHODS:
        raise ConfigError(f"--method {cfg.method}: --noise distributed runs {', '.join(DISTRIBUTED_METHODS)}")
    if cfg.clip_quantile:
        raise ConfigError("--clip-quantile: adaptive clipping of records is not built under --secure-aggregation yet "
                          "(each step's count would join the secure sum); at client level, --update-clip-quantile")
    if fed.privacy_unit == "client" and cfg.method != "dpsgd":
        raise ConfigError(f"--method {cfg.method}: --privacy-unit client trains each client without noise and "
                          f"without a teacher (--method dpsgd); self-distillation is record-level")
    if not 0 <= fed.honest_clients <= fed.num_clients:
        raise ConfigError(f"--honest-clients {fed.honest_clients}: must be in [0, --clients {fed.num_clients}] "
                          f"(0: all of them)")
    if fed.secure_sum == "protocol":
        secure_graph(fed)


def secure_graph(fed: FedConfig) -> Graph | None:
    """The graph a simulated round of the protocol runs on (--secagg-graph): None for the complete
    graph, else the ring's k and threshold from the clients, t, F and the dropout rate
    (fedsd.secure.ring.choose_graph). ConfigError, naming the settings, where none fits."""
    try:
        return choose_graph(fed.secagg_graph, fed.num_clients, honest_count(fed), fed.secagg_max_colluders,
                            fed.secagg_dropout, most=MAX_NEIGHBOURS, ring_above=RING_ABOVE,
                            plain="--secure-sum plain (the same sum, added in the clear) for a study of the sum alone")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def honest_count(fed: FedConfig) -> int:
    """t: the clients whose noise shares alone give the target σ (0 in the settings: all)."""
    return fed.honest_clients or fed.num_clients


class SecureFederation:
    """A run as it goes: its clients' shards and states, the global model and the server's
    optimizer; `take_round` runs one, `save` checkpoints, `finish` writes the result."""

    def __init__(self, cfg: TrainConfig, fed: FedConfig, out: Path | None, plain: bool = False, data: bool = True):
        """data=False: the run's plan alone (its σ, its network), as a dry run states it; the shards,
        the test set and their features (ScatterNet's: a minute for Fashion-MNIST's 60,000 images
        on one core) are made by `load_data`, which a dry run never reaches."""
        self.cfg, self.fed, self.out = cfg, fed, out
        self.plain = plain or fed.secure_sum == "plain"  # the same sum, added in the clear (--secure-sum plain)
        protocol = fed.secure_sum == "protocol" and not self.plain  # the per-round protocol, simulated
        self.graph = secure_graph(fed) if protocol else None
        # the clients' stages spread over the cores from WORKERS_FROM clients (fedsd.secure.client_groups)
        self.workers = Workers.for_cohort(fed.num_clients) if protocol else None
        images, indices, shards = cut_shards(cfg, fed)
        n = len(indices)
        self.sample_rate = min(1.0, cfg.batch_size / n)
        self.data_source, self._cut = images.source, (images, indices, shards)
        self.net = model_for(cfg, images.num_classes)
        dim = dimension(self.net)
        self.model = initial_model(cfg, images.num_classes)
        self.states: list[TrainState | None] = [None] * len(shards)
        self.rounds: list[dict] = []
        self.num_train, self.seconds_before = n, 0.0
        self.adaptive, self.update_clip = None, fed.update_clip  # --update-clip-quantile: S now
        if fed.privacy_unit == "client":  # every client every round, its clipped update; the server's mean
            # one coordinate more: each client's bit (client_level.AdaptiveUpdateClip)
            adapting = fed.update_clip_quantile > 0
            self.noise = client_level.calibrate(cfg.epsilon, cfg.delta, fed.update_clip, len(shards), fed.rounds,
                                                honest_count(fed), dim + adapting)
            self.adaptive = client_level.AdaptiveUpdateClip.of(fed, self.noise)
            self.server, self.plan = ServerOptimizer(self.net, client_level.server_lr(fed), 0.0), None
        else:
            self.noise = distributed_noise.calibrate(cfg.epsilon, cfg.delta, cfg.clip, self.sample_rate,
                                                     self.sample_rate * n, fed.rounds, honest_count(fed), dim)
            # every client's trainer draws at the run's q; its noise is the distributed plan's, not Opacus'
            self.plan = PrivacyPlan(0.0, self.sample_rate, fed.rounds, cfg.epsilon, cfg.delta, "rdp")
            self.server = ServerOptimizer(self.net, cfg.lr, cfg.momentum)
        self.own = self.noise  # each client's own calibration, from its own settings (here the run's)
        self.runs = None  # --secure-sum multi-round: the run's protocol, set up at its first round in this process
        self.shards, self.test, self.validation, self.trainer = [], None, None, None
        if data:
            self.load_data()

    def load_data(self) -> None:
        """The clients' shards and the test (and --validation) set, with the run's features; the
        clients' trainer, planned on the first shard."""
        images, indices, shards = self._cut
        self._cut, cfg = None, self.cfg  # the images let go once prepared, as before the split
        whole = data_lib.prepare(images, indices, "cpu", input_stats(cfg), cfg.features)
        self.test = whole.x_test, whole.y_test
        self.validation = data_lib.validation_split(images, cfg.validation, input_stats(cfg), cfg.features) \
            if cfg.validation else None  # --validation: the held-out samples, scored where the test set is
        self.shards = [data_lib.TensorData(whole.x_train[s], whole.y_train[s], whole.x_test[:0], whole.y_test[:0],
                                           whole.num_classes) for s in shards]
        if self.plan is not None:
            self.trainer = planned_trainer(cfg, self.shards[0], self.plan)

    # -- one round ------------------------------------------------------------------------
    def take_round(self, r: int) -> dict:
        started, student, honest = time.perf_counter(), self.model["student"], honest_count(self.fed)
        epoch = math.ceil(r * self.cfg.batch_size / self.num_train)
        losses = {}

        def client(k: int):
            def vector() -> np.ndarray:
                if self.fed.privacy_unit == "client":
                    return self.client_update(k, r, student, losses)
                self.trainer.bind(self.shards[k], self.plan, client=k)
                v, self.states[k], m = contribution(self.trainer, self.states[k], student, epoch, self.noise,
                                                    key=seeded_key(self.cfg.seed, k, r), honest=honest,
                                                    least_noise=self.own.noise_multiplier)
                losses[k] = m["train_loss"]
                return v
            return vector

        vectors = {k: client(k) for k in range(len(self.shards))}
        plan = client_level.round_plan(self.noise, self.adaptive, self.update_clip)
        if self.plain:  # the benchmark's baseline (fedsd/benchmarks/secagg_cost.py)
            total, cost = plain_round(vectors, plan.dim)
        elif self.fed.secure_sum == "multi-round":  # set up once (here, in this process), two exchanges a round
            if self.runs is None:
                self.runs = InProcessRun(*run_roster(range(len(self.shards))), min_cohort=len(self.shards))
            digest = round_digest(b"fedsd simulate", [v.numpy() for v in student.values()], repr(plan).encode())
            total, cost = self.runs.round(r, vectors, plan.dim, digest)
        elif self.graph is None:  # every client must survive (a simulation has no dropouts): every share in the sum
            total, cost = secure_round(f"{self.cfg.seed}:{r}".encode(), vectors, plan.dim,
                                       min_cohort=len(self.shards), workers=self.workers)
        else:  # the ring: each client's k nearest, every owner's t and F the run's
            total, cost = secure_round(f"{self.cfg.seed}:{r}".encode(), vectors, plan.dim, min_cohort=honest,
                                       degree=self.graph.k, max_colluders=self.fed.secagg_max_colluders,
                                       workers=self.workers)
        noisy_sum = distributed_noise.decode(total, plan)
        unit = self.update_clip if self.fed.update_clip_normalize else 1.0  # this round's S (--update-clip-normalize)
        record = dict(round=r, train_loss=float(np.mean(list(losses.values()))),
                      epsilon=self.noise.epsilon(r, self.cfg.delta), seconds=time.perf_counter() - started, **cost)
        if self.adaptive is not None:  # S after the round, from the sum's count (its last coordinate)
            record["clip"] = self.update_clip = self.adaptive.next_clip(self.update_clip, noisy_sum)
            noisy_sum = noisy_sum[:-1]
        self.model = dict(self.model, student=self.server.step(student, noisy_sum, plan, unit))
        if r == self.fed.rounds or r % max(1, self.fed.rounds // EVALUATIONS) == 0:
            self.net.load_state_dict(released(self.model))
            record["test_accuracy"], record["test_loss"] = evaluate(self.net, *self.test)
            if self.validation is not None:
                record["validation_accuracy"] = evaluate(self.net, *self.validation)[0]
            self.net.train()
        self.rounds.append(record)
        return record

    def client_update(self, k: int, r: int, student, losses: dict) -> np.ndarray:
        """Client k's vector at client level: its local epochs without noise from the round's
        global model, the update clipped, quantised and its share added."""
        key = seeded_key(self.cfg.seed, k, r)
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        update, losses[k] = client_level.local_update(self.net, self.shards[k], student, self.fed.local_epochs,
                                                      self.cfg.batch_size, self.cfg.lr, self.cfg.momentum, generator,
                                                      steps=self.fed.local_steps)
        if self.adaptive is not None:
            plan = client_level.round_plan(self.noise, self.adaptive, self.update_clip)  # the server's, this round
            return client_level.adaptive_contribution(update, plan, self.own, key, self.adaptive)
        return client_level.update_contribution(update, self.noise, self.own, key)

    # -- the folder -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        plan = self.plan
        return dict(settings=dict(config=self.cfg.to_dict(), fed=dataclasses.asdict(self.fed)),
                    noise=self.noise.to_dict(), model=self.model, server=self.server.state_dict(),
                    states=[s.state_dict(plan) if s is not None else None for s in self.states], rounds=self.rounds,
                    seconds=self.seconds_before, update_clip=self.update_clip)

    def load(self, saved: dict) -> None:
        if saved["noise"] != self.noise.to_dict():
            raise ResumeError(f"--resume: the run was planned with {saved['noise']}; this code plans "
                              f"{self.noise.to_dict()}")
        self.model, self.rounds, self.seconds_before = saved["model"], saved["rounds"], saved["seconds"]
        self.update_clip = saved.get("update_clip", self.fed.update_clip)
        self.server.load_state_dict(saved["server"])
        self.states = [TrainState.from_state_dict(s, self.plan) if s is not None else None
                       for s in saved["states"]]

    def save(self, seconds: float) -> None:
        self.seconds_before = seconds
        save_atomic(self.out / CHECKPOINT, self.state_dict())

    def record_level(self) -> dict:
        """At client level, what each single record of a client gets (sensitivity 2S)."""
        if self.fed.privacy_unit != "client":
            return {}
        return dict(record_epsilon=client_level.record_epsilon(self.noise, len(self.rounds), self.cfg.delta))

    def adaptive_rule(self) -> dict:
        """--update-clip-quantile: the rule the clip followed (each round's clip is in its record)."""
        if self.adaptive is None:
            return {}
        rule = self.adaptive.rule
        return dict(adaptive_update_clip=dict(quantile=rule.quantile, lr=rule.lr, count_noise=rule.count_noise,
                                              clients=rule.expected_batch))

    def result(self, seconds: float) -> RunResult:
        """The run's result.json, a federation's RunResult (its rounds), with the noise plan and
        the protocol's cost beside it."""
        last = self.rounds[-1]
        per_round = [r["protocol_seconds"] for r in self.rounds]
        return RunResult.of_run(
            self.cfg, epsilon_spent=last["epsilon"], test_accuracy=last["test_accuracy"], wall_seconds=seconds,
            device="cpu", data_source=self.data_source, noise_multiplier=self.noise.noise_multiplier,
            validation_accuracy=last.get("validation_accuracy"),
            sample_rate=self.noise.sample_rate, steps=len(self.rounds), num_train=self.num_train,
            num_clients=self.fed.num_clients, shard_sizes=[len(s.y_train) for s in self.shards],
            federation=dataclasses.asdict(self.fed), rounds=self.rounds,
            extra=dict(privacy_unit=self.fed.privacy_unit, **self.record_level(), **self.adaptive_rule(),
                       noise=self.noise.to_dict(), gaussian_equivalent=self.noise.gaussian_equivalent(),
                       secure_aggregation=dict(bytes_to_server_per_round=last["bytes_to_server"],
                                               bytes_from_server_per_round=last["bytes_from_server"],
                                               protocol_seconds_per_round=float(np.mean(per_round)),
                                               graph="complete" if self.graph is None else dict(
                                                   k=self.graph.k, threshold=self.graph.threshold,
                                                   honest=honest_count(self.fed),
                                                   colluders=self.fed.secagg_max_colluders),
                                               round_seconds=float(np.mean([r["seconds"] for r in self.rounds])))))


def local_work(fed) -> str:
    """What a client-level round trains each client for, in words."""
    if fed.local_steps:
        return f"{fed.local_steps} local steps (batches drawn with replacement)"
    return f"{fed.local_epochs} local epoch(s)"


def plan_line(cfg: TrainConfig, fed: FedConfig, run: SecureFederation) -> str:
    """What the run will do, as a dry run says it."""
    head = f"simulate {fed.num_clients} clients ({fed.partition}) with secure aggregation and distributed noise"
    if run.plain:
        head += " (the sum added in the clear, the protocol's bit for bit: --secure-sum plain)"
    if fed.privacy_unit == "client":
        return (f"{head}, each client protected whole (t = {honest_count(fed)}): {fed.rounds} rounds of "
                f"{local_work(fed)} without noise at B = {cfg.batch_size}, lr {cfg.lr:g}, momentum "
                f"{cfg.momentum:g}, each update clipped to {fed.update_clip:g}"
                + (f" at first, then to the {fed.update_clip_quantile:g} quantile of the update norms (σ_b = "
                   f"{run.adaptive.rule.count_noise:.3g} on the count)" if run.adaptive else "")
                + (f", each round's mean update in units of S at server lr {fed.server_lr:g}"
                   if fed.update_clip_normalize else "")
                + f", σ={run.noise.noise_multiplier:.3f} "
                f"(the honest sum's noise over the clip), client-level ε={cfg.epsilon:g}")
    epochs = fed.rounds / steps_per_epoch(run.num_train, cfg.batch_size)
    return (f"{head} (t = {honest_count(fed)}): {fed.rounds} rounds of one step, {epochs:g} epochs at B = "
            f"{cfg.batch_size}, lr {cfg.lr:g}, momentum {cfg.momentum:g}, σ={run.noise.noise_multiplier:.3f} "
            f"(the honest sum's noise; B the federation's), ε={cfg.epsilon:g} each")


def simulate_secure(cfg: TrainConfig, fed: FedConfig, out: str | Path | None = None, overwrite: bool = False,
                    progress: bool = True, resume: bool = False) -> tuple[dict, dict]:
    """Run (or, with resume, go on with the one in `out`, by its own settings) a
    distributed-noise federation; (result, weights)."""
    saved = None
    if resume:
        if out is None or not (Path(out) / CHECKPOINT).is_file():
            raise ResumeError(f"--resume: {out} holds no unfinished secure-aggregation run ({CHECKPOINT})")
        saved = torch.load(Path(out) / CHECKPOINT, weights_only=False)
        cfg = TrainConfig(**saved["settings"]["config"])
        fed = FedConfig.from_dict(saved["settings"]["fed"])
    cfg = with_custom_task(cfg).resolved()
    task_for(cfg)
    fed.validate()
    check_options(cfg, fed)
    out = Path(out) if out is not None else None
    if saved is None and out is not None:
        check_out_dir(out, overwrite)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = SecureFederation(cfg, fed, out, data=not dry_run.requested())
    dry_run.stop_here(plan_line(cfg, fed, run) + (f" into {out}" if out else ""))
    if saved is not None:
        run.load(saved)
    elif out is not None:
        fresh_out_dir(out, overwrite)
    # The run's data, model and libraries, made once, left out of the collector's scans: a round of
    # the protocol at 1,000 clients makes millions of small objects, and each full collection
    # would scan these too (2.5 of 14.5 s a round, measured).
    gc.freeze()
    clock = time.perf_counter() - run.seconds_before
    bar = tqdm(total=fed.rounds, initial=len(run.rounds), unit="round", disable=not progress,
               desc=f"{cfg.dataset} {cfg.method} distributed ε={cfg.epsilon}", dynamic_ncols=True)
    if run.workers is not None:  # started once, outside the rounds' protocol seconds (in the run's wall time)
        run.workers.start()
    try:
        for r in range(len(run.rounds) + 1, fed.rounds + 1):
            record = run.take_round(r)
            bar.update(1)
            if "test_accuracy" in record:
                bar.set_postfix(acc=f"{record['test_accuracy']:.4f}", eps=f"{record['epsilon']:.3f}")
            if out is not None and (r % CHECKPOINT_EVERY == 0):
                run.save(time.perf_counter() - clock)
    finally:
        if run.workers is not None:
            run.workers.close()
    bar.close()
    result = run.result(time.perf_counter() - clock)
    weights = {k: v.cpu() for k, v in released(run.model).items()}
    if out is not None:
        save_atomic(out / "model.pt", weights)
        result.write(out / RESULT)
        (out / CHECKPOINT).unlink(missing_ok=True)
    return result.to_dict(), weights
