"""One round's stage messages under secure aggregation (the rounds: fedsd.app.server.secure_rounds):
`Exchange` sends a stage to the nodes still in and keeps the good replies, with bytes and
seconds per stage; the stage records the server sends and the parsers of what each stage's
replies carry (a reply that does not parse is dropped like a node that did not answer); the
identify stage (`identify`), the five stages after it in order (`protocol`), the owners'
refusals (`refusals`) and a masked reply's metrics (`reported`).
"""
from __future__ import annotations

import math
import re
import time
from logging import WARNING

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid

from fedsd.errors import ConfigError
from fedsd.secure.identity import Roster, protocol_id, public_line, verify
from fedsd.secure.secagg_primitives import SEED_BYTES, SELF_SEED_BYTES, identify_message, minimum_threshold
from fedsd.secure.secagg_server import SecAggServer
from fedsd.app import rides, secure_sum
from fedsd.app.secure_sum import KEY_FIELDS, BadMessage, read_map, write_map


def cohort_threshold(n: int, setting: int) -> int:
    """The shares needed to unmask among n holders: the run's `secagg-threshold`, at least
    `minimum_threshold` and at most n (1 for an empty cohort)."""
    return min(n, max(minimum_threshold(n), setting)) if n else 1


def _size(content: RecordDict) -> int:
    return recorddict_to_proto(content).ByteSize()


CULPRIT = re.compile(r"\(culprit: (\d+)[;)]")


class Exchange:
    """One round's messages: sends a stage to some nodes, keeps the good replies, counts bytes
    and seconds per stage. Clients are named by their protocol id, which each node's service
    tells at the identify stage (its roster identity's, or its node id without a roster)."""

    def __init__(self, grid: Grid, server_round: int, timeout: float, nodes: list[int], roster: Roster | None = None):
        self.grid, self.server_round, self.timeout, self.roster = grid, server_round, timeout, roster
        self.stages: dict[str, dict] = {}
        self.nodes: dict[int, int] = {secure_sum.secagg_id(node): node for node in sorted(nodes)}
        self.ids = {node: client for client, node in self.nodes.items()}
        self.named: dict[str, str] = {}  # a culprit (protocol id) → what its neighbours said of it
        self.aside: dict[int, int] = {}  # holders here outside the round's cohort (protocol id → node): asked rides

    def name(self, client: int) -> str:
        """A client as its operator knows it: its roster name, else its SuperNode's node id as
        `flwr supernode list` prints it (unsigned 64 bits; without a roster the protocol id is
        only its low 63 bits, 2^63 less where the top bit is set), else its protocol id."""
        if self.roster is not None and client in self.roster:
            return self.roster.name(client)
        return f"node {self.nodes[client]}" if client in self.nodes else f"client {client}"

    def identified(self, ids: dict[int, int]) -> None:
        """The protocol ids the nodes told (protocol id → node); a node that told an id another
        node told already is left out (an owner takes part once a round)."""
        self.nodes = {}
        for client, node in sorted(ids.items(), key=lambda kv: kv[1]):
            self.nodes.setdefault(client, node)
        self.ids = {node: client for client, node in self.nodes.items()}

    def _accused(self, client: int, refusal: str) -> None:
        """Each member a refusal names `(culprit: N)`: its accuser's word, said as such, never as fact."""
        for culprit in CULPRIT.findall(refusal):
            self.named.setdefault(culprit, f"named by {self.name(client)}: {refusal}")

    def ask(self, stage: str, contents: dict[int, RecordDict], stages: dict[int, str] | None = None
            ) -> dict[int, RecordDict]:
        """Each client its message of `stage` (of `stages[client]` where given), sent together; the good
        replies."""
        started, started_at = time.perf_counter(), time.time()
        kind, nodes = secure_sum.MESSAGE_TYPES, {**self.aside, **self.nodes}
        ids = {node: client for client, node in nodes.items()}
        messages = [Message(content=content, dst_node_id=nodes[client],
                            message_type=kind[(stages or {}).get(client, stage)], group_id=str(self.server_round))
                    for client, content in contents.items()]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout)
        good, failed = {}, {}
        for reply in replies:
            client = ids.get(reply.metadata.src_node_id, -1)
            if reply.has_error():
                failed[client] = reply.error.reason[:300]
                self._accused(client, failed[client])
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
            log(WARNING, "secure aggregation round %d, %s: %s dropped: %s", self.server_round, stage, self.name(client),
                why)
        return good


    def ask_with_ride(self, stage: str, contents: dict[int, RecordDict], ride_stage: str,
                      ride_contents: dict[int, RecordDict]) -> tuple[dict[int, RecordDict], dict[int, RecordDict]]:
        """`ask`, with a message of `ride_stage` riding in each of `contents` that `ride_contents` has one
        for (fedsd.app.rides), and sent alone, in the same send, to those `ride_contents` names that
        `contents` does not (a holder outside the round's cohort is dealt the next batch too): the good
        replies, each without its ride, and each ride's reply that came with the stage's record. The
        stage's record says who was asked the ride, who answered it and who was asked it alone."""
        kind, riders = secure_sum.KINDS[ride_stage], sorted(set(ride_contents) & set(contents))
        alone = {c: ride_contents[c] for c in ride_contents if c not in contents}
        good = self.ask(stage, {**{c: rides.carry(content, kind, ride_contents[c]) if c in riders else content
                                   for c, content in contents.items()}, **alone}, {c: ride_stage for c in alone})
        ridden = {c: good.pop(c) for c in alone if c in good}
        failed = {c: self.stages[stage]["failed"].pop(str(c)) for c in alone if str(c) in self.stages[stage]["failed"]}
        for key in ("asked", "answered"):
            self.stages[stage][key] = [c for c in self.stages[stage][key] if c not in alone]
        for client in riders:
            if client not in good:
                failed[client] = "its carrier was not answered"
                continue
            good[client], reply, why = rides.reply_of(good[client])
            if reply is not None and secure_sum.RECORD in reply:
                ridden[client] = reply
            else:
                failed[client] = why or "a ride's reply without the stage's record"
                self._accused(client, failed[client])
        self.stages[stage]["ride"] = dict(stage=ride_stage, asked=sorted(ride_contents), answered=sorted(ridden),
                                          alone=sorted(alone), failed={str(k): v for k, v in failed.items()})
        for client, why in failed.items():
            log(WARNING, "secure aggregation round %d, %s riding on %s: %s dropped: %s", self.server_round,
                ride_stage, stage, self.name(client), why)
        return good, ridden


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
        except Exception as e:  # noqa: BLE001 - whatever a member's bytes make a parser raise drops that member
            log(WARNING, "secure aggregation: client %d's reply dropped: %s", node, e)  # a protocol id
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
            exchange.named[str(who["id"])] = f"node {node}: a key not on the server's roster " \
                f"({public_line(who['v'])})" if who["v"] else f"node {node}: no roster identity"
            log(WARNING, "secure aggregation round %d: left out %s", exchange.server_round,
                exchange.named[str(who["id"])])
            continue
        out[client] = who
    return out


def _setup(fields: dict) -> dict:
    """Stage 0's fields as a ConfigRecord carries them: a ring's numbers as "graph", [k, t, F]."""
    graph = fields.pop("graph", None)
    return fields if graph is None else {**fields, "graph": [graph["k"], graph["honest"], graph["colluders"]]}


def _masked_sets(server: SecAggServer, client: int) -> dict:
    """On a ring, the signed M of `client`'s neighbours, for its unmask (none on the complete graph)."""
    if server.graph is None:
        return {}
    return {"masked-sets": {j: secure_sum.packed_set(m) for j, m in server.masked_sets_for(client).items()}}


def protocol(exchange: Exchange, server: SecAggServer, base: dict, train: RecordDict,
             evidence: str = "") -> tuple[np.ndarray, list]:
    """The five stages after identify; the sum and the survivors' replies (RoundAbandoned below
    the threshold, or when the shares do not rebuild one secret)."""
    ask = exchange.ask
    # The round's settings go with stage 0 too: each client signs their digest with its keys
    # (fedsd.secure.secagg, stage 0), and its masked input is refused under any other settings.
    # `evidence`: the run's spoilers so far, with what proves it: each owner checks it and refuses them
    extra = {"evidence": evidence} if evidence else {}
    server.context = secure_sum.settings_digest(train["config"])  # what every advert signs: checked at collect_keys
    keys = _parsed(ask("advertise", {n: _with_config(_stage_record(base, **_setup(server.setup(n)), **extra),
                                                     train["config"]) for n in server.cohort}), _keys)
    server.collect_keys(keys)
    requests = {}
    for n in server.keys:  # an advert its neighbours would refuse was left out there, its sender named
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
    # On a ring each survivor's signed M comes with its masked input (a survivor without it is
    # named and counted as dropped by collect_masked), and goes to its neighbours at unmask.
    sets = {n: secure_sum.unpacked_set(replies[n]) for n in masked} if server.graph is not None else None
    server.collect_masked(masked, sets)
    signatures = _parsed(ask("confirm", {n: _stage_record(base, **server.unmask_request(n)) for n in server.masked}),
                         _signature)
    routed = server.route_confirmations(signatures)
    answers = _parsed(ask("unmask", {n: _map_record(base, confirmations=routed.get(n, {}), **_masked_sets(server, n))
                                     for n in signatures}), _unmask_answer)
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
