"""Multi-round secure aggregation over Flower's Message API (run config `secure-sum = multi-round`;
the protocol: fedsd.secure.secagg_runs, docs/design/multi-round-secure-aggregation.md; the owners'
side: fedsd.app.client.run_stages): the run's holders and threshold are set once, and each batch of
rounds is dealt once, ahead of its rounds, so that a steady round is two exchanges with each owner.

- Setup, and each batch's dealing (Bonawitz et al.'s rounds 0–1, once a batch of
  fedsd.secure.secagg_runs.BATCH rounds): `mr_setup` (the holders, the threshold; each owner's
  signed channel key for the batch), `mr_deal` (every holder's channel key; each owner's dealing),
  `mr_deliver` (each holder's shares from every dealer; its signed acknowledgements). Three
  exchanges at the run's first round and at the first round of each later batch.
- A round (`RunExchange.round`): E1 `mr_masked` (the cohort, every member's acknowledgements, the
  round's settings and model; each owner's masked input and signed receipt), then, when every member
  of the cohort sent its input, E2 `mr_unmask` (every receipt; each holder's shares of the self
  masks). When someone dropped: E2' `mr_view` (the survivors with their receipts, and the dropped;
  each holder's signature of that one view) and E3 `mr_unmask_view` (the signatures; the survivors'
  self-mask shares and the dropped members' key shares). Bonawitz's round 3 (the consistency check)
  folds into E1's receipts when no one dropped, and stays its own exchange when someone did
  (folding it would lose the single agreed view: the design's §4b).

Holders are the nodes identified at the run's first round; a node that comes later is left out of
this run (the owners' setup is set once) and said in the round's record. Nothing here is trusted by
an owner: each checks every field, signature and count it is sent (fedsd.secure.secagg_runs).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from fedsd.secure.secagg_primitives import minimum_threshold, run_tag
from fedsd.secure.secagg_runs import batch_of, decoded, encoded
from fedsd.secure.secagg_runs_server import RunServer
from fedsd.secure.secagg_server import RoundAbandoned
from fedsd.app import secure_sum
from fedsd.app.secure_sum import BadMessage, read_map, write_map
from fedsd.app.server.stage_exchange import Exchange, _parsed, reported

# A reply's JSON-encoded field: at most this many bytes (a dealer's batch at 128 holders is about 1.5 MB)
MAX_REPLY = 16 << 20


def _message(base: dict, extra: RecordDict | None = None, maps: dict | None = None, **fields) -> RecordDict:
    record = ConfigRecord({**base, **fields})
    for name, values in (maps or {}).items():
        write_map(record, name, values)
    content = RecordDict({secure_sum.RECORD: record})
    for key, value in (extra or {}).items():
        content[key] = value
    return content


def _wire(value) -> bytes:
    return json.dumps(encoded(value)).encode()


def _unwired(record, name: str):
    raw = record[name]
    if not isinstance(raw, bytes) or len(raw) > MAX_REPLY:
        raise BadMessage(f"{name}: one bytes field of at most {MAX_REPLY} bytes was expected")
    return decoded(json.loads(raw))


def _channel(record) -> dict:
    if not isinstance(record["key"], bytes) or not isinstance(record["sig"], bytes):
        raise BadMessage("a channel key and its signature were expected")
    return {"key": record["key"], "sig": record["sig"]}


def _dealing(record) -> dict:
    dealing = _unwired(record, "dealing")
    if not isinstance(dealing, dict) or not isinstance(dealing.get("to"), dict):
        raise BadMessage("dealing: a dealer's batch was expected")
    return dealing


def _acks(record) -> dict[int, bytes]:
    return read_map(record, "acks")


def _input(content: RecordDict, length: int) -> dict:
    """E1's reply: the masked input and the receipt's fields (what the owner signed beside y's digest)."""
    vector, receipt = content[secure_sum.RECORD]["masked"].numpy(), content["receipt"]
    if vector.dtype != np.uint64 or vector.shape != (length,):
        raise BadMessage(f"a masked input of {vector.dtype} {vector.shape}, not uint64 ({length},)")
    sig, digest, needed = receipt["sig"], receipt["digest"], receipt["needed"]
    if not isinstance(sig, bytes) or not isinstance(digest, bytes) or not isinstance(needed, int):
        raise BadMessage("a receipt of a signature, the round's digest and the owner's t + f was expected")
    return {"y": vector, "receipt": {"sig": sig, "digest": digest, "needed": needed,
                                     "y_hash": hashlib.sha256(vector.tobytes()).digest()}}


def _inputs(exchange: Exchange, replies: dict[int, RecordDict], length: int) -> dict[int, dict]:
    """Each E1 reply that parses and has its metrics; any other is dropped like a node that did not answer."""
    out = {}
    for client, content in replies.items():
        try:
            if reported(content) is not None:
                out[client] = _input(content, length)
        except (BadMessage, AttributeError, KeyError, TypeError, ValueError) as e:
            exchange.stages["mr_masked"]["failed"].setdefault(str(client), f"a reply that does not parse: {e}"[:300])
        if client not in out:
            exchange.stages["mr_masked"]["failed"].setdefault(str(client), "a masked input without its metrics")
    return out


def _shares(record) -> dict:
    return {"b": read_map(record, "b"), "s": read_map(record, "s") if "s-ids" in record else {}}


def _signature(record) -> bytes:
    if not isinstance(record["sig"], bytes):
        raise BadMessage("a signature was expected")
    return record["sig"]


class RoundFacts:
    """What the rounds (fedsd.app.server.secure_rounds) read of a round's protocol: the threshold, the
    members summed, the culprits named and any spoiler's evidence (none: a multi-round spoiler is
    named in `culprits` and left out of the run)."""

    def __init__(self, threshold: int, culprits: dict):
        self.threshold, self.culprits, self.masked, self.evidence = threshold, culprits, {}, {}


class RunExchange:
    """One Flower run's multi-round protocol: its holders, threshold, the batches dealt, and the
    server's routing (fedsd.secure.secagg_runs_server.RunServer)."""

    def __init__(self, run_id: int, experiment: str, threshold_setting: int):
        self.tau = run_tag(secure_sum.round_id(run_id, experiment, 0))
        self.threshold_setting = threshold_setting
        self.server: RunServer | None = None
        self.dealt: dict[int, list[int]] = {}  # batch → the members who can sit its rounds together

    def threshold_for(self, n: int) -> int:
        return min(n, max(minimum_threshold(n), self.threshold_setting)) if n else 1

    def facts(self, present: list[int]) -> RoundFacts:
        """A round's facts, the run's holders set at its first (the nodes identified then)."""
        if self.server is None:
            self.server = RunServer(self.tau, present, self.threshold_for(len(present)))
        return RoundFacts(self.server.threshold, self.server.culprits)

    def round(self, exchange: Exchange, facts: RoundFacts, r: int, base: dict, train: RecordDict, evidence: str,
              length: int) -> tuple[np.ndarray, list]:
        """Round r: a batch dealt where r's is not (the run's setup at its first), then E1 and the
        unmask; the sum and the summed members' E1 replies (in id order). `facts.masked`: who was summed."""
        present, server = sorted(exchange.nodes), self.server
        cohort = [c for c in present if c in server.holders]
        strangers = sorted(set(present) - set(cohort))
        exchange.named.update({str(c): "joined after this run's setup: it sits the run out" for c in strangers})
        batch = batch_of(r, server.batch)
        cohort = self._deal(exchange, base, r, cohort) if batch not in self.dealt else \
            [c for c in cohort if c in self.dealt[batch]]
        if len(cohort) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(cohort)} of the run's holders here, below the threshold "
                                 f"{server.threshold}", server.culprits)
        exchange.identified({c: exchange.nodes[c] for c in cohort})
        extra = {"evidence": evidence} if evidence else {}
        replies = exchange.ask("mr_masked", {c: _message(base, {"arrays": train["arrays"], "config": train["config"]},
                                                         cohort=cohort, acks=_wire(server.acks_for(r, cohort)),
                                                         **extra) for c in cohort})
        return self._unmasked(exchange, base, r, cohort, replies, length, facts)

    def _unmasked(self, exchange: Exchange, base: dict, r: int, cohort: list[int], replies: dict, length: int,
                  facts: RoundFacts) -> tuple[np.ndarray, list]:
        """E1's replies unmasked: the sum and the summed members' replies."""
        server, sent = self.server, _inputs(exchange, replies, length)
        survivors, dropped = sorted(sent), sorted(set(cohort) - set(sent))
        if len(survivors) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(survivors)} masked inputs, below the threshold "
                                 f"{server.threshold}; nothing was unmasked", server.culprits)
        receipts = {c: sent[c]["receipt"] for c in survivors}
        answers = self._unmask(exchange, base, cohort, survivors, dropped, receipts)
        if len(answers) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(answers)} holders answered the unmask, below the "
                                 f"threshold {server.threshold}; nothing was unmasked", server.culprits)
        total = server.finish(r, {c: sent[c]["y"] for c in survivors}, dropped, answers)
        facts.masked = {c: True for c in survivors}
        return total, [replies[c] for c in survivors]

    def _unmask(self, exchange: Exchange, base: dict, cohort: list[int], survivors: list[int], dropped: list[int],
                receipts: dict) -> dict[int, dict]:
        """E2 when no one dropped; E2' and E3 when someone did. Each holder's answer."""
        wired = _wire(receipts)
        if not dropped:
            return _parsed(exchange.ask("mr_unmask", {c: _message(base, cohort=cohort, receipts=wired)
                                                      for c in cohort}), _shares)
        signatures = _parsed(exchange.ask("mr_view", {c: _message(base, survivors=survivors, dropped=dropped,
                                                                  receipts=wired) for c in cohort}), _signature)
        if len(signatures) < self.server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(signatures)} holders signed the round's view, below the "
                                 f"threshold {self.server.threshold}; nothing was unmasked", self.server.culprits)
        return _parsed(exchange.ask("mr_unmask_view", {c: _message(base, maps={"signatures": signatures})
                                                       for c in signatures}), _shares)

    def _deal(self, exchange: Exchange, base: dict, r: int, cohort: list[int]) -> list[int]:
        """Round r's batch set up and dealt: every holder's channel key, every dealer's batch, each
        delivered and acknowledged. The holders that took part in all three (the round's cohort)."""
        server, batch = self.server, batch_of(r, self.server.batch)
        channels = _parsed(exchange.ask("mr_setup", {c: _message(base, holders=server.holders,
                                                                 threshold=server.threshold, batch=batch)
                                                     for c in cohort}), _channel)
        if len(channels) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(channels)} holders gave a channel key for batch {batch}, "
                                 f"below the threshold {server.threshold}; it is dealt at the next round",
                                 server.culprits)
        maps = {"channel-keys": {h: c["key"] for h, c in channels.items()},
                "channel-sigs": {h: c["sig"] for h, c in channels.items()}}
        dealings = _parsed(exchange.ask("mr_deal", {c: _message(base, maps=maps, batch=batch) for c in cohort}),
                           _dealing)
        deliveries: dict[int, dict] = {}
        for dealer, dealing in dealings.items():
            try:
                if dealing.get("batch") != batch:
                    raise TypeError
                for holder, delivery in server.keep_dealing(dealer, dealing).items():
                    deliveries.setdefault(holder, {})[dealer] = delivery
            except (KeyError, TypeError, AttributeError):
                exchange.named[str(dealer)] = "a dealing without a batch for every holder"
        acks = _parsed(exchange.ask("mr_deliver", {h: _message(base, batch=batch, dealings=_wire(deliveries.get(h, {})))
                                                   for h in cohort}), _acks)
        for holder, signed in acks.items():
            for dealer, signature in signed.items():
                server.keep_ack(dealer, batch, holder, signature)
        self.dealt[batch] = self._seatable(batch, sorted(set(dealings) & set(acks)))
        return self.dealt[batch]

    def _seatable(self, batch: int, candidates: list[int]) -> list[int]:
        """The batch's members who can sit its rounds together: each one's shares held (acknowledged) by
        every other, as each owner checks before it is charged. While any pair lacks that, the member
        missing the most is left out of the batch's rounds."""
        seat, acks = set(candidates), self.server.acks
        while True:
            missing = {c: sum((acks.get((j, batch), {}).get(c) is None) + (acks.get((c, batch), {}).get(j) is None)
                              for j in seat) for c in seat}
            worst = max(seat, key=lambda c: (missing[c], c), default=None)
            if worst is None or not missing[worst]:
                return sorted(seat)
            seat.discard(worst)
