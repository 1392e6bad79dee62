"""The one DP training loop, for all five methods, central and federated alike.

A run is a sequence of calls to `DPTrainer.local_update(model, state, epochs)`: from the current
global model (named groups of weights: the student, and where the method has them the EMA and
DPKD's teacher) and the carried `TrainState` (accountant history, RNG state, step count), train
the listed epochs and return the updated groups, the new state and metrics. Central training
is that call once per epoch; a federated client makes it once per round on its shard. With one
client, one local epoch a round and FedAvg (the identity on one reply), the two are the same
computation, which is what makes the single-client identity hold by construction.

The trainer runs the same DP-SGD step for every method and route: what a method changes (its
loss, its weight groups, DPKD's stages, the EMA) is its `fedsd.methods.Method`; how the clipped
sum is computed is the `fedsd.clipping.Clipper` of the route; what a call adds around each step
(FedProx's pull, the audit's canaries) are step callbacks passed to that call
(fedsd.training.callbacks).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from fedsd.clipping import adaptive, routes
from fedsd.training.callbacks import ProximalTerm, StepCallback
from fedsd.training.compiled import CompiledForward, student_forward, teacher_forward
from fedsd.clipping import CLIPPERS
from fedsd.settings.run import TrainConfig, check_layout
from fedsd.data.datasets import TensorData
from fedsd.methods import EpochLoss, Model, Weights, method_of, release_callbacks, with_release
from fedsd.models import pretrained
from fedsd.models.networks import convolutional, model_for
from fedsd.training.physical_batches import physical_batch_size
from fedsd.privacy.accounting import AccountantHistory, PrivacyPlan, steps_per_epoch
from fedsd.privacy.secret_random import SecretStream
from fedsd.training.seeds import SEED_CLIENT_RNG, SEED_MODEL_INIT, derive_seed
from fedsd.errors import BudgetExhausted, ConfigError, StateMismatch, TrainingDiverged


# A run has diverged when a step's loss is not finite, or when the mean over the last
# DIVERGENCE_WINDOW steps stays above DIVERGENCE_FACTOR × the objective's chance level (its loss
# at a student that knows nothing, uniform outputs) for DIVERGENCE_WINDOW steps in a row, or is
# still above it when the call ends (the model it would release). The level is ln(classes) for
# cross-entropy (~2.3 for ten; the papers' runs stay below 3 at every step size they use, a
# diverging lr reaches hundreds within an epoch and stays there), and up to τ² times more for a
# distillation term, whose KL is scaled by τ² (DPKD's fresh student at τ = 5 starts near 30: not
# a divergence). Why a high loss must persist: a small skewed federated shard at B = 256, lr 3
# can spike and come back within a round (a 3-round Dirichlet(0.1) dpdsd federation with
# local-previous teachers: one client's 15-step round went 1.7 → 80 → 6.6 and its next round
# stayed near 2; a check on the window alone stops it). The window keeps one unlucky tiny batch
# from stopping a run.
DIVERGENCE_WINDOW, DIVERGENCE_FACTOR = 10, 10.0


def initial_model(cfg: TrainConfig, num_classes: int) -> Model:
    """The global model before any training: the same for every client and the central run
    (with --init-weights, the file's weights: a public input, which the server sends)."""
    student = model_for(cfg, num_classes, seed=derive_seed(cfg.seed, SEED_MODEL_INIT), weights=True).state_dict()
    return with_release(cfg, method_of(cfg).initial_model(student))


def frozen_part(cfg: TrainConfig, num_classes: int) -> dict[str, torch.Tensor]:
    """The initial student's frozen blocks (every parameter and buffer of the blocks
    --train-layers freezes, with --init-weights' values): what the global model holds there in
    every round. Empty with --train-layers all, or under --features backbone (the frozen blocks
    compute the features and are not in the model)."""
    if cfg.train_layers == "all" or cfg.features == "backbone":
        return {}  # nothing frozen travels (and no network is built for nothing)
    net = model_for(cfg, num_classes, seed=derive_seed(cfg.seed, SEED_MODEL_INIT), weights=True)
    state = net.state_dict()
    return {k: state[k].detach().clone() for k in pretrained.frozen_keys(net)}


@dataclass
class TrainState:
    """What one data holder carries from one call to the next (a client: in its context.state
    and on its own disk, both through state_dict / from_state_dict)."""

    history: list = field(default_factory=list)  # Opacus accountant history
    rng_state: torch.Tensor | None = None  # sampling and noise generator (seeded from the run's seed)
    # An own-data client's secret sampling and noise (fedsd.privacy.secret_random), in place of rng_state:
    # a state that holds one trains as against a server that may be hostile (DPTrainer.local_update).
    # Never stored: a state read back holds a fresh stream (a new key from the OS), so no stored
    # or copied state can replay a keystream.
    secret: SecretStream | None = None
    steps: int = 0
    local_model: Weights | None = None  # the end-of-round student, for teacher=local-previous
    momentum: list[torch.Tensor] | None = None  # SGD momentum buffers, when momentum > 0
    teacher_average: Weights | None = None  # teacher=global-ema: the average of the global models received
    clip: float | None = None  # --clip-quantile: the clip estimate now (fedsd.clipping.adaptive); None: --clip

    def state_dict(self, plan: PrivacyPlan) -> dict:
        """One flat form for every store: names to tensors or plain values, with the mechanism
        (accountant, σ, q) the history was accounted under, so a load can check it."""
        flat = {"mechanism/accountant": plan.accountant, "mechanism/noise_multiplier": plan.noise_multiplier,
                "mechanism/sample_rate": plan.sample_rate, "history": json.dumps(self.history), "steps": self.steps}
        if self.rng_state is not None:
            flat["rng_state"] = self.rng_state
        if self.secret is not None:  # secret draws, never the key: each call draws a fresh one
            flat["secret"] = 1
        if self.clip is not None:
            flat["clip"] = float(self.clip)
        flat.update({f"local_model/{k}": v.detach().cpu() for k, v in (self.local_model or {}).items()})
        flat.update({f"momentum/{i}": v.detach().cpu() for i, v in enumerate(self.momentum or [])})
        flat.update({f"teacher_average/{k}": v.detach().cpu() for k, v in (self.teacher_average or {}).items()})
        return flat

    @classmethod
    def from_state_dict(cls, flat: dict, plan: PrivacyPlan) -> "TrainState":
        """Inverse of state_dict; StateMismatch when it was accounted under another mechanism
        than `plan`'s (going on would mix two accountings under one history)."""
        saved = (flat.get("mechanism/accountant"), flat.get("mechanism/noise_multiplier"),
                 flat.get("mechanism/sample_rate"))
        if saved != (plan.accountant, plan.noise_multiplier, plan.sample_rate):
            raise StateMismatch(f"the saved privacy state was accounted with accountant={saved[0]}, σ={saved[1]}, "
                                f"q={saved[2]}; this run has accountant={plan.accountant}, "
                                f"σ={plan.noise_multiplier}, q={plan.sample_rate}")
        local_model = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("local_model/")}
        momentum = [flat[f"momentum/{i}"] for i in range(sum(k.startswith("momentum/") for k in flat))]
        average = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("teacher_average/")}
        return cls(history=json.loads(flat["history"]), rng_state=flat.get("rng_state"),
                   secret=SecretStream.fresh() if "secret" in flat or "secret/key" in flat else None,
                   steps=int(flat["steps"]), clip=float(flat["clip"]) if "clip" in flat else None,
                   local_model=local_model or None, momentum=momentum or None, teacher_average=average or None)


def round_teacher(fed, state, incoming_student: dict) -> tuple[dict | None, object]:
    """A client's self-distillation teacher for this round (None: the incoming global student,
    teacher=round-start) and the TrainState to train with. Every teacher is post-processing of
    models already released (global models, the client's own DP-trained model): no privacy cost.
    - local-previous: the client's own model from its previous round (round-start before it has one);
    - global-ema: θ̄ ← d·θ̄ + (1 − d)·θ_global over the global models this client received, kept
      in its state (the first is taken as it is). With every client in every round it is the
      average the server would keep; a client that sits a round out skips that model."""
    if fed.teacher == "local-previous":
        return (state.local_model if state is not None else None), state
    if fed.teacher == "global-ema":
        state = state if state is not None else TrainState()
        d, previous = fed.teacher_ema_decay, state.teacher_average
        average = ({k: v.detach().clone() for k, v in incoming_student.items()} if previous is None else
                   {k: d * previous[k] + (1 - d) * v.to(previous[k].device) for k, v in incoming_student.items()})
        return average, dataclasses.replace(state, teacher_average=average)
    return None, state


def save_train_state(path, state: TrainState, plan: PrivacyPlan) -> None:
    """A data holder's state on its own disk, atomically: a restarted client (or a resumed
    federation) goes on with its accountant, never a fresh one."""
    from fedsd.files.results import save_atomic

    save_atomic(path, state.state_dict(plan))


def load_train_state(path, plan: PrivacyPlan) -> TrainState:
    """A state saved by save_train_state; a link at `path` itself is not followed (OSError)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
        return TrainState.from_state_dict(torch.load(f, weights_only=True), plan)


def torch_memory_format(cfg: TrainConfig, device: torch.device | None = None,
                        model: torch.nn.Module | None = None) -> torch.memory_format:
    """The layout of a run's images, student and teacher (TrainConfig.channels_last); on CUDA,
    expanded weights under --memory-format auto take NCHW: there torch's expanded-weights
    GroupNorm refuses channels-last input (seen on an H100, torch 2.11: "Expected
    X.is_contiguous(memory_format)"; results/README.md, the GPU checks). Under auto, a network
    `model` without a convolution takes NCHW too: channels-last speeds convolutions only, and
    torch's GroupNorm on channels-last input is about 4x slower (scatter-linear's round halved:
    results/deploy-distributed.md)."""
    if cfg.memory_format == "auto" and (
            (device is not None and device.type == "cuda" and cfg.grad_sample_mode == "ew")
            or (model is not None and not convolutional(model))):
        return torch.contiguous_format
    return torch.channels_last if cfg.channels_last else torch.contiguous_format


def _rng_seed(cfg: TrainConfig, client: int) -> int:
    return derive_seed(cfg.seed, SEED_CLIENT_RNG, client)


# Evaluation's batch on a CPU: its temporaries (a few MB) stay in the heap from batch to batch. At
# 4096 rows they were fresh memory each time (65 MB for scatter-linear's float copy), and on a
# machine that hands its free memory back (a VM's balloon, DAMON) a ServerApp's evaluation of
# the 10,000 test images between two rounds took 0.6-1.3 s instead of 0.05 s
# (results/deploy-distributed.md).
CPU_EVALUATION_BATCH = 512


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             batch_size: int | None = None) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over a whole split, in batches (`batch_size`, else
    CPU_EVALUATION_BATCH on a CPU and 4096 on an accelerator)."""
    if batch_size is None:
        batch_size = CPU_EVALUATION_BATCH if x.device.type == "cpu" else 4096
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = model(x[i:i + batch_size])
            target = y[i:i + batch_size]
            loss_sum += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(1) == target).sum().item()
    model.train()
    return correct / len(x), loss_sum / len(x)


def divergence_message(cfg: TrainConfig, epoch: int, loss: float, mean: float, limit: float) -> str:
    from fedsd.settings.run import paper_batch_and_lr

    what = f"the loss is {loss:.4g}" if not math.isfinite(loss) else \
        f"the mean loss of the last steps is {mean:.4g}, above {limit:.3g}"
    paper_b, paper_lr = paper_batch_and_lr(cfg)
    return (f"training diverged in epoch {epoch}: {what}. The likely cause is --lr {cfg.lr:g} at "
            f"--batch-size {cfg.batch_size} (the papers use lr {paper_lr:g} at B = {paper_b}); lower --lr, "
            f"or leave it unset for the default, which scales with B")


class DivergenceCheck:
    """The divergence rule above, over the steps of one training call."""

    def __init__(self, cfg: TrainConfig, num_classes: int):
        self.cfg, self.log_classes = cfg, math.log(num_classes)
        self.recent = deque(maxlen=DIVERGENCE_WINDOW)
        self.above = 0  # steps in a row whose window mean is above the limit
        self.epoch, self.limit = 0, math.inf

    def after_step(self, loss: float, epoch: int, chance: float) -> None:
        self.epoch, self.limit = epoch, DIVERGENCE_FACTOR * chance * self.log_classes
        self.recent.append(loss)
        if not math.isfinite(loss):
            self._stop()
        self.above = self.above + 1 if self._mean() > self.limit else 0
        if self.above >= DIVERGENCE_WINDOW:
            self._stop()

    def at_end(self) -> None:
        if self.above:
            self._stop()

    def _mean(self) -> float:
        return sum(self.recent) / len(self.recent)

    def _stop(self):
        raise TrainingDiverged(divergence_message(self.cfg, self.epoch, self.recent[-1], self._mean(), self.limit))


def planned_trainer(cfg: TrainConfig, data: TensorData, plan: PrivacyPlan, client: int = 0,
                    route: routes.Route | None = None, guarded: bool = False) -> "DPTrainer":
    """The trainer of a run being planned: with --grad-sample-mode auto its route is chosen
    first (fedsd.clipping.routes; guarded: one that can train with secret draws), then handed to the
    trainer."""
    if route is None:
        route = routes.for_run(cfg, data.num_classes, tuple(data.x_train.shape[1:]), data.x_train.device, guarded)
    return DPTrainer(cfg, data, plan, client=client, route=route)


class DPTrainer:
    """Opacus DP-SGD on one data set (a central training set or one client's shard).

    Built once and reused for every call: the model structure, the Opacus wrappers, the
    calibrated σ and the data tensors do not change between epochs or rounds.
    """

    def __init__(self, cfg: TrainConfig, data: TensorData, plan: PrivacyPlan, client: int = 0,
                 route: routes.Route | None = None):
        """`route`: with --grad-sample-mode auto, the run's route, measured while the run was
        planned (planned_trainer; a resumed run: the one it started with)."""
        check_layout(cfg)
        if cfg.grad_sample_mode == routes.AUTO and route is None:
            raise ValueError("DPTrainer: --grad-sample-mode auto trains on the run's measured route; plan it "
                             "first (fedsd.training.loop.planned_trainer, fedsd.clipping.routes.for_run)")
        self.cfg = cfg
        self.device = data.x_train.device
        # auto: the route measured fastest on this machine for this configuration, and its layout
        self.route = route if cfg.grad_sample_mode == routes.AUTO else None
        mode = self.route.mode if self.route is not None else cfg.grad_sample_mode
        self.model = model_for(cfg, data.num_classes)
        self.memory_format = (routes.LAYOUTS[self.route.memory_format] if self.route is not None
                              else torch_memory_format(cfg, self.device, self.model))
        if (mode == "ew" and self.device.type == "cuda" and self.memory_format == torch.channels_last
                and any(isinstance(m, torch.nn.GroupNorm) for m in self.model.modules())):
            raise ConfigError("--memory-format channels-last: on CUDA, torch's expanded weights (--grad-sample-mode "
                              "ew) cannot take GroupNorm's input channels-last; use --memory-format auto or contiguous")
        self.model = self.model.to(self.device, memory_format=self.memory_format)
        # A Poisson batch larger than this is trained in parts (fedsd.training.physical_batches)
        self.physical_batch_size = physical_batch_size(cfg, self.model, tuple(data.x_train.shape[1:]), self.device)
        self.teacher = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.generator = torch.Generator(device=self.device)
        self.secret: SecretStream | None = None  # during a call with secret draws only
        self.method = method_of(cfg)
        self._evaluation_model: torch.nn.Module | None = None  # built on first use
        # The clipping route: it computes the clipped per-sample gradient sum and owns the Opacus
        # optimizer that adds the noise and averages (fedsd.clipping).
        self.clipper = CLIPPERS[mode](self.model, cfg, mode)
        # --clip-quantile: the clip follows a quantile of the per-sample gradient norms, each step's
        # noised count of those below it released beside the gradient (fedsd.clipping.adaptive)
        self.adaptive = adaptive.QuantileClip.of(cfg)
        self.clipper.counting = self.adaptive is not None
        if self.route is not None:
            self.clipper.take(self.route)
        # Compiled where that changes no bit (fedsd.training.compiled): the teacher's forward, and
        # with book-keeping (hooks on the weighted layers only) the student's weightless layers
        self._teacher_forward = teacher_forward(self.teacher)
        self._student_forward, self._compiled_runs = (student_forward(self.model) if self.clipper.module is self.model
                                                      else (self.clipper.module, []))
        self._compiled = [p for p in (self._teacher_forward, *self._compiled_runs) if isinstance(p, CompiledForward)]
        # Frozen blocks (--train-layers) are no part of the optimizer: no gradient, no noise, no step
        sgd = torch.optim.SGD(self.trainable(), lr=cfg.lr, momentum=cfg.momentum)
        self.optimizer = self.clipper.make_optimizer(
            sgd, noise_multiplier=plan.noise_multiplier, max_grad_norm=cfg.clip, expected_batch_size=cfg.batch_size,
            loss_reduction="mean", generator=self.generator)
        self.bind(data, plan, client)

    def compiled_parts(self) -> dict[str, str]:
        """Each part of a step that compiles (fedsd.training.compiled): compiled, eager (not yet), or why not."""
        return {part.name: part.state for part in self._compiled}

    def compile_now(self) -> None:
        """Compile from the next step on, as a long run does after its first steps (fedsd bench step)."""
        for part in self._compiled:
            part.after = part.calls

    def bind(self, data: TensorData, plan: PrivacyPlan, client: int = 0) -> "DPTrainer":
        """Train on another data holder's data under its plan from now on: a Ray worker serves
        many simulated clients in turn with one trainer. The model structure, the Opacus
        wrappers and the optimizer are shared (the batch size B, which Opacus averages by, is
        the run's); all a client carries from round to round is in its TrainState."""
        # The data, the student and the teacher share one layout, so no step converts any of them.
        self.data = data.to(self.device, self.memory_format)
        self.plan, self.client = plan, client
        self.num_train = len(data.y_train)
        self.steps_per_epoch = steps_per_epoch(self.num_train, self.cfg.batch_size)
        # With adaptive clipping the gradient takes σ_Δ, the count the rest of the plan's z (Theorem 1)
        self.optimizer.noise_multiplier = (self.adaptive.gradient_noise_multiplier(plan.noise_multiplier)
                                           if self.adaptive is not None else plan.noise_multiplier)
        return self

    # -- one call: some epochs from a given global model -------------------------------------
    def local_update(self, model: Model, state: TrainState | None, epochs: list[int],
                     teacher: Weights | None = None, proximal_mu: float = 0.0,
                     callbacks: list[StepCallback] = ()) -> tuple[Model, TrainState, dict]:
        """Train the given (1-based, global) epochs starting from `model`.

        `teacher` overrides the self-distillation teacher (teacher=local-previous); by default
        it is a frozen copy of the incoming student (teacher=round-start). `proximal_mu` > 0
        adds FedProx's pull towards the incoming student. `callbacks`: this call's own step
        callbacks (fedsd.training.callbacks), after the method's. Raises BudgetExhausted, training
        nothing, when these epochs would overspend the budget.
        """
        cfg = self.cfg
        self.check_budget(state, epochs)
        state = copy.deepcopy(state) if state is not None else TrainState(self.plan.history_before_training())
        accountant = AccountantHistory(self.plan.accountant, state.history)
        self._start_draws(state)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)

        model = with_release(cfg, {k: dict(v) for k, v in model.items()})
        self.load_student(model["student"])
        self._restore_carried(state)
        if teacher is not None or self.method.self_distilling:
            self.load_teacher(teacher if teacher is not None else model["student"])
        callbacks = [*self.method.step_callbacks(cfg, model, state.steps, self.device),
                     *release_callbacks(cfg, model, state.steps, self.device),
                     *([ProximalTerm(proximal_mu)] if proximal_mu > 0 else []), *callbacks]
        for callback in callbacks:
            callback.on_call_start(self)

        started, loss_sum, steps_run = time.perf_counter(), 0.0, 0
        divergence = DivergenceCheck(self.cfg, self.data.num_classes)
        for epoch in epochs:
            self.method.on_epoch_start(cfg, epoch, model, self)
            objective = self.method.epoch_loss(cfg, epoch)
            for _ in range(self.steps_per_epoch):
                loss = self._step(objective, callbacks)
                if self.secret is None:
                    divergence.after_step(loss, epoch, objective.chance)
                loss_sum += loss
                accountant.step(self.plan.noise_multiplier, self.plan.sample_rate)
                state.steps += 1
                steps_run += 1

        if self.secret is None:
            divergence.at_end()
        for callback in callbacks:
            callback.on_call_end(self)
        student = self.student_weights()
        model["student"] = student
        state.history = accountant.history
        self._end_draws(state)
        state.local_model = student
        state.momentum = self._momentum()
        metrics = dict(num_examples=self.num_train, train_loss=loss_sum / max(steps_run, 1), steps=steps_run,
                       epsilon=accountant.epsilon(self.plan.delta), noise_multiplier=self.plan.noise_multiplier,
                       seconds=time.perf_counter() - started)
        if self.adaptive is not None:  # a release: post-processing of the noised counts
            state.clip = metrics["clip"] = self.clipper.clip
        return model, state, metrics

    def _start_draws(self, state: TrainState) -> None:
        """Where this call's batches and noise come from. Secret draws (an own-data client): its
        secret stream, a sample whose gradient is not finite kept out of the clipped sum, and no
        stop on divergence, which would release a bit of the data no noise covers. Else the
        seeded generator, bit for bit as ever."""
        if state.secret is not None and not self.clipper.guards_nonfinite:
            raise ConfigError(f"--grad-sample-mode {self.clipper.mode}: cannot keep a sample whose gradient is not "
                              f"finite out of the clipped sum, which secret draws need (an own-data client); use "
                              f"bk, hooks, functorch or ew")
        self.secret = self.optimizer.noise_source = state.secret
        self.clipper.zero_nonfinite = state.secret is not None
        if state.rng_state is None:
            self.generator.manual_seed(_rng_seed(self.cfg, self.client))
        else:
            self.generator.set_state(state.rng_state)

    def _end_draws(self, state: TrainState) -> None:
        """The generator's state into `state`; a secret stream lives in the returned state only."""
        if self.secret is None:
            state.rng_state = self.generator.get_state()
        self.secret = self.optimizer.noise_source = None
        self.clipper.zero_nonfinite = False

    def evaluate(self, weights: Weights, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """(accuracy, mean loss) of `weights` on (x, y), in a plain copy of the model: no
        training step, so nothing is spent (what it releases is the caller's to say)."""
        if self._evaluation_model is None:
            self._evaluation_model = copy.deepcopy(self.teacher)
        self._evaluation_model.load_state_dict(weights)
        return evaluate(self._evaluation_model, x.to(self.device).contiguous(memory_format=self.memory_format),
                        y.to(self.device))

    def check_budget(self, state: TrainState | None, epochs: list[int]) -> None:
        """Raise BudgetExhausted when these epochs would spend more than this run's (ε, δ)."""
        accountant = AccountantHistory(self.plan.accountant, state.history if state is not None
                                       else self.plan.history_before_training())
        steps_to_run = len(epochs) * self.steps_per_epoch
        after = accountant.epsilon_after(steps_to_run, self.plan.noise_multiplier, self.plan.sample_rate,
                                     self.plan.delta)
        if after > self.plan.epsilon * (1 + 1e-9):
            raise BudgetExhausted(f"{steps_to_run} more steps would spend ε={after:.3f} > budget "
                                  f"{self.plan.epsilon} (spent so far {accountant.epsilon(self.plan.delta):.3f})")

    # -- the weights a method changes in a call --------------------------------------------
    def trainable(self) -> list[torch.nn.Parameter]:
        """The weights DP-SGD trains: all but those of frozen blocks (--train-layers)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def student_weights(self) -> Weights:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_student(self, weights: Weights) -> None:
        self.model.load_state_dict(weights)

    def load_teacher(self, weights: Weights) -> None:
        self.teacher.load_state_dict(weights)

    # -- one step ---------------------------------------------------------------------------
    def _step(self, objective: EpochLoss, callbacks=()) -> float:
        # Poisson sampling (docs/algorithms.md): each sample joins the batch independently with rate q.
        if self.secret is not None:
            mask = self.secret.bernoulli(self.num_train, self.plan.sample_rate, self.device)
        else:
            mask = torch.rand(self.num_train, generator=self.generator, device=self.device) < self.plan.sample_rate
        return self.train_on_batch(self.data.x_train[mask], self.data.y_train[mask], objective, callbacks)

    def train_on_batch(self, x: torch.Tensor, y: torch.Tensor, objective: EpochLoss, callbacks=(),
                       update: bool = True, weight: torch.Tensor | None = None) -> float:
        """One DP-SGD step on a given batch: per-sample clipping, noise, the update (with
        update=False, the private gradient is left in each p.grad and the weights unchanged).
        `weight`: 0 or 1 a row (a padded batch's rows of 0 add nothing to the clipped sum)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.clipper.counted = torch.zeros((), dtype=torch.float64)
        if not len(y):
            self.clipper.empty_batch()
            self._optimizer_step(callbacks, update)
            return 0.0
        if len(y) <= self.physical_batch_size:
            loss = float(self._backward(x, y, objective, weight).detach())
        else:  # in physical batches, each one's clipped sum kept until the last (fedsd.training.physical_batches)
            loss = 0.0
            for start in range(0, len(y), self.physical_batch_size):
                part = slice(start, start + self.physical_batch_size)
                if start:
                    self.clipper.hold()
                loss += float(self._backward(x[part], y[part], objective,
                                             None if weight is None else weight[part]).detach()) * len(y[part])
            self.clipper.release_held()
            loss /= len(y)
        self._optimizer_step(callbacks, update)
        return loss

    def clipped_sum(self, objective: EpochLoss, pad_to: int = 0,
                    sample_rate: float | None = None) -> tuple[float, torch.Tensor]:
        """One Poisson batch's clipped per-sample gradient sum, flattened, with no noise and no
        update: a client's part of a step whose noise the clients add together
        (fedsd.secure.distributed_step). Draws as `_step` does (the call's secret stream or generator).

        `pad_to` > 0: the batch is padded with rows of zeros, weighted 0, to `pad_to` rows (a
        larger batch is not cut), so the per-sample work, and the time it takes, is that of
        `pad_to` rows whatever the batch drawn (a deployment's service: its Poisson batch
        is private). The loss is then the padded batch's, a diagnostic only. `sample_rate`: the
        rate records are drawn at (at most the plan's, which the accountant charges); None: the plan's."""
        q = self.plan.sample_rate if sample_rate is None else min(sample_rate, self.plan.sample_rate)
        if self.secret is not None:
            mask = self.secret.bernoulli(self.num_train, q, self.device)
        else:
            mask = torch.rand(self.num_train, generator=self.generator, device=self.device) < q
        x, y, weight = self.data.x_train[mask], self.data.y_train[mask], None
        if pad_to > len(y):
            padding = pad_to - len(y)
            weight = torch.cat([torch.ones(len(y), device=self.device), torch.zeros(padding, device=self.device)])
            x = torch.cat([x, torch.zeros((padding, *x.shape[1:]), dtype=x.dtype, device=self.device)])
            if x.dim() == 4:  # the run's layout (the data's, the student's)
                x = x.contiguous(memory_format=self.memory_format)
            y = torch.cat([y, torch.zeros(padding, dtype=y.dtype, device=self.device)])
        self.rows_computed = len(y)  # what the per-sample work covered (a test reads it)
        noise, self.optimizer.noise_multiplier = self.optimizer.noise_multiplier, 0.0
        try:
            loss = self.train_on_batch(x, y, objective, update=False, weight=weight)
        finally:
            self.optimizer.noise_multiplier = noise
        grads = [p.grad.reshape(-1) for p in self.model.parameters() if p.requires_grad]
        return loss, torch.cat(grads) * self.optimizer.expected_batch_size

    def _backward(self, x: torch.Tensor, y: torch.Tensor, objective: EpochLoss,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
        """The clipped per-sample gradients of (x, y) where the optimizer reads them; the mean loss.

        With secret draws, a sample whose gradient is not finite (its loss overflowed, or a
        model the server chose makes it so) joins the clipped sum with a zero gradient: the
        clipper zeroes it in the same pass, with the same work for any data (Clipper.
        zero_nonfinite). Whether a sample's gradient is finite depends on that sample and the
        model alone, so this is a per-sample clipping rule (norm 0 ≤ C): the sensitivity and the
        accounting are unchanged, and the released update stays finite. `weight` (0 or 1 a
        row) multiplies each sample's loss: a row of weight 0 has a zero gradient."""
        secret = self.secret is not None  # an owner's data: nothing compiled (fedsd.training.compiled)
        teacher_logits = None
        if objective.reads_teacher:
            with torch.no_grad():
                teacher_logits = (self.teacher if secret else self._teacher_forward)(x)
        logits = (self.clipper.module if secret else self._student_forward)(x)
        per_sample = objective.per_sample(logits, teacher_logits, y)
        return self.clipper.backward(per_sample if weight is None else per_sample * weight.to(per_sample.dtype))

    def _optimizer_step(self, callbacks, update: bool = True) -> None:
        """Opacus' DPOptimizer.step, with the callbacks' hooks on either side of the noise."""
        for callback in callbacks:
            callback.before_noise(self)
        if self.optimizer.pre_step():  # clip, noise, average: the private gradient
            if self.cfg.clip_normalize:  # in units of the step's clip (post-processing of the private gradient)
                for p in self.trainable():
                    if p.grad is not None:
                        p.grad.div_(self.clipper.clip)
            for callback in callbacks:
                callback.after_noise(self)
            if update:
                self.optimizer.original_optimizer.step()
                if self.adaptive is not None:
                    self._adapt_clip()
        for callback in callbacks:
            callback.after_step(self)

    def _adapt_clip(self) -> None:
        """Adaptive clipping: release the step's centred count with its noise σ_b (from the call's
        secret stream or generator, as the gradient's), and move the clip by it."""
        sigma_b = self.adaptive.count_noise
        if self.secret is not None:
            noise = float(self.secret.gaussian_like(torch.zeros(1, dtype=torch.float64), sigma_b))
        else:
            noise = float(torch.normal(0.0, sigma_b, (1,), generator=self.generator, device=self.device))
        self.clipper.set_clip(self.adaptive.next_clip(self.clipper.clip, float(self.clipper.counted) + noise))

    def _momentum(self) -> list[torch.Tensor] | None:
        if not self.cfg.momentum:
            return None
        state = self.optimizer.original_optimizer.state
        return [state[p]["momentum_buffer"].clone() for p in self.trainable()]

    def _restore_carried(self, carried: TrainState) -> None:
        """The trainer is shared between rounds (and, in a worker, between clients): momentum
        buffers and the clip estimate belong to the carried state, never to the trainer."""
        state = self.optimizer.original_optimizer.state
        state.clear()
        if carried.momentum is not None:
            for p, buf in zip(self.trainable(), carried.momentum):
                state[p]["momentum_buffer"] = buf.clone().to(p.device)
        self.clipper.set_clip(carried.clip if carried.clip is not None else self.cfg.clip)

