"""Rounds under secure aggregation (run config `secure-aggregation = true`): the server
coordinates SecAgg+'s stages (fedsd.secure.secagg) over Flower's Message API and learns only the
sum of the clients' updates.

Each round: every connected node not yet known is asked who it is (the identify stage: its protocol
id, its identity's key; with the server's copy of the roster, run config `secagg-roster`, a
stranger is left out and named; what a node told is kept for the run and asked again only of a
node that missed the previous round's advertise stage); the identified nodes are the cohort; stage messages
(fedsd.app.secure_sum.MESSAGE_TYPES) go to the nodes still in, each through its ClientApp to its
owner's data service, which answers. A node that does not answer a stage, or answers with
anything but what the stage carries, is dropped; a refusal that names a culprit is kept. Below
the threshold at any stage the round is abandoned and logged, nothing is unmasked, and the global
model stays as it was. Under noise=distributed the masked-input stage carries the round's noise
plan (`distributed_plan`), and the decoded sum is the gradient of the server's optimizer step
(`SecureRounds._step`) rather than a mean update. A decoded sum above what honest clients send (fedsd.secure.sum_bound) is refused
the same way. Otherwise the sum (uint64) becomes the mean update of the survivors
(fedsd.app.secure_sum.apply_sum). Every round's protocol record (who was in at each stage, bytes each
way, seconds, culprits, the mean update's norm and its bound) goes to
<out>/secure-aggregation.json, and its sum to <out>/secagg-sum-<round>.npy.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

from fedsd.secure import client_level, distributed_noise, sum_bound
from fedsd.errors import ConfigError
from fedsd.secure.identity import Roster, protocol_id, public_line, read_roster, verify
from fedsd.secure.secagg import SEED_BYTES, SELF_SEED_BYTES, RoundAbandoned, SecAggServer, identify_message, minimum_threshold
from fedsd.app import secure_sum
from fedsd.app.records import model_to_record, record_to_model, with_frozen
from fedsd.app.secure_sum import KEY_FIELDS, BadMessage, read_map, write_map
from fedsd.app.server.strategy import NoClientCanTrain



class SumOutsideBound(RoundAbandoned):
    """The decoded sum is above what the round's clients could send honestly: one of those summed
    sent an input outside the bound (or a mask other than its signed seed), and nothing short of
    a proof on each input says which (docs/algorithms.md, "Spoilers named")."""


def _size(content: RecordDict) -> int:
    return recorddict_to_proto(content).ByteSize()


CULPRIT = re.compile(r"\(culprit: (\d+)\)")


class Exchange:
    """One round's messages: sends a stage to some nodes, keeps the good replies, counts bytes
    and seconds per stage. Clients are named by their protocol id, which each node's service
    tells at the identify stage (its roster identity's, or its node id without a roster)."""

    def __init__(self, grid: Grid, server_round: int, timeout: float, nodes: list[int]):
        self.grid, self.server_round, self.timeout = grid, server_round, timeout
        self.stages: dict[str, dict] = {}
        self.nodes: dict[int, int] = {secure_sum.secagg_id(node): node for node in sorted(nodes)}
        self.ids = {node: client for client, node in self.nodes.items()}
        self.named: dict[str, str] = {}  # a culprit (protocol id) → what its neighbours said of it

    def identified(self, ids: dict[int, int]) -> None:
        """The protocol ids the nodes told (protocol id → node); a node that told an id another
        node told already is left out (an owner takes part once a round)."""
        self.nodes = {}
        for client, node in sorted(ids.items(), key=lambda kv: kv[1]):
            self.nodes.setdefault(client, node)
        self.ids = {node: client for client, node in self.nodes.items()}

    def ask(self, stage: str, contents: dict[int, RecordDict]) -> dict[int, RecordDict]:
        started, started_at = time.perf_counter(), time.time()
        kind = secure_sum.MESSAGE_TYPES[stage]
        messages = [Message(content=content, dst_node_id=self.nodes[client], message_type=kind,
                            group_id=str(self.server_round)) for client, content in contents.items()]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        good, failed = {}, {}
        for reply in replies:
            client = self.ids.get(reply.metadata.src_node_id, -1)
            if reply.has_error():
                failed[client] = reply.error.reason[:300]
                for culprit in CULPRIT.findall(failed[client]):
                    self.named.setdefault(culprit, failed[client])
            elif client in contents and secure_sum.RECORD in reply.content:
                good[client] = reply.content
            else:
                failed[client] = "a reply without the stage's record"
        for client in set(contents) - set(good) - set(failed):
            failed[client] = "no reply"
        self.stages[stage] = dict(asked=sorted(contents), answered=sorted(good), failed={str(k): v for k, v in
                                                                                        failed.items()},
                                  bytes_sent=sum(_size(c) for c in contents.values()),
                                  bytes_received=sum(_size(c) for c in good.values()),
                                  seconds=time.perf_counter() - started, started_at=started_at,
                                  ended_at=time.time())  # wall clock: fedsd.deployment.stage_links
        for client, why in failed.items():
            log(WARNING, "secure aggregation round %d, %s: client %d dropped: %s", self.server_round, stage, client,
                why)
        return good


def _stage_record(base: dict, **fields) -> RecordDict:
    return RecordDict({secure_sum.RECORD: ConfigRecord({**base, **fields})})


def _with_config(content: RecordDict, config: ConfigRecord) -> RecordDict:
    content["config"] = config
    return content


def _map_record(base: dict, extra: RecordDict | None = None, **maps) -> RecordDict:
    record = ConfigRecord(dict(base))
    for name, values in maps.items():
        write_map(record, name, values)
    content = RecordDict({secure_sum.RECORD: record})
    for key, value in (extra or {}).items():
        content[key] = value
    return content


def _parsed(replies: dict[int, RecordDict], parse) -> dict:
    """Each reply parsed; one that does not parse is dropped like a node that did not answer."""
    out = {}
    for node, content in replies.items():
        try:
            out[node] = parse(content[secure_sum.RECORD])
        except (BadMessage, AttributeError, KeyError, TypeError, ValueError) as e:
            log(WARNING, "secure aggregation: node %d's reply dropped: %s", node, e)
    return out


def _identity(record) -> dict:
    client, public, signature = record["id"], record["v"], record.get("sig", b"")
    if not (isinstance(client, int) and 0 <= client <= secure_sum.MAX_ID and isinstance(public, bytes)
            and len(public) in (0, 32) and isinstance(signature, bytes)):
        raise BadMessage("an id in [0, 2^63), a 32-byte identity key (or none) and its signature were expected")
    return {"id": client, "v": public, "sig": signature, "authenticated": bool(record.get("authenticated", False))}


def _keys(record) -> dict:
    out = {f: record[f] for f in KEY_FIELDS}
    if not all(isinstance(v, bytes) for v in out.values()) or any(len(out[f]) != 32 for f in ("c", "s", "v")):
        raise BadMessage("public keys are 32 bytes each, with a signature")
    return out


def _dealt(record) -> dict:
    dealing, digest = record["dealing"], record["digest"]
    if not isinstance(dealing, bytes) or not isinstance(digest, bytes):
        raise BadMessage("a signature of the dealing and the self-mask seed's digest were expected")
    return {"shares": read_map(record, "shares"), "commits": read_map(record, "commits"), "dealing": dealing,
            "digest": digest}


def _masked(length: int):
    def parse(record) -> np.ndarray:
        vector = record["masked"].numpy()
        if vector.dtype != np.uint64 or vector.shape != (length,):
            raise BadMessage(f"a masked input of {vector.dtype} {vector.shape}, not uint64 ({length},)")
        return vector
    return parse


def _signature(record) -> bytes:
    if not isinstance(record["sig"], bytes):
        raise BadMessage("a signature was expected")
    return record["sig"]


def _unmask_answer(record) -> dict:
    answer = {"b": read_map(record, "b"), "s": read_map(record, "s")}
    if any(len(share) != SELF_SEED_BYTES for share in answer["b"].values()) or any(
            len(share) != SEED_BYTES for share in answer["s"].values()):
        raise BadMessage(f"shares of {SELF_SEED_BYTES} (b) and {SEED_BYTES} bytes (s) were expected")
    return answer


def identify(exchange: Exchange, base: dict, roster: Roster | None, round_id: bytes,
             barred: dict[int, str] | None = None, known: dict[int, dict] | None = None) -> dict[int, dict]:
    """Before stage 0: each node's protocol id and identity. A node that tells an identity key
    without its signature for this round and node (a member telling another owner's) is left out
    and named by its node; with the server's copy of the roster a node whose key is not on it,
    or whose id is not its key's, is left out and named. `known` (node → what it told, checked
    in an earlier round of this run; updated here): those nodes are not asked again, so a round
    after the first has no identify exchange unless a node is new (SecureRounds.forget). Only the
    server relies on this stage: every owner checks its neighbours' signed keys against its own
    roster at share-keys, whatever the server told it of who is who."""
    known = {} if known is None else known
    told = _told(exchange, base, roster, round_id, [c for c, node in exchange.nodes.items() if node not in known])
    fresh = {exchange.nodes[client]: who for client, who in told.items()}
    ids, out = {}, {}
    for node in sorted(exchange.nodes.values(), key=lambda node: (node not in known, node)):  # the known first
        who = known.get(node) or fresh.get(node)
        if who is None:
            continue
        if who["id"] in (barred or {}):  # named with checkable evidence earlier in this run: never again in it
            exchange.named[str(who["id"])] = barred[who["id"]]
            continue
        if who["id"] in ids:
            exchange.named[str(who["id"])] = f"nodes {ids[who['id']]} and {node} told one id"
            continue
        ids[who["id"]], out[who["id"]] = node, who
        known.setdefault(node, who)
    exchange.identified(ids)
    return out


def _told(exchange: Exchange, base: dict, roster: Roster | None, round_id: bytes, asked: list[int]) -> dict:
    """What the `asked` nodes told at identify that passes the checks (placeholder id → what it told)."""
    if not asked:
        return {}
    told = _parsed(exchange.ask("identify", {c: _stage_record(base) for c in asked}), _identity)
    if roster is None and any(who["v"] for who in told.values()):
        # Without the server's copy a keyless node could tell an owner's id first and take its place
        raise ConfigError("secagg-roster: the owners take part under a roster (their nodes told roster identities) "
                          "but this run has no copy of it; give the server the owners' roster file "
                          "(--run-config \"secagg-roster='PATH'\")")
    out = {}
    for client, who in told.items():
        node = exchange.nodes[client]
        if who["v"] and not verify(who["v"], who["sig"], identify_message(round_id, node)):
            exchange.named[f"node {node}"] = "an identity key it did not sign for this round and node"
            log(WARNING, "secure aggregation round %d: left out node %d: %s", exchange.server_round, node,
                exchange.named[f"node {node}"])
            continue
        if roster is not None and (roster.key(who["id"]) != who["v"] or protocol_id(who["v"]) != who["id"]):
            exchange.named[str(who["id"])] = f"node {node}: a key not on the server's roster ({public_line(who['v'])})" \
                if who["v"] else f"node {node}: no roster identity"
            log(WARNING, "secure aggregation round %d: left out %s", exchange.server_round,
                exchange.named[str(who["id"])])
            continue
        out[client] = who
    return out


def protocol(exchange: Exchange, server: SecAggServer, base: dict, train: RecordDict,
             evidence: str = "") -> tuple[np.ndarray, list]:
    """The five stages after identify; the sum and the survivors' replies (RoundAbandoned below
    the threshold, or when the shares do not rebuild one secret)."""
    ask = exchange.ask
    # The round's settings go with stage 0 too: each client signs their digest with its keys
    # (fedsd.secure.secagg, stage 0), and its masked input is refused under any other settings.
    # `evidence`: the run's spoilers so far, with what proves it: each owner checks it and refuses them
    extra = {"evidence": evidence} if evidence else {}
    keys = _parsed(ask("advertise", {n: _with_config(_stage_record(base, **server.setup(n), **extra),
                                                     train["config"]) for n in server.cohort}), _keys)
    server.collect_keys(keys)
    requests = {}
    for n in keys:
        theirs = server.keys_for(n)
        requests[n] = _map_record(base, **{f"keys-{f}": {j: k[f] for j, k in theirs.items()} for f in KEY_FIELDS})
    server.collect_shares(_parsed(ask("share", requests), _dealt))
    requests = {}
    for n in server.holders:
        shares = server.shares_for(n)
        requests[n] = _map_record(base, {"arrays": train["arrays"], "config": train["config"]},
                                  shares=shares["ciphertexts"], commits=shares["commits"])
    replies = ask("masked", requests)
    # A masked input without its metrics record (or one that does not parse) is left out: that
    # client counts as dropped, its masks are removed as a dropout's, the round goes on.
    masked = {n: v for n, v in _parsed(replies, _masked(server.length)).items() if reported(replies[n]) is not None}
    for n in set(replies) - set(masked):
        exchange.stages["masked"]["failed"].setdefault(str(n), "a masked input without a metrics record")
    server.collect_masked(masked)
    signatures = _parsed(ask("confirm", {n: _stage_record(base, **server.unmask_request(n)) for n in server.masked}),
                         _signature)
    routed = server.route_confirmations(signatures)
    answers = _parsed(ask("unmask", {n: _map_record(base, confirmations=routed.get(n, {})) for n in signatures}),
                      _unmask_answer)
    total = server.finish(answers)
    return total, [replies[n] for n in sorted(server.masked)]


REFUSED = "secure aggregation refused: "


def refusals(exchange: Exchange, stage: str = "") -> dict[str, int]:
    """The owners' refusals in a round (of one stage, or all), each distinct reason with the
    number of owners that gave it (what a node's service refused with, as its error reply says)."""
    counts: dict[str, int] = {}
    for name, record in exchange.stages.items():
        if stage and name != stage:
            continue
        for why in record["failed"].values():
            if REFUSED in why:  # Flower wraps a ClientApp's exception as <class …>:<'text'>
                reason = why.split(REFUSED, 1)[1].removesuffix("'>").removesuffix("'")
                counts[reason] = counts.get(reason, 0) + 1
    return counts


def cannot_go_on(server_round: int, record: dict, exchange: Exchange) -> str:
    """Why the run stops after an abandoned round ("" where it goes on): owners refused it at
    stage 0, where the plan and their budgets are tried, and too few were left for the threshold.
    In round 1 whatever they said (the next round asks the same of the same owners, and the run
    would release its initial model); later only for budget refusals, which no later round
    changes, so going on would abandon every round."""
    refused = refusals(exchange, "advertise")
    cohort, threshold = record.get("cohort", []), record.get("threshold", 1)
    if not record.get("abandoned") or not refused or len(cohort) - sum(refused.values()) >= threshold:
        return ""
    if server_round > 1 and not all("budget" in reason for reason in refused):
        return ""
    return (f"round {server_round}: {sum(refused.values())} of {len(cohort)} owners refused the round before anyone "
            f"released, leaving fewer than the threshold of {threshold}, so the run stops: "
            + "; ".join(f"{count} refused: {reason}" for reason, count in refused.items()))


def local_noise_bound(cfg, fed, dim: int) -> float:
    """The L2 norm the mean of the survivors' local-noise updates stays below: the run's public
    bound on one honest update (fedsd.secure.sum_bound.public_local_bound, which every owner scales
    its update down to) plus each update's fixed-point rounding, half a unit a coordinate. No
    client's report enters it: a member cannot loosen it."""
    return sum_bound.public_local_bound(cfg, fed, dim) + math.sqrt(dim) / secure_sum.SCALE


def reported(content: RecordDict) -> dict | None:
    """A masked reply's metrics record as plain numbers, or None where it has none or one that
    does not parse (that client is then left out like one that did not answer)."""
    metrics = content.get("metrics") if "metrics" in content else None
    if not isinstance(metrics, MetricRecord):
        return None
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or isinstance(value, (list, bool)) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            return None
        out[key] = value
    return out


def distributed_plan(cfg, fed, num_classes: int):
    """noise=distributed in a deployment: the run's noise plan (one Skellam-noised DP-SGD step a
    round at the run's q = sample-rate; batch-size is the federation's expected batch, t
    honest-clients) and the server's optimizer. Refused (ConfigError) before any round when the
    run cannot be one."""
    from fedsd.secure.distributed_step import DISTRIBUTED_METHODS, ServerOptimizer, dimension
    from fedsd.models.networks import model_for

    honest = fed.honest_clients or fed.num_clients
    if fed.client_data != "own":  # every owner would refuse it at its first stage: said before round 1
        raise ConfigError(f"client-data={fed.client_data}: noise=distributed in a deployment draws each "
                          f"owner's batch and noise from its own data and its own secret stream; set client-data=own "
                          f"(each SuperNode's owner names its data in its node config)")
    if fed.privacy_unit == "client":
        return client_level_plan(cfg, fed, num_classes, honest)
    if fed.local_epochs != 1:
        raise ConfigError(f"local-epochs={fed.local_epochs}: noise=distributed takes one step a round (the server "
                          f"applies each step); leave it at 1")
    if not 0 < fed.sample_rate <= 1:
        raise ConfigError("sample-rate: noise=distributed in a deployment needs the run's q, batch-size / the "
                          "federation's records (each client draws at it)")
    if cfg.method not in DISTRIBUTED_METHODS:
        raise ConfigError(f"method={cfg.method}: noise=distributed runs {', '.join(DISTRIBUTED_METHODS)}")
    if honest < 1:
        raise ConfigError("honest-clients: noise=distributed in a deployment needs t, the fewest clients whose "
                          "shares the noise counts on")
    net = model_for(cfg, num_classes)
    plan = distributed_noise.calibrated(cfg.epsilon, cfg.delta, cfg.clip, fed.sample_rate, float(cfg.batch_size),
                                        fed.rounds, honest, dimension(net))
    return plan, ServerOptimizer(net, cfg.lr, cfg.momentum)


def client_level_plan(cfg, fed, num_classes: int, honest: int):
    """privacy-unit=client in a deployment (fedsd.secure.client_level): every client every round
    (q = 1), each update clipped to update-clip by its owner, the sum over n applied with learning
    rate 1 (FedAvg of the clipped, noised updates), as `fedsd simulate --privacy-unit client`."""
    from fedsd.models.networks import model_for
    from fedsd.secure import client_level
    from fedsd.secure.distributed_step import ServerOptimizer, dimension

    if cfg.method != "dpsgd":
        raise ConfigError(f"method={cfg.method}: privacy-unit=client trains each client's update without noise and "
                          f"without a teacher (method=dpsgd); self-distillation is record level")
    if not 1 <= honest <= fed.num_clients:
        raise ConfigError(f"honest-clients={fed.honest_clients}: t must be in [1, num-clients={fed.num_clients}]")
    net = model_for(cfg, num_classes)
    adapting = fed.update_clip_quantile > 0  # each client's bit: one coordinate more (client_level.AdaptiveUpdateClip)
    plan = client_level.calibrated(cfg.epsilon, cfg.delta, fed.update_clip, fed.num_clients, fed.rounds, honest,
                                   dimension(net) + adapting)
    optimizer = ServerOptimizer(net, client_level.server_lr(fed), 0.0)
    if adapting:
        client_level.AdaptiveUpdateClip.of(fed, plan)  # σ_b refused before round 1
        optimizer.update_clip = fed.update_clip
    return plan, optimizer


class SecureRounds:
    """The run's rounds under secure aggregation, with the ServerApp's round book and strategy's
    records (who trained, each client's ε) kept as a plain run keeps them."""

    def __init__(self, grid: Grid, side, launch):
        self.grid, self.side, self.launch = grid, side, launch
        self.distributed = launch.fed.noise == "distributed"
        self.adaptive = None  # --update-clip-quantile: the rule that moves S (fedsd.secure.client_level)
        if self.distributed:  # the round's plan, and the server's half of each step (fedsd.secure.distributed_step)
            self.noise, self.optimizer = distributed_plan(side.cfg, launch.fed, side.num_classes)
            if self.optimizer.update_clip is not None:
                self.adaptive = client_level.AdaptiveUpdateClip.of(launch.fed, self.noise)
        self.roster = read_roster(launch.fed.secagg_roster) if launch.fed.secagg_roster else None
        self.out = Path(launch.out) if launch.out is not None else None
        self.records: list[dict] = []
        self.barred: dict[int, str] = {}  # protocol id → the round it spoiled, with checkable evidence
        self.known: dict[int, dict] = {}  # node → what it told at identify, checked (`identify`, `forget`)
        self.evidence: list[dict] = []  # what proves it, sent to every owner at each later advertise
        self.outside: list[tuple[int, frozenset]] = []  # (round, the clients summed) of each sum outside the bound
        self._seat_key = secrets.token_bytes(16)  # the order `_seated` keeps clients in, no member's to choose

    def run(self, arrays: ArrayRecord) -> ArrayRecord:
        fed = self.launch.fed
        if self.distributed:
            self._resume_optimizer()
        for launch_round in range(1, fed.rounds - self.launch.round + 1):
            arrays = with_frozen(self.one_round(self.launch.round + launch_round, arrays), self.side.strategy.frozen)
            self.side.book.evaluate_global(launch_round, arrays)
        return arrays

    def _resume_optimizer(self) -> None:
        """Under noise=distributed the server's optimizer goes on from the checkpoint's state (its
        momentum), so a resumed run steps as an uninterrupted one would; its state goes into
        every round's checkpoint (RoundBook). A checkpoint of an earlier fedsd has none: momentum
        starts again, said in the log."""
        saved = self.launch.optimizer if self.launch.round else None
        if saved is not None:
            self.optimizer.load_state_dict(saved)
        elif self.launch.round and self.side.cfg.momentum:
            log(WARNING, "fedsd: the checkpoint holds no server optimizer state (an earlier fedsd's): momentum "
                "starts again at round %d", self.launch.round + 1)
        self.side.book.server_optimizer = self.optimizer

    def one_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        fed, experiment = self.launch.fed, self.launch.experiment_id
        started = time.perf_counter()
        exchange = Exchange(self.grid, server_round, fed.round_timeout, list(self.grid.get_node_ids()))
        base = {"experiment-id": experiment, "server-round": server_round}
        record = dict(round=server_round)
        try:
            rid = secure_sum.round_id(self.grid.run.run_id, experiment, server_round)
            identities = self._seated(exchange, identify(exchange, base, self.roster, rid, self.barred, self.known),
                                      record)
            cohort = sorted(exchange.nodes)
            plain = sorted(exchange.nodes[c] for c, who in identities.items() if not who["authenticated"])
            n = len(cohort)
            threshold = min(n, max(minimum_threshold(n), fed.secagg_threshold)) if n else 1
            length = self.round_plan().dim if self.distributed else secure_sum.vector_length(arrays)
            server = SecAggServer(rid, cohort, length, threshold=threshold)
            record.update(cohort=cohort, threshold=server.threshold, nodes_without_roster=plain)
            if plain:
                log(WARNING, "secure aggregation round %d: %d nodes take part without a roster: they are protected "
                    "only against a server that follows the protocol", server_round, len(plain))
            plan = distributed_noise.to_settings(self.round_plan(), fed.rounds) if self.distributed else {}
            train = RecordDict({"arrays": arrays, "config": ConfigRecord({**self.side.strategy.settings, **base,
                                                                          **plan})})
            try:
                total, replies = protocol(exchange, server, base, train, json.dumps(self.evidence) if self.evidence
                                          else "")
            finally:
                self._bar(server, record, server_round)
                exchange.named.update({str(k): v for k, v in server.culprits.items()})
            try:
                checked = self._checked(arrays, total, server, server_round)
            except SumOutsideBound:  # one of those summed sent it; who, no one can say: none of them meet again
                self.outside.append((server_round, frozenset(server.masked)))
                record["summed_outside_bound"] = sorted(server.masked)
                raise
            arrays = self._applied(arrays, checked, total, server, record, replies)
            if self.out is not None:
                np.save(self.out / f"secagg-sum-{server_round}.npy", total)
        except RoundAbandoned as e:
            log(WARNING, "secure aggregation round %d abandoned: %s", server_round, e)
            record.update(survivors=[], abandoned=str(e))
            for reason, count in refusals(exchange).items():  # each distinct reason once, with its count
                log(WARNING, "secure aggregation round %d: %d client(s) refused: %s", server_round, count, reason)
        self.forget(exchange)
        record.update(culprits=exchange.named, stages=exchange.stages, seconds=time.perf_counter() - started,
                      bytes_sent=sum(s["bytes_sent"] for s in exchange.stages.values()),
                      bytes_received=sum(s["bytes_received"] for s in exchange.stages.values()))
        for culprit, why in exchange.named.items():
            log(WARNING, "secure aggregation round %d: client %s named: %s", server_round, culprit, why)
        log(INFO, "secure aggregation round %d: %d of %d clients summed, %.1f s, %d bytes sent, %d received",
            server_round, len(record["survivors"]), len(record.get("cohort", [])), record["seconds"],
            record["bytes_sent"], record["bytes_received"])
        self.records.append(record)
        if self.out is not None:
            (self.out / "secure-aggregation.json").write_text(json.dumps(self.records, indent=1))
        stop = cannot_go_on(server_round, record, exchange)
        if stop:
            raise NoClientCanTrain(stop)
        return arrays

    def _seated(self, exchange: Exchange, identities: dict[int, dict], record: dict) -> dict[int, dict]:
        """The clients this round seats: no two summed in one round whose sum fell outside the bound
        (SumOutsideBound) sit in one round again. One of them sent that input, so every later round
        an honest owner pays for beside a spoiler holds a spoiler not in any earlier such round of
        its own: at most one spoiled round per member. Who is kept follows an order drawn from the
        server's secret (`_seat_key`), so a member cannot grind its key into the seat. Those left
        out are in the round's `not_seated`; the run stops, before anyone is charged, when fewer
        than a round needs are left (with every client in that round, at once)."""
        if not self.outside:
            return identities
        kept: list[int] = []
        order = sorted(identities, key=lambda c: hashlib.sha256(self._seat_key + str(c).encode()).digest())
        for client in order:
            met = [r for r, summed in self.outside if client in summed and any(k in summed for k in kept)]
            if met:
                record.setdefault("not_seated", {})[str(client)] = (
                    f"summed in round {met[0]}, whose sum fell outside the bound, with a client this round seats")
            else:
                kept.append(client)
        least = self.round_plan().honest if self.distributed else 2
        if len(kept) < least:
            rounds = ", ".join(str(r) for r, _ in self.outside)
            raise NoClientCanTrain(
                f"round {exchange.server_round}: the sum of round(s) {rounds} fell outside the bound, so one of the "
                f"clients summed in each sent an input outside it; without a proof on each input no one can say "
                f"which, and no two of them sit in one round again, which leaves {len(kept)} client(s) for a round "
                f"that needs {least}: the run stops (the clients summed in each: summed_outside_bound in "
                f"secure-aggregation.json)")
        kept.sort()
        exchange.identified({client: exchange.nodes[client] for client in kept})
        return {client: identities[client] for client in kept}

    def round_plan(self):
        """This round's noise plan: the run's, at clip S' of the update clip S now where S adapts."""
        return client_level.round_plan(self.noise, self.adaptive, self.optimizer.update_clip)

    def forget(self, exchange: Exchange) -> None:
        """A node that did not answer this round's advertise stage, or that its neighbours named, is
        asked who it is again in the next round (its SuperNode may have come back with another
        owner's service behind it)."""
        answered = set(exchange.stages.get("advertise", {}).get("answered", []))
        named = {str(culprit) for culprit in exchange.named}  # named by its neighbours: asked again too
        if "advertise" in exchange.stages:
            for node in [node for node in self.known if exchange.ids.get(node) not in answered
                         or str(exchange.ids.get(node)) in named]:
                del self.known[node]

    def _applied(self, arrays, checked, total, server: SecAggServer, record: dict, replies) -> ArrayRecord:
        """The checked sum applied: under distributed noise the server's step, else the mean
        update; the survivors' reports kept as a plain round keeps them."""
        server_round = record["round"]
        if self.distributed:
            arrays, applied = checked
            record.update(applied)
        else:
            record.update(zip(("mean_update_norm", "honest_bound"), checked))
            arrays = secure_sum.apply_sum(arrays, total, len(server.masked))
        self._reports(server_round, replies, sorted(server.masked))
        record.update(survivors=sorted(server.masked), abandoned=None)
        return arrays

    def _checked(self, arrays, total, server: SecAggServer, server_round: int) -> tuple:
        """The round's sum checked against the bound on an honest one: under distributed noise the
        stepped model and what was applied, else the mean update's norm and its bound
        (RoundAbandoned where it fails)."""
        if self.distributed:
            return self._step(arrays, total, len(server.masked), server, server_round)
        return self._check_sum(total, len(server.masked), server)

    def _bar(self, server: SecAggServer, record: dict, server_round: int) -> None:
        """Each dealer whose t committed shares rebuilt a secret other than the one it signed
        (SecAggServer.evidence, which fedsd.secure.secagg.verify_blame checks) is named in the
        round's record with its evidence and left out of every later round of this run; the
        evidence goes to every owner at each later advertise. Honest owners so pay for one such
        round at most per member. An input outside the bound is not found so (docs/algorithms.md):
        SumOutsideBound and `_seated` hold its cost to one round per member."""
        if server.evidence:
            evidence = {dealer: {**item, "round": server_round} for dealer, item in server.evidence.items()}
            record["evidence"] = {str(k): v for k, v in evidence.items()}
            self.evidence.extend(evidence.values())
            for dealer in evidence:
                self.barred[dealer] = (f"spoiled round {server_round} (shares that rebuild another secret than it "
                                       f"signed, evidence in secure-aggregation.json): left out of the rest of the run")

    def _step(self, arrays: ArrayRecord, total: np.ndarray, count: int, server: SecAggServer,
              server_round: int) -> tuple[ArrayRecord, dict]:
        """Distributed noise: the decoded sum over the plan's expected batch, as the gradient of
        the server's SGD (momentum included) on the global student, as a simulation applies it
        (fedsd.secure.distributed_step.ServerOptimizer). Refused, nothing applied, when fewer survivors than
        the plan's t sent their shares (the sum would hold less noise than planned), or when the
        sum is above what honest clients send but once in 1e9 rounds (fedsd.secure.sum_bound)."""
        plan = self.round_plan()
        if count < plan.honest:
            raise RoundAbandoned(f"distributed noise: {count} clients' shares in the sum, below the plan's t = "
                                 f"{plan.honest}: less noise than planned; nothing was applied", server.culprits)
        # each share is at most μ / 2 (an owner's t, secagg-min-clients, is at least 2)
        bound = sum_bound.distributed_sum_bound(clip_units=distributed_noise.QUANTISED_CLIP,
                                                expected_batch=plan.expected_batch, variance=count * plan.variance / 2,
                                                dim=plan.dim, clients=count)
        norm = float(np.linalg.norm(total.view(np.int64).astype(np.float64)))
        if not norm <= bound:
            raise SumOutsideBound(f"secure aggregation: the decoded sum has norm {norm:.4g} (quantisation units), above "
                                 f"the {bound:.4g} honest clients stay below (but once in 1e9 rounds); nothing was "
                                 f"applied", server.culprits)
        model, noisy_sum = record_to_model(arrays), distributed_noise.decode(total, plan)
        applied = dict(sum_norm=norm, honest_bound=bound, epsilon=plan.epsilon(server_round, self.side.cfg.delta))
        if self.adaptive is not None:  # S this round; the next from the noised count, the sum's last coordinate
            applied["update_clip"] = clip = self.optimizer.update_clip
            self.optimizer.update_clip, noisy_sum = self.adaptive.next_clip(clip, noisy_sum), noisy_sum[:-1]
        unit = applied["update_clip"] if self.launch.fed.update_clip_normalize else 1.0  # in units of this round's S
        model["student"] = self.optimizer.step(model["student"], noisy_sum, plan, unit)
        if self.launch.fed.privacy_unit == "client":  # each single record's, at sensitivity 2S
            applied["record_epsilon"] = client_level.record_epsilon(plan, server_round, self.side.cfg.delta)
        return model_to_record(model), applied

    def _check_sum(self, total: np.ndarray, count: int, server: SecAggServer) -> tuple:
        """A decoded sum outside what the round's clients could have sent honestly is refused:
        nothing applied (fedsd.secure.sum_bound: every owner scales its update down to the bound,
        so an honest round never fails it)."""
        mean = total.view(np.int64).astype(np.float64) / secure_sum.SCALE / max(count, 1)
        bound = local_noise_bound(self.side.cfg, self.launch.fed, len(total))
        norm = float(np.linalg.norm(mean))
        if not norm <= bound:
            raise SumOutsideBound(f"secure aggregation: the survivors' mean update has norm {norm:.4g}, above the "
                                 f"{bound:.4g} honest clients stay below (but once in 1e9 rounds); nothing was "
                                 f"applied", server.culprits)
        return norm, bound

    def _reports(self, server_round: int, replies: list[RecordDict], ids: list[int]) -> None:
        """Each summed client's report, by its protocol id (`ids`, in the replies' order: never an
        id a member could claim), its ε taken within [0, the run's ε] (a member's 1e9 or inf is
        not the run's result)."""
        strategy, most = self.side.strategy, float(self.side.cfg.epsilon)
        for k, content in enumerate(replies):
            report = reported(content) or {}  # protocol() left out a masked input without one
            strategy.round_clients.setdefault(server_round, {})[ids[k]] = report
            if "epsilon" in report:
                strategy.client_epsilon[ids[k]] = min(max(float(report["epsilon"]), 0.0), most)
