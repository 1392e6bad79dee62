"""What a client does with a round's message, in whichever process answers it: local DP-SGD
with self-distillation on this client's data (SPEC §5, §8), or federated evaluation.

Its data is its SuperNode's own (`--node-config data=...`, with client-data=own), or in a
simulation its shard of a built-in data set. Each round it receives the global model and the
run's settings, trains E local epochs with fedsd's loop, and replies with the new weights and
its metrics. Its privacy state (one accountant history for the run, the RNG state, the step
count) lives in context.state and, under the server's experiment id, on the client's own disk,
so a client never restarts its accounting; one whose state was lost anyway refuses, told by the
server what it reported spending before (state_lost). With `max-epsilon` in its node config, the owner's
lifetime ledger (a Rényi privacy filter per data set) admits each run and charges each round
before it runs, whatever the server asks. A client that may not train replies with metrics
only: skipped = 1, and refused = 1 with its reason when the owner's limits said no, or
diverged = 1 with the reason when its loss exploded (the server then stops the run).

A round asked again after a restart (the server resumed from the round before, after this client
had trained, charged and answered it) is answered with the reply it already released, kept beside
its privacy state: sending the same update twice releases nothing new, so it is not charged
again. Training it anew would release a second, different update and cost a second round, and
the resumed run's last round would then find the budget spent.

The handlers take a message's content and the Context and return the reply's content, so the
ClientApp (clients/app.py) can run them in its own process or in the node's warm worker
(clients/worker.py).
"""
from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedsd import data as data_lib
from fedsd import ledger as ledgers
from fedsd import privacy
from fedsd.central import resolve_device
from fedsd.client_data import DataError, HolderData, load_holder_data, normalised, task_for
from fedsd.config import validate
from fedsd.errors import ConfigError
from fedsd.results import save_atomic
from fedsd.federation import FedOptions, client_config, from_flat, round_epochs, round_teacher
from fedsd.training import (BudgetExhausted, DPTrainer, Model, TrainingDiverged, load_train_state, released,
                            save_train_state)

from task.federation import Federation, build_federation
from task.records import SPENT_EPSILON, load_state, model_to_record, record_to_model, save_state

from clients import node_config as node_configs
from clients.node_config import NodeConfig, NodeConfigError


# Per worker process: the federation's data side and one DPTrainer, for the latest run only
# (a Ray worker serves one run at a time). The trainer is re-pointed at each client it serves
# (DPTrainer.bind): its structure and Opacus wrappers are the same for every client, and what a
# client carries between rounds is in its context.state. So a worker's memory does not grow
# with the number of clients it has served, a thousand or more.
_FEDERATIONS: dict[tuple, Federation] = {}
_TRAINERS: dict[tuple, DPTrainer] = {}


def trainer_for(flat: dict, partition_id: int) -> tuple[Federation, DPTrainer]:
    """This worker's trainer, bound to client `partition_id`'s shard and privacy plan."""
    key = tuple(sorted(flat.items()))
    if key not in _FEDERATIONS:
        _FEDERATIONS.clear()
        _TRAINERS.clear()
        _FEDERATIONS[key] = build_federation(*from_flat(flat))
    federation = _FEDERATIONS[key]
    device = resolve_device(federation.cfg.device)
    data, plan = federation.client_data(partition_id, device), federation.client_plan(partition_id)
    if key not in _TRAINERS:
        _TRAINERS[key] = DPTrainer(federation.cfg, data, plan, client=partition_id)
    elif _TRAINERS[key].client != partition_id:
        _TRAINERS[key].bind(data, plan, client=partition_id)
    return federation, _TRAINERS[key]


SKIPPED_NAMED = 5  # unreadable files named in a reply (with skip-bad-files); the count is always there
REPLY_FORMAT = 1  # of a client's kept last reply (last_reply_file)


def client_state_file(node: NodeConfig, experiment_id: str, partition_id: int) -> Path | None:
    """Where this client keeps its privacy state on its own disk (NodeConfig.state_root), one
    file per experiment (the server's id for the run, kept across --resume) and client."""
    if not experiment_id:
        return None
    return node.state_root / experiment_id / f"client-{partition_id}.pt"


def last_reply_file(state_file: Path) -> Path:
    """Where a client keeps the last reply it released, beside its privacy state."""
    return state_file.with_name(f"{state_file.stem}-last-reply.pt")


def request_digest(server_round: int, arrays: ArrayRecord) -> str:
    """What a train request asks for: the round and the exact global model (every array's name,
    dtype, shape and bytes). The run is fixed by the folder the reply is kept in."""
    digest = hashlib.sha256(f"round {server_round}".encode())
    for key in sorted(arrays):
        a = arrays[key].numpy()
        digest.update(f"{key} {a.dtype} {a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def replayed_reply(state_file: Path | None, request: str) -> tuple[ArrayRecord, dict] | None:
    """The arrays and metrics this client already released for `request`, if it is the last
    request it answered; else None. An unreadable file is no reply (the round is trained and
    charged, the safe side)."""
    path = None if state_file is None else last_reply_file(state_file)
    if path is None or not path.is_file() or not state_file.is_file():
        return None
    try:
        kept = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001  (a damaged file: train and charge instead)
        return None
    if not isinstance(kept, dict) or kept.get("format") != REPLY_FORMAT or kept.get("request") != request:
        return None
    return ArrayRecord({k: Array(v.numpy()) for k, v in kept["arrays"].items()}), dict(kept["metrics"])


def keep_reply(state_file: Path, request: str, arrays: ArrayRecord, metrics: dict) -> None:
    """Keep the reply about to be released (after the state that charged it is on disk: a
    client stopped between the two trains the round again and is charged again, never less)."""
    save_atomic(last_reply_file(state_file), dict(
        format=REPLY_FORMAT, request=request, metrics=metrics,
        arrays={k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in arrays.items()}))


def own_trainer(flat: dict, node: NodeConfig, partition_id: int) -> tuple[FedOptions, DPTrainer, HolderData]:
    """The trainer for the data this SuperNode names (`data` in its --node-config), prepared
    once for the run's task and cached on its disk. Returns (fed, trainer, the data as held:
    its fingerprint and the files left out). Raises DataError / ConfigError naming the file or
    setting, before any step."""
    cfg, fed = from_flat(flat)
    fed.validate()
    cfg = client_config(cfg, fed)
    task = task_for(cfg)
    held = load_holder_data(node.data, task, node.state_root / "data-cache", skip_bad_files=node.skip_bad_files)
    key = (tuple(sorted(flat.items())), "own", held.fingerprint, partition_id)
    if key not in _TRAINERS:
        n = len(held.y_train)
        if n < cfg.batch_size:
            raise DataError(f"data={held.source}: {n} training samples, fewer than the batch size {cfg.batch_size}")
        validate(cfg, n)
        tensors = data_lib.TensorData(normalised(held.x_train, task), held.y_train, normalised(held.x_test, task),
                                      held.y_test, len(task.classes)).to(resolve_device(cfg.device))
        # Cached on this client's disk: a deployed ClientApp is a fresh process for every message.
        plan = privacy.plan(cfg.epsilon, cfg.delta, n, cfg.batch_size, cfg.epochs, cfg.accountant,
                            cache_dir=str(node.state_root / "calibrations"))
        _TRAINERS.clear()  # one data set a process: a fresh ClientApp process, or one Ray worker's client
        _TRAINERS[key] = DPTrainer(cfg, tensors, plan, client=partition_id)
    return fed, _TRAINERS[key], held


def shard_fingerprint(federation: Federation, partition_id: int) -> str:
    """A simulated client's data: its shard of a built-in data set."""
    indices = federation.train_indices[federation.shards[partition_id]].numpy().tobytes()
    return hashlib.sha256(federation.cfg.dataset.encode() + indices).hexdigest()[:32]


def lifetime_ledger(node: NodeConfig, fingerprint: str):
    """The owner's lifetime privacy filter for this data (fedsd.ledger), locked against other
    runs on this machine while a round is admitted and recorded; None for a simulated client
    whose node sets no max-epsilon (the run's ε is its budget). A node with its own data always
    has one (NodeConfig.require_budget)."""
    if node.max_epsilon is None:
        return nullcontext(None)
    return ledgers.opened(node.state_root, fingerprint, node.max_epsilon, node.max_delta)


def node_settings(flat: dict, node_config) -> NodeConfig:
    """This node's config, checked as a whole and against the run (ConfigError naming the key);
    its own data folder for the built-in data sets, if it names one."""
    node = node_configs.parse(node_config)
    num_clients = int(flat.get("num-clients", FedOptions().num_clients))
    if node.num_partitions is not None and node.num_partitions != num_clients:
        raise NodeConfigError(f"node-config num-partitions={node.num_partitions} but the run has "
                          f"num-clients={num_clients}")
    if not node.partition_id < num_clients:
        raise NodeConfigError(f"node-config partition-id={node.partition_id} is outside [0, {num_clients})")
    if node.data_dir:
        flat["data-dir"] = node.data_dir
    return node


@dataclass(frozen=True)
class ClientSide:
    """What a message is to be answered with: the round, this node's checked config, the run's
    federation settings, the trainer bound to this client's data, the data's fingerprint (its
    ledger), the simulated federation (None for own data) and the files its owner chose to
    leave out (skip-bad-files), and the ε the server has recorded for this client (0 if none)."""
    server_round: int
    node: NodeConfig
    fed: FedOptions
    trainer: DPTrainer
    fingerprint: str
    federation: Federation | None
    skipped_files: list[str]
    server_recorded_epsilon: float


def client_side(content: RecordDict, context: Context) -> ClientSide:
    """This SuperNode's own files with client-data=own, else (a simulation) this client's shard
    of a built-in data set. The node config is checked first, and a node with its own data and
    no owner's budget refuses (BudgetRefused) before its data is read."""
    flat = dict(content["config"])
    server_round = int(flat.pop("server-round"))
    recorded_epsilon = float(flat.pop(SPENT_EPSILON, 0.0))  # this client's alone: not a setting of the run
    node = node_settings(flat, context.node_config)
    node.require_budget()
    if flat.get("client-data") == "own":
        if not node.owns_data:
            raise ConfigError("client-data=own: this run trains on each client's own data; start the SuperNode "
                              "with --node-config \"data='/path/to/folder-or.npz' max-epsilon=… ...\"")
        fed, trainer, held = own_trainer(flat, node, node.partition_id)
        return ClientSide(server_round, node, fed, trainer, held.fingerprint, None, held.skipped, recorded_epsilon)
    federation, trainer = trainer_for(flat, node.partition_id)
    return ClientSide(server_round, node, federation.fed, trainer, shard_fingerprint(federation, node.partition_id),
                      federation, [], recorded_epsilon)


def refusal(metrics: dict, reason: str) -> RecordDict:
    """A reply that trains nothing, with the owner's reason for the server's summary."""
    return RecordDict({"metrics": MetricRecord({**metrics, "skipped": 1, "refused": 1}),
                       "refusal": ConfigRecord({"reason": reason})})


def spent_so_far(state, plan: privacy.PrivacyPlan) -> float:
    """ε this client spent in the run before this round (its carried accountant history)."""
    return 0.0 if state is None else privacy.Ledger(plan.accountant, state.history).epsilon(plan.delta)


def state_lost(side: ClientSide, state, state_file: Path | None) -> str | None:
    """Why this client may not train: the server has recorded more ε from its earlier replies in
    this experiment than its own privacy state holds, so that state was lost or replaced (a
    deleted state-dir, a SuperNode moved to another machine). Else None."""
    own = spent_so_far(state, side.trainer.plan)
    recorded = side.server_recorded_epsilon
    if recorded <= own + 1e-6 * max(1.0, recorded):
        return None
    where = f"{state_file}" if state_file is not None else "its context.state"
    return (f"the server recorded ε = {recorded:.4f} spent by client {side.node.partition_id} in this experiment, "
            f"but its privacy state ({where}) holds ε = {own:.4f}: the state was lost or replaced, and the client "
            f"will not start its accounting again; restore the node's state-dir ({side.node.state_root}) or start "
            f"a new experiment")


def evaluate_reply(content: RecordDict, context: Context) -> RecordDict:
    """Federated evaluation: the global model on this client's own test split (no training
    step, nothing spent from the budget; the accuracy it sends is outside the DP guarantee)."""
    side = client_side(content, context)
    trainer, federation, partition_id = side.trainer, side.federation, side.node.partition_id
    x_test, y_test = trainer.data.x_test, trainer.data.y_test  # its own test split, or in a simulation
    if federation is not None:  # its share of the public one
        share = federation.client_test_share(partition_id).to(trainer.device)
        x_test, y_test = x_test[share], y_test[share]
    accuracy, loss = (trainer.evaluate(released(record_to_model(content["arrays"])), x_test, y_test)
                      if len(y_test) else (0.0, 0.0))  # no test split: weight 0 in the average
    return RecordDict({"metrics": MetricRecord({"num-examples": len(y_test), "partition-id": partition_id,
                                                "test-accuracy": accuracy, "test-loss": loss})})


def train_reply(content: RecordDict, context: Context) -> RecordDict:
    """One round of local training (or a refusal, with the reason)."""
    try:
        side = client_side(content, context)
    except (privacy.BudgetRefused, NodeConfigError, DataError) as e:
        # The node's own settings or its own data say no: nothing trained or spent. A refusal
        # (not an error) so that the server can name this client and its reason.
        partition_id = node_configs.parse_partition_id(context.node_config)
        if partition_id is None:
            raise  # without its number the server could not say who refused: a failed reply instead
        return refusal({"num-examples": 0, "partition-id": partition_id, "epsilon": 0.0}, str(e))
    server_round, node, fed, trainer, fingerprint = side.server_round, side.node, side.fed, side.trainer, side.fingerprint
    partition_id = node.partition_id
    # FedProx sends its μ as "proximal-mu" in the round's config: the run config's key of that name.
    proximal_mu = fed.proximal_mu if fed.strategy == "fedprox" else 0.0
    # The state of this run (context.state), else what this client left on its disk in an
    # earlier launch of the same experiment (a resumed server, a restarted SuperNode).
    state_file = client_state_file(node, fed.experiment_id, partition_id)
    request = request_digest(server_round, content["arrays"])
    kept = replayed_reply(state_file, request)
    if kept is not None:  # already released: the same reply again, nothing trained or charged
        arrays, metrics = kept
        save_state(context.state, load_train_state(state_file, trainer.plan), trainer.plan)  # charged for it
        return released_answer(arrays, MetricRecord({**metrics, "replayed": 1}), side)
    state = load_state(context.state, trainer.plan)
    if state is None and state_file is not None and state_file.is_file():
        state = load_train_state(state_file, trainer.plan)
    model: Model = record_to_model(content["arrays"])
    base = {"num-examples": trainer.num_train, "partition-id": partition_id,
            "noise-multiplier": trainer.plan.noise_multiplier, "sample-rate": trainer.plan.sample_rate,
            **node.budget()}
    epochs = round_epochs(server_round, fed.local_epochs)
    plan = trainer.plan
    behind = state_lost(side, state, state_file)
    if behind:  # before anything is charged: an accountant started again would leave out what was spent
        return refusal({**base, "epsilon": spent_so_far(state, plan)}, behind)
    try:
        trainer.check_budget(state, epochs)  # the run's own plan, before the owner's ledger is charged
        with lifetime_ledger(node, fingerprint) as ledger:
            if ledger is not None:
                if state is None:  # this client's first round of the run: the whole plan must fit
                    ledger.check(plan.epsilon, plan.delta, plan.noise_multiplier, plan.sample_rate, plan.planned_steps)
                # Charged before the steps run: a round cut short still counts as spent.
                ledger.spend(plan.noise_multiplier, plan.sample_rate, len(epochs) * trainer.steps_per_epoch,
                             run=fed.experiment_id, flower_run=int(context.run_id), round=server_round)
    except privacy.BudgetRefused as e:
        return refusal({**base, "epsilon": spent_so_far(state, plan)}, str(e))
    except BudgetExhausted:
        return RecordDict({"metrics": MetricRecord({**base, "skipped": 1, "refused": 0,
                                                    "epsilon": spent_so_far(state, plan)})})
    teacher, state = round_teacher(fed, state, model["student"])
    try:
        model, state, metrics = trainer.local_update(model, state, epochs, teacher=teacher, proximal_mu=proximal_mu)
    except TrainingDiverged as e:  # nothing of the round is released; the server stops the run with the reason
        return RecordDict({"metrics": MetricRecord({**base, "skipped": 1, "diverged": 1,
                                                    "epsilon": spent_so_far(state, plan)}),
                           "divergence": ConfigRecord({"reason": str(e)})})
    save_state(context.state, state, trainer.plan)
    if state_file is not None:  # before replying: the spent budget is on disk before anyone can use it
        state_file.parent.mkdir(parents=True, exist_ok=True)
        save_train_state(state_file, state, trainer.plan)
    reply = {**base, "skipped": 0, "epsilon": metrics["epsilon"], "train-loss": metrics["train_loss"],
             "seconds": metrics["seconds"], "steps": metrics["steps"]}
    arrays = model_to_record(model)
    if state_file is not None:
        keep_reply(state_file, request, arrays, reply)
    return released_answer(arrays, MetricRecord(reply), side)


def released_answer(arrays: ArrayRecord, metrics: MetricRecord, side: ClientSide) -> RecordDict:
    answer = RecordDict({"arrays": arrays, "metrics": metrics})
    if side.skipped_files:  # the owner's choice (skip-bad-files): the server's summary names them
        answer["skipped-files"] = ConfigRecord({"count": len(side.skipped_files),
                                                "first": side.skipped_files[:SKIPPED_NAMED]})
    return answer


# What each kind of message is answered with (the ClientApp and the warm worker both use this).
HANDLERS = {"train": train_reply, "evaluate": evaluate_reply}
