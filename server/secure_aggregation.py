"""Rounds under secure aggregation (run config `secure-aggregation = true`): the server
coordinates SecAgg+'s five stages (fedsd.secagg) over Flower's Message API and learns only the
sum of the clients' updates.

Each round: every connected node is the cohort; stage messages (task.secure_sum.MESSAGE_TYPES)
go to the nodes still in, each through its ClientApp to its owner's data service, which answers.
A node that does not answer a stage, or answers with anything but what the stage carries, is
dropped. Below the threshold at any stage the round is abandoned and logged, nothing is
unmasked, and the global model stays as it was. Otherwise the sum (uint64) becomes the mean
update of the survivors (task.secure_sum.apply_sum). Every round's protocol record (who was in at
each stage, bytes each way, seconds) goes to <out>/secure-aggregation.json, and its sum to
<out>/secagg-sum-<round>.npy.
"""
from __future__ import annotations

import json
import time
from types import SimpleNamespace
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

from fedsd.errors import ConfigError
from fedsd.secagg import RoundAbandoned, SecAggServer
from task import secure_sum
from task.secure_sum import BadMessage, read_map, write_map

from .strategy import client_report


def _size(content: RecordDict) -> int:
    return recorddict_to_proto(content).ByteSize()


class Exchange:
    """One round's messages: sends a stage to some nodes, keeps the good replies, counts bytes
    and seconds per stage."""

    def __init__(self, grid: Grid, server_round: int, timeout: float, nodes: list[int]):
        self.grid, self.server_round, self.timeout = grid, server_round, timeout
        self.stages: dict[str, dict] = {}
        self.nodes: dict[int, int] = {}  # the protocol's client id → the Flower node id
        for node in sorted(nodes):
            self.nodes.setdefault(secure_sum.secagg_id(node), node)  # (two nodes on one id: the first only)
        self.ids = {node: client for client, node in self.nodes.items()}

    def ask(self, stage: str, contents: dict[int, RecordDict]) -> dict[int, RecordDict]:
        started = time.perf_counter()
        kind = secure_sum.MESSAGE_TYPES[stage]
        messages = [Message(content=content, dst_node_id=self.nodes[client], message_type=kind,
                            group_id=str(self.server_round)) for client, content in contents.items()]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        good, failed = {}, {}
        for reply in replies:
            node = self.ids.get(reply.metadata.src_node_id, -1)
            if reply.has_error():
                failed[node] = reply.error.reason[:300]
            elif node in contents and secure_sum.RECORD in reply.content:
                good[node] = reply.content
            else:
                failed[node] = "a reply without the stage's record"
        for node in set(contents) - set(good) - set(failed):
            failed[node] = "no reply"
        self.stages[stage] = dict(asked=sorted(contents), answered=sorted(good), failed={str(k): v for k, v in
                                                                                        failed.items()},
                                  bytes_sent=sum(_size(c) for c in contents.values()),
                                  bytes_received=sum(_size(c) for c in good.values()),
                                  seconds=time.perf_counter() - started)
        for node, why in failed.items():
            log(WARNING, "secure aggregation round %d, %s: client %d dropped: %s", self.server_round, stage, node, why)
        return good


def _stage_record(base: dict, **fields) -> RecordDict:
    return RecordDict({secure_sum.RECORD: ConfigRecord({**base, **fields})})


def _parsed(replies: dict[int, RecordDict], parse) -> dict:
    """Each reply parsed; one that does not parse is dropped like a node that did not answer."""
    out = {}
    for node, content in replies.items():
        try:
            out[node] = parse(content[secure_sum.RECORD])
        except (BadMessage, AttributeError, KeyError, TypeError, ValueError) as e:
            log(WARNING, "secure aggregation: node %d's reply dropped: %s", node, e)
    return out


def _keys(record) -> dict:
    c, s = record["c"], record["s"]
    if not (isinstance(c, bytes) and isinstance(s, bytes) and len(c) == len(s) == 32):
        raise BadMessage("public keys are 32 bytes each")
    return {"c": c, "s": s}


def _masked(length: int):
    def parse(record) -> np.ndarray:
        vector = record["masked"].numpy()
        if vector.dtype != np.uint64 or vector.shape != (length,):
            raise BadMessage(f"a masked input of {vector.dtype} {vector.shape}, not uint64 ({length},)")
        return vector
    return parse


def _unmask_answer(record) -> dict:
    answer = {"b": read_map(record, "b"), "s": read_map(record, "s")}
    if any(len(share) != 32 for shares in answer.values() for share in shares.values()):
        raise BadMessage("a share of 32 bytes was expected")
    return answer


def protocol(exchange: Exchange, server: SecAggServer, base: dict, train: RecordDict) -> tuple[np.ndarray, list]:
    """The five stages; the sum and the survivors' replies (RoundAbandoned below the threshold)."""
    ask = exchange.ask
    keys = _parsed(ask("advertise", {n: _stage_record(base, **server.setup(n)) for n in server.cohort}), _keys)
    server.collect_keys(keys)
    requests = {}
    for n in keys:
        record = ConfigRecord(dict(base))
        theirs = server.keys_for(n)
        write_map(record, "keys-c", {j: k["c"] for j, k in theirs.items()})
        write_map(record, "keys-s", {j: k["s"] for j, k in theirs.items()})
        requests[n] = RecordDict({secure_sum.RECORD: record})
    server.collect_shares(_parsed(ask("share", requests), lambda r: read_map(r, "shares")))
    requests = {}
    for n in server.holders:
        record = ConfigRecord(dict(base))
        write_map(record, "shares", server.shares_for(n))
        requests[n] = RecordDict({"arrays": train["arrays"], "config": train["config"], secure_sum.RECORD: record})
    replies = ask("masked", requests)
    server.collect_masked(_parsed(replies, _masked(server.length)))
    tags = _parsed(ask("confirm", {n: _stage_record(base, **server.unmask_request(n)) for n in server.masked}),
                   lambda r: read_map(r, "tags"))
    routed = server.route_confirmations(tags)
    requests = {}
    for n in tags:
        record = ConfigRecord(dict(base))
        write_map(record, "confirmations", routed.get(n, {}))
        requests[n] = RecordDict({secure_sum.RECORD: record})
    answers = _parsed(ask("unmask", requests), _unmask_answer)
    total = server.finish(answers)
    return total, [replies[n] for n in sorted(server.masked)]


class SecureRounds:
    """The run's rounds under secure aggregation, with the ServerApp's round book and strategy's
    records (who trained, each client's ε) kept as a plain run keeps them."""

    def __init__(self, grid: Grid, side, launch):
        if launch.fed.noise != "local":
            raise ConfigError("noise=distributed: not yet in a deployment (its clients' shares of the noise come "
                              "with fedsd.distributed in the owners' services); fedsd simulate runs it in process")
        self.grid, self.side, self.launch = grid, side, launch
        self.out = Path(launch.out) if launch.out is not None else None
        self.records: list[dict] = []

    def run(self, arrays: ArrayRecord) -> ArrayRecord:
        fed = self.launch.fed
        for launch_round in range(1, fed.rounds - self.launch.round + 1):
            arrays = self.one_round(self.launch.round + launch_round, arrays)
            self.side.book.evaluate_global(launch_round, arrays)
        return arrays

    def one_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        fed, experiment = self.launch.fed, self.launch.experiment_id
        started = time.perf_counter()
        exchange = Exchange(self.grid, server_round, fed.round_timeout, list(self.grid.get_node_ids()))
        cohort = sorted(exchange.nodes)
        base = {"experiment-id": experiment, "server-round": server_round}
        rid = secure_sum.round_id(self.grid.run.run_id, experiment, server_round)
        server = SecAggServer(rid, cohort, secure_sum.vector_length(arrays))
        train = RecordDict({"arrays": arrays, "config": ConfigRecord({**self.side.strategy.settings, **base})})
        record = dict(round=server_round, cohort=cohort, threshold=server.threshold)
        try:
            total, replies = protocol(exchange, server, base, train)
            arrays = secure_sum.apply_sum(arrays, total, len(server.masked))
            self._reports(server_round, replies)
            record.update(survivors=sorted(server.masked), abandoned=None)
            if self.out is not None:
                np.save(self.out / f"secagg-sum-{server_round}.npy", total)
        except RoundAbandoned as e:
            log(WARNING, "secure aggregation round %d abandoned: %s", server_round, e)
            record.update(survivors=[], abandoned=str(e))
        record.update(stages=exchange.stages, seconds=time.perf_counter() - started,
                      bytes_sent=sum(s["bytes_sent"] for s in exchange.stages.values()),
                      bytes_received=sum(s["bytes_received"] for s in exchange.stages.values()))
        log(INFO, "secure aggregation round %d: %d of %d clients summed, %.1f s, %d bytes sent, %d received",
            server_round, len(record["survivors"]), len(cohort), record["seconds"], record["bytes_sent"],
            record["bytes_received"])
        self.records.append(record)
        if self.out is not None:
            (self.out / "secure-aggregation.json").write_text(json.dumps(self.records, indent=1))
        return arrays

    def _reports(self, server_round: int, replies: list[RecordDict]) -> None:
        strategy = self.side.strategy
        for content in replies:
            report = client_report(SimpleNamespace(content=content))
            pid = int(report.get("partition-id", -1))
            strategy.round_clients.setdefault(server_round, {})[pid] = report
            if "epsilon" in report:
                strategy.client_epsilon[pid] = float(report["epsilon"])
