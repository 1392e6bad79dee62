"""Flower strategies for fedsd: FedAvg / FedAdam / FedProx, optionally wrapped in Flower's
server-side DP, inside a thin recorder that keeps each client's privacy report per round and
sets aside replies of clients that did not train (budget exhausted)."""
from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (DifferentialPrivacyServerSideFixedClipping, FedAdam, FedAvg, FedProx,
                                     Strategy)

from fedsd.settings.federation import FedConfig
from fedsd.methods import MODEL_GROUPS
from fedsd.errors import TrainingDiverged
from fedsd.training.summary import last_line
from fedsd.app.records import SPENT_EPSILON, with_frozen


def base_strategy(fed: FedConfig, federated_evaluation: bool = False) -> Strategy:
    """The aggregation rule, weighted by num-examples. Every client that trained evaluates too
    with federated_evaluation; otherwise only the server evaluates, on its public test split."""
    sampled = sampled_clients(fed)
    common = dict(fraction_train=fed.fraction_train, fraction_evaluate=1.0 if federated_evaluation else 0.0,
                  min_train_nodes=sampled, min_evaluate_nodes=0, min_available_nodes=fed.num_clients,
                  train_metrics_aggr_fn=train_metrics, evaluate_metrics_aggr_fn=evaluation_metrics)
    if fed.strategy == "fedadam":
        strategy = FedAdam(**common, eta=fed.server_lr)
    elif fed.strategy == "fedprox":
        strategy = FedProx(**common, proximal_mu=fed.proximal_mu)
    else:
        strategy = FedAvg(**common)
    if fed.server_dp_noise > 0:
        # User-level DP on top of the clients' sample-level DP: a separate guarantee (README).
        strategy = DifferentialPrivacyServerSideFixedClipping(strategy, fed.server_dp_noise, fed.server_dp_clip,
                                                               num_sampled_clients=sampled)
    return strategy


def _metrics(records: list[RecordDict]) -> list[MetricRecord]:
    return [next(iter(r.metric_records.values())) for r in records]


# What train_metrics reads from each trained reply. A reply also says more (a replayed round, the
# owner's limits, σ and q), which differs from client to client: it is in the round's record.
AGGREGATED_METRICS = ("num-examples", "steps", "train-loss", "epsilon")


def train_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """What a round's training replies mean together (Flower's default would average every key,
    partition ids and σ included): the sample-weighted train loss, the largest ε a client has
    spent, and the clients, samples and steps of the round."""
    metrics = _metrics(records)
    weights = [float(m[weight_key]) for m in metrics]
    aggregated = {"clients": len(metrics), "num-examples": sum(weights),
                  "steps": sum(float(m.get("steps", 0)) for m in metrics),
                  "max-epsilon": max(float(m.get("epsilon", 0.0)) for m in metrics)}
    # A client with its own data reports no training loss (fedsd/app/client/handler.py): the mean is over those that do.
    losses = [(w, float(m["train-loss"])) for w, m in zip(weights, metrics) if "train-loss" in m]
    if losses:
        aggregated["train-loss"] = sum(w * loss for w, loss in losses) / max(sum(w for w, _ in losses), 1.0)
    return MetricRecord(aggregated)


def evaluation_metrics(records: list[RecordDict], weight_key: str) -> MetricRecord:
    """The clients' evaluations of the global model on their own test splits, weighted by how
    many samples each evaluated; a client without a test split (count 0) adds nothing."""
    metrics = [m for m in _metrics(records) if float(m[weight_key]) > 0]
    total = sum(float(m[weight_key]) for m in metrics)
    if not total:
        return MetricRecord({"clients": 0, "num-examples": 0.0})
    return MetricRecord({
        "clients": len(metrics), "num-examples": total,
        **{key: sum(float(m[weight_key]) * float(m[key]) for m in metrics) / total
           for key in ("test-accuracy", "test-loss")}})


def sampled_clients(fed: FedConfig) -> int:
    return max(1, int(fed.num_clients * fed.fraction_train))


# How long a launch's first round waits for the whole federation before it goes on with the
# nodes there (at least min_nodes): a resumed server's SuperNodes reconnect at their own pace, but
# one whose machine is down would otherwise hold the run forever (Flower's sample_nodes waits
# without a limit).
LAUNCH_WAIT_SECONDS = 120.0


def nodes_connected(grid: Grid, count: int, timeout: float) -> bool:
    """Whether `count` nodes are connected within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < count:
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return True


def min_nodes(fed: FedConfig) -> int:
    """Connected nodes a round after the first needs: --min-nodes, or by default half the
    sampled clients (at least 1), so that losing a node does not stop the federation."""
    return fed.min_nodes or max(1, sampled_clients(fed) // 2)


def reply_problem(arrays: ArrayRecord, shapes: dict[str, tuple]) -> str | None:
    """Why a reply's arrays do not fit the model (`shapes`: parameter name → shape), or None."""
    names = set()
    for key, array in arrays.items():
        group, _, name = key.partition("/")
        if group not in MODEL_GROUPS or name not in shapes:
            return f"unknown array {key!r}"
        if tuple(array.shape) != shapes[name]:
            return f"{key} has shape {tuple(array.shape)}, the model's is {shapes[name]}"
        if not np.isfinite(array.numpy()).all():
            return f"{key} holds NaN or Inf"
        if group == "student":
            names.add(name)
    missing = set(shapes) - names
    return f"student arrays missing: {sorted(missing)}" if missing else None


class RecordingStrategy(Strategy):
    """Delegates to `inner`; records every reply's metrics, keeps a per-client ε table, notes
    the clients that missed a round (node failed or timed out), sets aside replies whose arrays
    do not fit the model (wrong shapes, NaN or Inf), and passes on only the replies of clients
    that trained.

    Rounds are numbered globally: a run resumed after round r starts Flower's loop at 1 with
    `round_offset = r`. A launch's first round waits for every client to connect, for at most
    LAUNCH_WAIT_SECONDS; later rounds, and a first round whose wait ran out, go on with whoever is
    there, as long as `min_nodes` are (a node lost mid-run, or down when the server is resumed,
    does not stall it).

    `settings` (the run's flat settings) go into every train and evaluate message's config,
    beside what `start` was given: Flower logs that config in full at the start, and the
    run's sixty settings twice made the log's first screen unreadable."""

    RECORDED = ("client_epsilon", "round_clients", "train_seconds", "missed", "node_partition", "evaluations")

    def __init__(self, inner: Strategy, fed: FedConfig, shapes: dict[str, tuple] | None = None,
                 round_offset: int = 0, settings: dict | None = None):
        self.inner = inner
        self.settings = dict(settings or {})
        self.shapes = shapes
        self.num_clients, self.sampled, self.min_nodes = fed.num_clients, sampled_clients(fed), min_nodes(fed)
        self.fraction_train = fed.fraction_train
        self.own_data = fed.client_data == "own"
        self.round_offset = round_offset
        self.client_epsilon: dict[int, float] = {}
        self.round_clients: dict[int, dict] = {}  # round → {partition id: its metrics}
        self.train_seconds: dict[int, float] = {}
        self.missed: dict[int, list] = {}  # round → [{client, node_id, reason}]
        self.node_partition: dict[int, int] = {}  # Flower node id → partition id, as replies tell
        self.evaluations: dict[int, dict] = {}  # round → the clients' federated evaluation
        self._round_started = 0.0
        self._sent: list[Message] = []  # this round's, as sent
        # The initial model's frozen blocks (fedsd.training.loop.frozen_part), put back after each
        # aggregation (fedsd.app.records.with_frozen); set by the ServerApp, empty when none is frozen.
        self.frozen: dict = {}

    # What changes from round to round in the strategies Flower provides (the FedOpt family's
    # moments m_t, v_t: names to numpy arrays).
    INNER_STATE = ("m_t", "v_t")

    def state_dict(self) -> dict:
        """What a resumed run needs to go on as this one would have: the records, the wrapped
        strategies' moments (as tensors: a checkpoint loads with weights_only=True) and the
        state of Python's `random`, with which Flower samples the nodes of a round."""
        state = {"recorded": {name: getattr(self, name) for name in self.RECORDED},
                 "python_random": random.getstate()}
        for depth, s in enumerate(inner_strategies(self.inner)):
            for name in self.INNER_STATE:
                value = getattr(s, name, None)
                if value is not None:
                    state[f"inner.{depth}.{name}"] = {k: torch.from_numpy(np.asarray(v)) for k, v in value.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        for name in self.RECORDED:
            setattr(self, name, state["recorded"][name])
        random.setstate(state["python_random"])
        for depth, s in enumerate(inner_strategies(self.inner)):
            for name in self.INNER_STATE:
                if f"inner.{depth}.{name}" in state:
                    setattr(s, name, {k: v.numpy() for k, v in state[f"inner.{depth}.{name}"].items()})

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._round_started = time.perf_counter()
        base = list(inner_strategies(self.inner))[-1]
        if server_round == 1 and nodes_connected(grid, self.num_clients, LAUNCH_WAIT_SECONDS):
            # a launch (fresh or resumed) trains its first round with the whole federation
            base.min_available_nodes, base.min_train_nodes = self.num_clients, self.sampled
        else:
            if server_round == 1:
                log(WARNING, "round %d: %d of the %d clients' SuperNodes connected after %.0f s; going on with "
                    "those (at least %d)", server_round + self.round_offset, len(list(grid.get_node_ids())),
                    self.num_clients, LAUNCH_WAIT_SECONDS, self.min_nodes)
            base.min_available_nodes, base.min_train_nodes = self.min_nodes, min(self.sampled, self.min_nodes)
        config = ConfigRecord({**self.settings, **dict(config)})
        messages = list(self.inner.configure_train(server_round + self.round_offset, arrays, config, grid))
        for message in messages:
            self._tell_what_it_spent(message)
        self._sent = messages  # the Grid sets each one's message id in place when it pushes it
        return messages

    def _tell_what_it_spent(self, message: Message) -> None:
        """Add to a train request the ε its client reported spending so far (a node whose partition
        the server knows from earlier replies): a client whose own state holds less has lost it and
        refuses (fedsd/app/client/handler.py). No trust in the server: a claim too high only makes a client
        refuse, as not asking it would. Each client hears only its own ε, and the messages of a
        round share one RecordDict (Flower's _construct_messages), so the request gets its own."""
        pid = self.node_partition.get(message.metadata.dst_node_id)
        if pid is None or not self.client_epsilon.get(pid):
            return
        content = RecordDict(dict(message.content.items()))
        name, config = next(iter(content.config_records.items()))
        content[name] = ConfigRecord({**config, SPENT_EPSILON: float(self.client_epsilon[pid])})
        message.content = content

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Sort the round's replies, note who missed it, stop the run where no later round can
        do better, and aggregate the replies of the clients that trained."""
        server_round += self.round_offset
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}
        round_ = SortedReplies()
        for reply in replies:
            self._sort(server_round, reply, sent, round_)
        self._note_missing(server_round, set(sent.values()), round_)
        self._stop_if_no_round_can_train(server_round, len(sent), round_)
        self.round_clients[server_round], self.missed[server_round] = round_.reports, round_.missed
        # In partition order, not arrival order: a float sum's bits depend on its order, and the
        # same run gives the same weights only if its replies are summed the same way.
        trained = same_metric_keys(sorted(round_.trained, key=partition_order))
        result = self.inner.aggregate_train(server_round, trained) if trained else (None, None)
        if result[0] is not None:
            result = (with_frozen(result[0], self.frozen), result[1])
        self.train_seconds[server_round] = time.perf_counter() - self._round_started
        return result

    def _sort(self, server_round: int, reply: Message, sent: dict, round_: "SortedReplies") -> None:
        """One reply into its case: a node that failed, a refusal, a divergence (the run stops), a
        skip (its budget is spent), arrays that do not fit the model (rejected), or trained. Every
        answer from a client updates what the server knows it has spent."""
        # An error reply made by the SuperLink (node gone) names the node only by the message it answers.
        asked_by = reply.metadata.reply_to_message_id  # "" only in a reply to a message never pushed
        node = sent.get(asked_by, reply.metadata.src_node_id) if asked_by else reply.metadata.src_node_id
        if reply.has_error() and node in round_.answered:
            return  # the SuperLink may answer a gone node's message twice: it missed the round once
        round_.answered.add(node)
        if reply.has_error():
            log(WARNING, "round %d: node %d failed: %s", server_round, node, reply.error.reason)
            round_.missed.append(dict(client=self.node_partition.get(node), node_id=node, reason=reply.error.reason))
            if CLIENT_CODE_FAILED in reply.error.reason:
                round_.failed.append(reply.error.reason)
            return
        metrics = next(iter(reply.content.metric_records.values()))
        pid = int(metrics["partition-id"])
        self.node_partition[node] = pid
        report = round_.reports[pid] = client_report(reply)
        self._record_epsilon(server_round, pid, float(metrics["epsilon"]), bool(int(metrics.get("refused", 0))), report)
        if int(metrics.get("refused", 0)):  # the client's owner's limits, with the client's reason
            report["refused"] = client_reason(reply, "refusal")
            log(WARNING, "round %d: client %d refused: %s", server_round, pid, report["refused"])
        elif int(metrics.get("diverged", 0)):  # training on at chance level helps nobody: stop, saying why
            raise TrainingDiverged(f"round {server_round}, client {pid}: {client_reason(reply, 'divergence')}; "
                                   f"the run stopped")
        elif int(metrics.get("skipped", 0)):
            log(WARNING, "round %d: client %d skipped: its privacy budget is spent (ε = %.3f)",
                server_round, pid, float(metrics["epsilon"]))
        elif (problem := self._reply_problem(reply)) is not None:
            log(WARNING, "round %d: reply of client %d rejected: %s", server_round, pid, problem)
            report["rejected"] = problem
        else:
            round_.trained.append(reply)

    def _record_epsilon(self, server_round: int, pid: int, epsilon: float, refusal: bool, report: dict) -> None:
        """What client `pid` has spent at least: a refusal spends nothing, and an accountant started
        again leaves out what was spent before (the server keeps the larger ε and says so)."""
        before = self.client_epsilon.get(pid, 0.0)
        if not refusal and epsilon < before - 1e-9:
            # Its accountant started again (its state was lost, and this server had not yet told
            # it what it had spent: a node under a new node id). Only the client can account;
            # the server says so, and tells it from its next round on (it then refuses).
            log(WARNING, "round %d: client %d reports ε = %.3f, below the %.3f it reported before: it has "
                "lost its privacy state and its accountant started again", server_round, pid, epsilon, before)
            report["epsilon-fell-from"] = before
        self.client_epsilon[pid] = max(epsilon, before)

    def _reply_problem(self, reply: Message) -> str | None:
        if self.shapes is None:
            return None
        arrays = list(reply.content.array_records.values())
        return reply_problem(arrays[0], self.shapes) if len(arrays) == 1 else "no single ArrayRecord"

    def _note_missing(self, server_round: int, asked: set, round_: "SortedReplies") -> None:
        """The nodes asked that did not answer, and, when every connected client was asked, the
        clients that were not connected."""
        for node in sorted(asked - round_.answered):
            log(WARNING, "round %d: node %d did not reply in time", server_round, node)
            round_.missed.append(dict(client=self.node_partition.get(node), node_id=node,
                                      reason="no reply before the timeout"))
        if self.fraction_train < 1 or any(m["client"] is None for m in round_.missed):
            return
        seen = set(round_.reports) | {m["client"] for m in round_.missed}
        known = {pid: node for node, pid in self.node_partition.items()}
        round_.missed += [dict(client=pid, node_id=known.get(pid), reason="not connected")
                          for pid in range(self.num_clients) if pid not in seen]

    def _stop_if_no_round_can_train(self, server_round: int, asked: int, round_: "SortedReplies") -> None:
        """Stop the run when no later round can do better: in round 1 every client refused (its
        owner's limits) or failed in its own code (bad data), or in any round every client's own
        code raised. A later round asks the same of the same clients, and going on would release
        the initial model as the run's result."""
        refused = {pid: r["refused"] for pid, r in round_.reports.items() if "refused" in r}
        if server_round == 1 and asked and not round_.trained and len(refused) + len(round_.failed) == asked:
            self.round_clients[server_round], self.missed[server_round] = round_.reports, round_.missed
            why = [f"client {pid} refused: {reason}" for pid, reason in sorted(refused.items())]
            why += [f"client {m['client'] if m['client'] is not None else '?'} failed: {last_line(m['reason'])}"
                    for m in round_.missed if CLIENT_CODE_FAILED in m["reason"]]
            raise NoClientCanTrain("round 1: no client can train, so the run stops: " + "; ".join(why))
        if round_.failed and len(round_.failed) == asked:
            raise ClientsFailed(f"round {server_round}: every client failed; the first said: "
                                f"{last_line(round_.failed[0])}")

    def configure_evaluate(self, server_round, arrays, config, grid):
        if self.own_data and self._sent:
            # A client with its own data evaluates only the model it last received for training
            # (fedsd/app/client/handler.py): the round's federated evaluation is of the model the round started from.
            arrays = self._sent[0].content["arrays"]
        config = ConfigRecord({**self.settings, **dict(config)})
        return self.inner.configure_evaluate(server_round + self.round_offset, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        replies = list(replies)
        server_round += self.round_offset
        aggregated = self.inner.aggregate_evaluate(server_round, replies)
        if aggregated is not None and int(aggregated.get("clients", 0)):  # else no client evaluated
            per_client = {}
            for reply in replies:
                if not reply.has_error():
                    m = next(iter(reply.content.metric_records.values()))
                    per_client[str(int(m["partition-id"]))] = dict(
                        num_examples=int(m["num-examples"]),
                        test_accuracy=float(m["test-accuracy"]) if m["num-examples"] else None)
            self.evaluations[server_round] = dict(
                test_accuracy=aggregated.get("test-accuracy"), test_loss=aggregated.get("test-loss"),
                num_examples=int(aggregated["num-examples"]), clients=per_client)
        return aggregated


@dataclass
class SortedReplies:
    """A round's replies as aggregate_train sorts them."""
    trained: list = field(default_factory=list)  # the replies that are aggregated
    reports: dict = field(default_factory=dict)  # partition id → what its reply said
    missed: list = field(default_factory=list)  # {client, node_id, reason}
    answered: set = field(default_factory=set)  # node ids
    failed: list = field(default_factory=list)  # the reasons of clients whose own code raised


def client_report(reply: Message) -> dict:
    """What a client's reply says, as the round's record keeps it: its metrics, and the files
    its owner left out and the code that answered, where it says so."""
    report = dict(next(iter(reply.content.metric_records.values())))
    records = reply.content.config_records
    if "skipped-files" in records:  # the owner's choice: named in the summary
        report["skipped-files"] = dict(count=int(records["skipped-files"]["count"]),
                                       first=list(records["skipped-files"]["first"]))
    if "service" in records:  # the owner's data service: what code answered
        report["service"] = dict(version=str(records["service"].get("version")),
                                 code=str(records["service"].get("code")))
    return report


def partition_order(reply: Message) -> tuple[int, int]:
    """A trained reply's place in the sum: its partition id (as the client said), then its node."""
    return int(_metrics([reply.content])[0]["partition-id"]), reply.metadata.src_node_id


def same_metric_keys(trained: list[Message]) -> list[Message]:
    """The replies with only the metrics every one of them has (Flower aggregates only replies
    whose metrics have the same keys)."""
    common = [k for k in AGGREGATED_METRICS if all(k in _metrics([r.content])[0] for r in trained)]
    for reply in trained:
        name, metrics = next(iter(reply.content.metric_records.items()))
        reply.content[name] = MetricRecord({k: metrics[k] for k in common})
    return trained


def client_reason(reply: Message, record: str) -> str:
    """The reason a client gave in its reply's ConfigRecord `record` (refusal, divergence)."""
    records = reply.content.config_records
    return str(records[record]["reason"]) if record in records else "no reason given"


# Flower's error reason for an exception raised by the ClientApp's own code, not a lost node.
CLIENT_CODE_FAILED = "ClientAppException"


class ClientsFailed(ValueError):
    """Every client of a round failed in its own code: the run stops with the first reason."""


class NoClientCanTrain(ClientsFailed):
    """In a run's first round every client refused or failed: the run stops with each reason."""


def inner_strategies(strategy):
    """The strategy and those it wraps (Flower's DP wrappers keep theirs in `.strategy`)."""
    while strategy is not None:
        yield strategy
        strategy = getattr(strategy, "strategy", None)


def round_log(record: dict, rounds: int, accuracy: float, max_epsilon: float, names: dict | None = None) -> None:
    """One line a round: its accuracy, ε, time, and which clients trained, refused or missed it
    (each by its name in `names`, where it has one: under secure aggregation, its roster name or
    node id, not its protocol id)."""
    who = f"trained {_clients(record['trained'], names)}"
    if record["refused"]:
        who += f", refused {_clients(record['refused'], names)}"
    if record["missed"]:
        who += f", missed {_clients((m['client'] for m in record['missed']), names)}"
    log(INFO, "fedsd round %d/%d: test accuracy %.4f, max client ε %.3f, %.1f s; %s",
        record["round"], rounds, accuracy, max_epsilon, record["seconds"], who)


def _clients(ids, names: dict | None = None) -> str:
    shown = [_client_name(i, names or {}) for i in ids]
    return ", ".join(shown) if shown else "none"


def _client_name(client, names: dict) -> str:
    """A client's name where `names` (keyed by its integer id) has one, else its id as given."""
    if client is None:
        return "?"
    text = str(client)
    return names.get(int(text), text) if text.lstrip("-").isdigit() else text
