"""What a client does with a round's message, in whichever process answers it: local DP-SGD
with self-distillation on this client's data (docs/algorithms.md), or federated evaluation.

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

A node with its own data holds out against a server it does not trust: its noise and its
batches come from a secret stream (fedsd.privacy.secret_random) under a fresh key from the OS for
every training call, never stored and never from the run's seed; its replies carry no training \
loss and no divergence (each a
function of its records); it answers federated evaluation only when its owner says so; it takes no path from
the server (no shard of a data set at a server's data-dir); and its privacy state stays in its
state folder (0700), never in the Context, which the ClientApp's code (the server's) can read.

The handlers take a message's content and the Context and return the reply's content, so the
ClientApp (fedsd/app/client/client_app.py) can run them in its own process, in the node's warm worker or in the
owner's data service (fedsd/app/client/owner_service.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedsd.data import datasets as data_lib
from fedsd.privacy import lifetime_ledger as ledgers
from fedsd.privacy import owner_record
from fedsd.privacy import accounting as privacy
from fedsd.runtime import resolve_device
from fedsd.data.client_data import DataIdentity, HolderData, known_holder_data, load_holder_data, normalised, \
    task_for
from fedsd.data.features import inputs
from fedsd.errors import (BudgetExhausted, BudgetRefused, ConfigError, DataError, LedgerSpent, StateRolledBack,
                          TrainingDiverged)
from fedsd.settings.run import validate
from fedsd.files.results import write_json
from fedsd.privacy.secret_random import SecretStream
from fedsd.files.state_folder import read_nofollow
from fedsd.settings.federation import FedConfig, client_config, from_flat, round_epochs
from fedsd.training.loop import round_teacher
from fedsd.training.loop import (DPTrainer, Model, TrainState, load_train_state,
                                 planned_trainer, save_train_state)
from fedsd.methods import released
from fedsd.models.networks import feature_source

from fedsd.app.simulated_shards import Federation, build_federation
from fedsd.app.records import (SPENT_EPSILON, load_state, model_to_record, record_to_model,
                               save_state)

from fedsd.app.client import node_config as node_configs
from fedsd.app.client.node_config import NodeConfig, NodeConfigError
from fedsd.app.client.owner_checks import (check_finite_model,
                                          check_init_weights, check_model_allowed, check_sent_weights,
                                          pin_task, private_state_folder)
from fedsd.app.client.reply_store import (client_state_file, keep_reply, model_digest, replayed_reply,
                                          request_digest)


log = logging.getLogger("fedsd.client")

# What a client with its own data tells the server when its data does not fit a run, whatever
# the reason: a reason computed from the records (a class folder's name, a label, a file's name,
# a count) would be a release no noise covers. Its owner's log has the reason in full.
DATA_REFUSED = ("data: this client's own data does not fit the run's task (dataset, classes, channels, "
                "image-size), or cannot be read; its owner's log says why")


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
        _TRAINERS[key] = planned_trainer(federation.cfg, data, plan, client=partition_id)
    elif _TRAINERS[key].client != partition_id:
        _TRAINERS[key].bind(data, plan, client=partition_id)
    return federation, _TRAINERS[key]


SKIPPED_NAMED = 5  # unreadable files named in a reply (with skip-bad-files); the count is always there


Held = HolderData | DataIdentity  # the data as read, or as the cache's index knows it


def _trainer_key(flat: dict, held: Held, partition_id: int) -> tuple:
    return tuple(sorted(flat.items())), "own", held.fingerprint, partition_id


def own_trainer(flat: dict, node: NodeConfig, partition_id: int) -> tuple[FedConfig, DPTrainer, Held]:
    """The trainer for the data this SuperNode names (`data` in its --node-config), prepared
    once for the run's task and cached on its disk. Returns (fed, trainer, the data as held:
    its fingerprint and the files left out). Raises DataError / ConfigError naming the file or
    setting, before any step."""
    cfg, fed = from_flat(flat)
    check_model_allowed(cfg.model, node)
    if cfg.threads > (os.cpu_count() or 1):  # a process-wide setting of the owner's service
        raise ConfigError(f"threads={cfg.threads}: more than this machine's {os.cpu_count()} CPUs")
    fed.validate()
    cfg = client_config(cfg, fed)
    task = task_for(cfg)
    pin_task(node, task)
    cache = private_state_folder(node, "data-cache")
    try:
        # while this process trains from the data, its fingerprints from the cache's index alone (read once)
        held = known_holder_data(node.data, task, cache, skip_bad_files=node.skip_bad_files)
        if held is None or _trainer_key(flat, held, partition_id) not in _TRAINERS:
            held = load_holder_data(node.data, task, cache, skip_bad_files=node.skip_bad_files)
    except (DataError, ConfigError) as e:  # said in full to the owner alone
        log.warning("refused a round: %s", e)
        raise DataError(DATA_REFUSED) from None
    ledgers.adopt(node.state(), held.named_fingerprint, held.fingerprint)  # a ledger of fedsd 0.1.0's
    key = _trainer_key(flat, held, partition_id)
    if key not in _TRAINERS:
        n = len(held.y_train)
        distributed = fed.noise == "distributed"
        # client level (fedsd.secure.client_level): every record in every round's local epochs, nothing
        # sampled at a q; the run's settings checked against public numbers only, never this owner's n
        whole = distributed and fed.privacy_unit == "client"
        if distributed and not whole and not 0 < fed.sample_rate <= 1:
            raise ConfigError(f"sample-rate={fed.sample_rate}: noise=distributed draws each record at the run's q "
                              f"(batch-size / the federation's records), a setting in (0, 1]")
        if n < cfg.batch_size and not distributed:  # distributed: batch-size is the federation's expected batch
            raise ConfigError(f"batch-size={cfg.batch_size}: more than this client's training samples")
        # distributed: against the federation's records B / q (public), never this owner's n, which
        # a refusal would tell (δ < 1/n: its text, and whether it comes at all, over the server's δ)
        validate(cfg, cfg.batch_size if whole else
                 max(cfg.batch_size, math.floor(cfg.batch_size / fed.sample_rate)) if distributed else n)
        # the run's features of this client's own images, made on this machine (fedsd.data.features)
        tensors = data_lib.TensorData(
            inputs(normalised(held.x_train, task), feature_source(cfg), "training images"), held.y_train,
            inputs(normalised(held.x_test, task), feature_source(cfg), "test images"), held.y_test,
            len(task.classes)).to(resolve_device(cfg.device))
        # Cached on this client's disk: a deployed ClientApp is a fresh process for every message.
        if distributed:  # one step a round at the run's q; the noise is the round's plan's
            # (fedsd.secure.distributed_step)
            plan = privacy.PrivacyPlan(0.0, 1.0 if whole else fed.sample_rate, fed.rounds, cfg.epsilon, cfg.delta,
                                       "rdp")
        else:
            plan = privacy.plan(cfg.epsilon, cfg.delta, n, cfg.batch_size, cfg.epochs, cfg.accountant,
                                cache_dir=str(private_state_folder(node, "calibrations")))
        _TRAINERS.clear()  # one data set a process: a fresh ClientApp process, or one Ray worker's client
        _TRAINERS[key] = planned_trainer(cfg, tensors, plan, client=partition_id, guarded=node.secret_noise)
    if node.secret_noise and not _TRAINERS[key].clipper.guards_nonfinite:  # before anything is charged
        raise ConfigError(f"grad-sample-mode: the run's route ({_TRAINERS[key].clipper.mode}) cannot keep a sample "
                          f"whose gradient is not finite out of the clipped sum, which this client's secret draws "
                          f"need; use bk, hooks, functorch or ew")
    return fed, _TRAINERS[key], held


def shard_fingerprint(federation: Federation, partition_id: int) -> str:
    """A simulated client's data: its shard of a built-in data set."""
    indices = federation.train_indices[federation.shards[partition_id]].numpy().tobytes()
    return hashlib.sha256(federation.cfg.dataset.encode() + indices).hexdigest()[:32]


def lifetime_ledger(node: NodeConfig, fingerprint: str):
    """The owner's lifetime privacy filter for this data (fedsd.privacy.lifetime_ledger), locked against other
    runs on this machine while a round is admitted and recorded; None for a simulated client
    whose node sets no max-epsilon (the run's ε is its budget). A node with its own data always
    has one (NodeConfig.require_budget), checked against the owner's record outside its state
    folder before the charge (StateRolledBack where the folder is a restored, older copy) and
    the record raised with it (fedsd.privacy.owner_record)."""
    if node.max_epsilon is None:
        return nullcontext(None)
    return ledgers.opened(node.state(), fingerprint, node.max_epsilon, node.max_delta, records=node.records())


@contextmanager
def peeked_ledger(node: NodeConfig, fingerprint: str):
    """A copy of the owner's lifetime filter for this data, to try a charge on: nothing written
    (None where the node sets no max-epsilon, as lifetime_ledger)."""
    yield (None if node.max_epsilon is None else
           ledgers.peeked(node.state(), fingerprint, node.max_epsilon, node.max_delta))


def state_refused(e: StateRolledBack) -> str:
    """A state folder older than the owner's record: the details in the owner's log, and the
    server told only that the state refused."""
    log.error("refused a round: %s", e)
    return owner_record.SERVER_REASON


def node_settings(flat: dict, node_config) -> NodeConfig:
    """This node's config, checked as a whole and against the run (ConfigError naming the key);
    its own data folder for the built-in data sets, if it names one."""
    node = node_configs.parse(node_config)
    num_clients = int(flat.get("num-clients", FedConfig().num_clients))
    if node.num_partitions is not None and node.num_partitions != num_clients:
        raise NodeConfigError(f"node-config num-partitions={node.num_partitions} but the run has "
                          f"num-clients={num_clients}")
    if not node.partition_id < num_clients:
        raise NodeConfigError(f"node-config partition-id={node.partition_id} is outside [0, {num_clients})")
    if node.owns_data and flat.get("client-data") != "own":
        raise NodeConfigError(f"client-data={flat.get('client-data', FedConfig().client_data)}: this node holds its "
                              f"own data and trains only on it, never on a data set at a path the server names; "
                              f"run with client-data='own'")
    check_init_weights(flat, node)
    if node.data_dir:
        flat["data-dir"] = node.data_dir
    if node.download or node.owns_data:  # the node's choice, never the server's
        flat["download"] = node.download
    return node


@dataclass(frozen=True)
class ClientSide:
    """What a message is to be answered with: the round, this node's checked config, the run's
    federation settings, the trainer bound to this client's data, the data's fingerprint (its
    ledger), the simulated federation (None for own data) and the files its owner chose to
    leave out (skip-bad-files), and the ε the server has recorded for this client (0 if none)."""
    server_round: int
    node: NodeConfig
    fed: FedConfig
    trainer: DPTrainer
    fingerprint: str
    federation: Federation | None
    skipped_files: list[str]
    server_recorded_epsilon: float

    @property
    def own_data(self) -> bool:
        return self.federation is None

    @property
    def state_file(self) -> Path | None:
        return client_state_file(self.node, self.fed.experiment_id, self.node.partition_id)


def client_side(content: RecordDict, context: Context, *, plain_release: bool, training: bool = True) -> ClientSide:
    """This SuperNode's own files with client-data=own, else (a simulation) this client's shard
    of a built-in data set. The node config is checked first (one that does not parse is a
    refusal), and a node with its own data and no owner's budget refuses (BudgetRefused) before
    its data is read; so does an owner's secagg-only for a `plain_release` (an update that would
    reach the server alone, not inside a secure sum)."""
    flat = dict(content["config"])
    server_round = int(flat.pop("server-round"))
    recorded_epsilon = float(flat.pop(SPENT_EPSILON, 0.0))  # this client's alone: not a setting of the run
    node = node_settings(flat, context.node_config)
    if "arrays" in content:  # the owner's own copy of the weights against the model sent, before anything else
        check_sent_weights(content["arrays"], flat, node, first_round=training and server_round == 1)
    if plain_release and node.secagg_only:
        raise ConfigError("this owner takes part only through secure aggregation (node-config secagg-only=true)")
    if plain_release and flat.get("noise") == "distributed":
        raise ConfigError("noise=distributed: this client adds a share of the noise only inside a secure sum; a "
                          "plain round would release its share alone, far below the noise its guarantee counts")
    node.require_budget()
    if flat.get("client-data") == "own":
        if not node.owns_data:
            raise ConfigError("client-data=own: this run trains on each client's own data; start the SuperNode "
                              "with --node-config \"data='/path/to/folder-or.npz' max-epsilon=… ...\"")
        if not flat.get("experiment-id"):  # its privacy state lives on its disk, under the experiment's name
            raise ConfigError("experiment-id: a client with its own data needs the run's experiment id (the "
                              "server sets it)")
        if "arrays" in content:
            check_finite_model(content["arrays"])
        fed, trainer, held = own_trainer(flat, node, node.partition_id)
        private_state_folder(node, fed.experiment_id)  # checked here, where a refusal can still be said
        return ClientSide(server_round, node, fed, trainer, held.fingerprint, None, held.skipped, recorded_epsilon)
    federation, trainer = trainer_for(flat, node.partition_id)
    return ClientSide(server_round, node, federation.fed, trainer, shard_fingerprint(federation, node.partition_id),
                      federation, [], recorded_epsilon)


def refusal(metrics: dict, reason: str) -> RecordDict:
    """A reply that trains nothing, with the owner's reason for the server's summary (and in
    this client's log)."""
    log.warning("refused a round: %s", reason)
    return RecordDict({"metrics": MetricRecord({**metrics, "skipped": 1, "refused": 1}),
                       "refusal": ConfigRecord({"reason": reason})})


def hide_owner_paths(reason: str, node_config) -> str:
    """A reason as it may leave this machine: files named relative to the node's data folder,
    its state folder as `state-dir` and its roster as `secagg-roster`, never the owner's absolute
    paths (also where the node config no longer parses: its paths as the owner wrote them)."""
    try:
        node = node_configs.parse(node_config)
        data, state, roster = node.data, str(node.state_root), node.secagg_roster
    except ConfigError:  # one that does not parse (a data folder gone, a roster others can write): as given
        data, roster = str(node_config.get("data", "")), str(node_config.get("secagg-roster", ""))
        state = str(node_configs.state_root_of(str(node_config.get("state-dir", ""))))
    if roster:
        reason = reason.replace(roster, "<secagg-roster>")
    if data:
        root = str(Path(data).expanduser())
        reason = reason.replace(root + "/", "").replace(root, "<data>")
    return reason.replace(state, "<state-dir>")


def spent_so_far(state, plan: privacy.PrivacyPlan) -> float:
    """ε this client spent in the run before this round (its carried accountant history)."""
    return 0.0 if state is None else privacy.AccountantHistory(plan.accountant, state.history).epsilon(plan.delta)


def state_lost(side: ClientSide, state) -> str | None:
    """Why this client may not train: the server has recorded more ε from its earlier replies in
    this experiment than its own privacy state holds, so that state was lost or replaced (a
    deleted state-dir, a SuperNode moved to another machine). Else None."""
    own = spent_so_far(state, side.trainer.plan)
    recorded = side.server_recorded_epsilon
    if recorded <= own + 1e-6 * max(1.0, recorded):
        return None
    where = "its state-dir" if side.state_file is not None else "its context.state"
    return (f"the server recorded ε = {recorded:.4f} spent by client {side.node.partition_id} in this experiment, "
            f"but its privacy state ({where}) holds ε = {own:.4f}: the state was lost or replaced, and the client "
            f"will not start its accounting again; restore the node's state-dir or start a new experiment")


def evaluation_file(state_file: Path) -> Path:
    """Which model an own-data client may evaluate: the one it last received for training."""
    return state_file.with_name(f"{state_file.stem}-evaluation.json")


def evaluation_refused(side: ClientSide, arrays: ArrayRecord) -> str | None:
    """Why an own-data client does not evaluate this model on its private test split, else None.
    Evaluation is a release no accountant covers, so it is the owner's to allow
    (federated-evaluation=true), of the model this client last received for training only, at
    most once for each, and on at least min-evaluation-samples samples. That does not stop a
    server from evaluating a model of its choosing: it can send it for training first (one round,
    charged). So an owner who allows evaluation releases, each round, one number computed from
    its test split by a function the server may choose: outside the DP guarantee."""
    node = side.node
    if not node.federated_evaluation:
        return ("this client's owner has not allowed federated evaluation of its private test split "
                "(node-config federated-evaluation=true)")
    n = len(side.trainer.data.y_test)
    if n < node.min_evaluation_samples:
        return f"its test split is smaller than the owner's min-evaluation-samples={node.min_evaluation_samples}"
    path = evaluation_file(side.state_file)
    raw = read_nofollow(path)
    kept = json.loads(raw) if raw is not None else {}
    if kept.get("model") != model_digest(arrays):
        return "it evaluates only the model it last received for training"
    if kept.get("evaluated"):
        return f"it has already evaluated the model of round {kept['round']}"
    write_json(path, {**kept, "evaluated": True})  # before the numbers leave: once, whatever happens next
    return None


def evaluation_refusal(partition_id: int, reason: str) -> RecordDict:
    """An evaluation this client does not run: the keys of an evaluation (Flower averages only
    replies with the same keys), at weight 0, with the reason."""
    log.warning("refused an evaluation: %s", reason)
    return RecordDict({"metrics": MetricRecord({"num-examples": 0, "partition-id": partition_id,
                                                "test-accuracy": 0.0, "test-loss": 0.0}),
                       "refusal": ConfigRecord({"reason": reason})})


def evaluate_reply(content: RecordDict, context: Context) -> RecordDict:
    """Federated evaluation: the global model on this client's own test split (no training
    step, nothing spent from the budget; the accuracy it sends is outside the DP guarantee).
    A client with its own data answers only as its owner allows (evaluation_refused)."""
    try:
        side = client_side(content, context, plain_release=False, training=False)  # evaluation releases no update
    except NodeConfigError as e:  # the owner's node config says no (other weights than its own copy among them)
        partition_id = node_configs.parse_partition_id(context.node_config)
        if partition_id is None:
            raise
        return evaluation_refusal(partition_id, hide_owner_paths(str(e), context.node_config))
    trainer, federation, partition_id = side.trainer, side.federation, side.node.partition_id
    x_test, y_test = trainer.data.x_test, trainer.data.y_test  # its own test split, or in a simulation
    if federation is not None:  # its share of the public one
        share = federation.client_test_share(partition_id).to(trainer.device)
        x_test, y_test = x_test[share], y_test[share]
    elif (why := evaluation_refused(side, content["arrays"])) is not None:
        return evaluation_refusal(partition_id, why)
    accuracy, loss = (trainer.evaluate(released(record_to_model(content["arrays"])), x_test, y_test)
                      if len(y_test) else (0.0, 0.0))  # no test split: weight 0 in the average
    return RecordDict({"metrics": MetricRecord({"num-examples": len(y_test), "partition-id": partition_id,
                                                "test-accuracy": accuracy, "test-loss": loss})})


# -- training ----------------------------------------------------------------------------------
def train_reply(content: RecordDict, context: Context, into_sum: bool = False) -> RecordDict:
    """One round of local training (or a refusal, with the reason): admitted first (the node's
    config, its data, the run's plan, the owner's ledger), then trained."""
    try:
        side = client_side(content, context, plain_release=not into_sum)
    except (BudgetRefused, ConfigError, DataError) as e:
        # The node's own settings, its own data or a request it does not take say no: nothing
        # trained or spent. A refusal (not an error) so that the server can name this client and
        # its reason.
        partition_id = node_configs.parse_partition_id(context.node_config)
        if partition_id is None:
            raise  # without its number the server could not say who refused: a failed reply instead
        return refusal({"num-examples": 0, "partition-id": partition_id, "epsilon": 0.0},
                       hide_owner_paths(str(e), context.node_config))
    with state_lock(side):  # one round of this client's state at a time, whichever process answers it
        return locked_train_reply(side, content, context, into_sum)


def state_lock(side: "ClientSide"):
    """Held from reading this client's privacy state to keeping its reply: two processes asked
    the same experiment at once (two services, a worker and a service, on one state folder) take
    turns, the second finding the first's state and kept reply rather than the state before it."""
    if side.state_file is None:
        return nullcontext()
    return side.node.state().lock(f"{side.fed.experiment_id}/client-{side.node.partition_id}.lock")


def locked_train_reply(side: "ClientSide", content: RecordDict, context: Context, into_sum: bool) -> RecordDict:
    request = request_digest(side.server_round, content["arrays"])
    kept = replayed_reply(side.state_file, request)
    if kept is not None:  # already released: the same reply again, nothing trained or charged
        arrays, metrics, summed = kept
        if summed and not into_sum:  # released into a secure sum: never alone (fedsd/app/client/secure_stages.py)
            return refusal({"num-examples": 0, "partition-id": side.node.partition_id, "epsilon": 0.0},
                           "this round's update went into a secure sum; it is not released alone")
        if not side.own_data:
            save_state(context.state, load_train_state(side.state_file, side.trainer.plan), side.trainer.plan)
        return released_answer(arrays, MetricRecord({**metrics, "replayed": 1}), side)
    state = carried_state(side, context)
    base = {"num-examples": side.trainer.num_train, "partition-id": side.node.partition_id,
            "noise-multiplier": side.trainer.plan.noise_multiplier, "sample-rate": side.trainer.plan.sample_rate,
            **side.node.budget()}
    refused = admit(side, state, context, base)
    if refused is not None:
        return refused
    return train_round(side, state, content, context, request, base, into_sum)


def carried_state(side: ClientSide, context: Context) -> TrainState | None:
    """This client's privacy state in the run: context.state, else what it left on its disk in an
    earlier launch of the same experiment (a resumed server, a restarted SuperNode). A client
    with its own data keeps it on its disk only: the Context is readable by the ClientApp's
    code, which is the server's, and the state holds the secret key of its noise."""
    state = None if side.own_data else load_state(context.state, side.trainer.plan)
    if state is None and side.state_file is not None and side.state_file.is_file():
        state = load_train_state(side.state_file, side.trainer.plan)
    return state


def admit(side: ClientSide, state: TrainState | None, context: Context, base: dict,
          dry_run: bool = False) -> RecordDict | None:
    """The reply of a client that may not train this round (a refusal, or a skip when the run's
    own budget is spent); None when it may, its owner's ledger charged for the round (`dry_run`:
    the same checks on a copy of the ledger, nothing charged or written)."""
    plan, trainer = side.trainer.plan, side.trainer
    epochs = round_epochs(side.server_round, side.fed.local_epochs)
    behind = state_lost(side, state)
    if behind:  # before anything is charged: an accountant started again would leave out what was spent
        return refusal({**base, "epsilon": spent_so_far(state, plan)}, behind)
    try:
        trainer.check_budget(state, epochs)  # the run's own plan, before the owner's ledger is charged
        with (peeked_ledger if dry_run else lifetime_ledger)(side.node, side.fingerprint) as ledger, \
                ledger_refusals():
            if ledger is not None:
                if state is None:  # this client's first round of the run: the whole plan must fit
                    ledger.check(plan.epsilon, plan.delta, plan.noise_multiplier, plan.sample_rate, plan.planned_steps)
                # Charged before the steps run: a round cut short still counts as spent.
                ledger.spend(plan.noise_multiplier, plan.sample_rate, len(epochs) * trainer.steps_per_epoch,
                             run=side.fed.experiment_id, flower_run=int(context.run_id), round=side.server_round)
    except BudgetRefused as e:
        return refusal({**base, "epsilon": spent_so_far(state, plan)}, str(e))
    except StateRolledBack as e:
        return refusal({**base, "epsilon": spent_so_far(state, plan)}, state_refused(e))
    except BudgetExhausted:
        return RecordDict({"metrics": MetricRecord({**base, "skipped": 1, "refused": 0,
                                                    "epsilon": spent_so_far(state, plan)})})
    return None


LEDGER_REFUSED = ("budget: this owner's lifetime ledger does not admit this run (what it holds and what the run "
                  "asks are in the owner's log)")


@contextmanager
def ledger_refusals():
    """A refusal for what the owner's lifetime ledger has spent, as the server is told it:
    "budget", no figure (the ledger counts what other federations spent too); in full in the
    owner's log. A run asking more than the owner's limits (which its replies publish) says so."""
    try:
        yield
    except LedgerSpent as e:
        log.warning("refused a round: %s", e)
        raise BudgetRefused(LEDGER_REFUSED) from None


def secret_start() -> TrainState:
    """The state a client with its own data starts a run from: its batches and noise drawn from
    a secret stream (fedsd.privacy.secret_random: AES-256-CTR under a 256-bit key from the operating
    system), never from anything the server sends or sees. The key lives in memory for one call
    and is never written, so the server can neither replay the noise nor search for it, and no
    copy of the state folder replays it either."""
    return TrainState(secret=SecretStream.fresh())


def charged_only(state: TrainState | None, trainer, epochs: int) -> TrainState:
    """`state` with a round's steps counted as spent (its accountant's history and its steps), the
    round having trained nothing that left the client."""
    if state is None:
        state = TrainState(trainer.plan.history_before_training())
    steps = epochs * trainer.steps_per_epoch
    history = state.history + [[trainer.plan.noise_multiplier, trainer.plan.sample_rate, steps]]
    return dataclasses.replace(state, history=history, steps=state.steps + steps)


def train_round(side: ClientSide, state: TrainState | None, content: RecordDict, context: Context, request: str,
                base: dict, into_sum: bool = False) -> RecordDict:
    """The admitted round: train, keep the state that charged it on disk, then release."""
    trainer, fed = side.trainer, side.fed
    model: Model = record_to_model(content["arrays"])
    if side.node.secret_noise:
        # Every call's draws from a new key (fedsd.privacy.secret_random): no copy of the state on any disk
        # (a second service, a restored backup) can replay a keystream. A state an earlier version
        # kept (a key, or a generator seeded with a 64-bit secret): its accounting goes on.
        state = secret_start() if state is None else dataclasses.replace(state, secret=SecretStream.fresh(),
                                                                         rng_state=None)
    teacher, state = round_teacher(fed, state, model["student"])
    proximal_mu = fed.proximal_mu if fed.strategy == "fedprox" else 0.0  # FedProx's μ, the run config's key
    epochs = round_epochs(side.server_round, fed.local_epochs)
    try:
        model, state, metrics = trainer.local_update(model, state, epochs, teacher=teacher, proximal_mu=proximal_mu)
    except TrainingDiverged as e:  # nothing of the round is released; the server stops the run with the reason
        # A client with its own data says only that: the loss at which it stopped is a number
        # computed from its records, which no noise covers.
        reason = ("training diverged (its loss left the objective's chance level); lower lr, or leave it unset "
                  "for the default, which scales with the batch size") if side.own_data else str(e)
        return RecordDict({"metrics": MetricRecord({**base, "skipped": 1, "diverged": 1,
                                                    "epsilon": spent_so_far(state, trainer.plan)}),
                           "divergence": ConfigRecord({"reason": reason})})
    except Exception:
        # Charged (admit) and nothing released: the round still counts as taken part in, on disk,
        # so that a server that makes every attempt fail (a review playing the attacker crashed the
        # steps with its settings) spends at most the run's own budget, never the owner's whole ledger.
        if side.state_file is not None:
            save_train_state(side.state_file, charged_only(state, trainer, len(epochs)), trainer.plan)
        raise
    if not side.own_data:
        save_state(context.state, state, trainer.plan)
    state_file = side.state_file
    if state_file is not None:  # before replying: the spent budget is on disk before anyone can use it
        save_train_state(state_file, state, trainer.plan)
    reply = {**base, "skipped": 0, "epsilon": metrics["epsilon"], "seconds": metrics["seconds"],
             "steps": metrics["steps"]}
    if not side.own_data:  # an exact function of the records, unnoised: a simulation's diagnostic only
        reply["train-loss"] = metrics["train_loss"]
    if "clip" in metrics:  # adaptive clipping: the estimate, a function of the noised counts only
        reply["clip"] = metrics["clip"]
    arrays = model_to_record(model)
    if state_file is not None:
        keep_reply(state_file, request, arrays, reply, summed=into_sum)
        if side.own_data:  # the one model it may evaluate afterwards (evaluation_refused)
            write_json(evaluation_file(state_file), {"round": side.server_round,
                                                     "model": model_digest(content["arrays"]), "evaluated": False})
    return released_answer(arrays, MetricRecord(reply), side)


def released_answer(arrays: ArrayRecord, metrics: MetricRecord, side: ClientSide) -> RecordDict:
    answer = RecordDict({"arrays": arrays, "metrics": metrics})
    if side.skipped_files:  # the owner's choice (skip-bad-files): the server's summary names them
        answer["skipped-files"] = ConfigRecord({"count": len(side.skipped_files),
                                                "first": side.skipped_files[:SKIPPED_NAMED]})
    return answer


# What each kind of message is answered with (the ClientApp and the data service both use this).
HANDLERS = {"train": train_reply, "evaluate": evaluate_reply}
