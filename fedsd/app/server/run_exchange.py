"""Multi-round secure aggregation over Flower's Message API (run config `secure-sum = multi-round`;
the protocol: fedsd.secure.secagg_runs, docs/design/multi-round-secure-aggregation.md; the owners'
side: fedsd.app.client.run_stages): the run's holders and threshold are set once, and each batch of
rounds is dealt once, ahead of its rounds, so that a steady round is two exchanges with each owner.

- Setup, and each batch's dealing (Bonawitz et al.'s rounds 0–1, once a batch of
  fedsd.secure.secagg_runs.BATCH rounds): `mr_setup` (the holders, the threshold; each owner's
  signed channel key for the batch), `mr_deal` (every holder's channel key; each owner's dealing),
  `mr_deliver` (each holder's shares from every dealer; its signed acknowledgements). Three
  exchanges at the run's first round; each later batch's ride on the rounds before it
  (fedsd.app.rides): `mr_setup` on the unmask two rounds before its first, `mr_deal` on the masked
  input of the round before, `mr_deliver` on that round's unmask. A batch the rides did not seat
  (fewer than the threshold answered them) is set up at its first round in three exchanges.
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

import numpy as np
from flwr.app import RecordDict

from fedsd.secure.identity import verify
from fedsd.secure.secagg_primitives import (NONCE, SHARE_BYTES, ProtocolError, _public, channel_message,
                                            cohort_digest, held_message, receipt_message, round_digest, round_tag,
                                            run_tag)
from fedsd.secure.secagg_runs import COMMIT, batch_of, rounds_of
from fedsd.secure.secagg_runs_server import RunServer
from fedsd.secure.secagg_server import RoundAbandoned
from fedsd.app import secure_sum
from fedsd.app.secure_sum import BadMessage, read_map
from fedsd.app.server.stage_exchange import (Exchange, _map_record, _masked, _parsed, _signature, _unmask_answer,
                                             cohort_threshold, reported)

# A reply's JSON-encoded field: at most this many bytes (a dealer's batch at 128 holders is about 1.5 MB)
MAX_REPLY = 16 << 20


def _message(base: dict, extra: RecordDict | None = None, maps: dict | None = None, **fields) -> RecordDict:
    return _map_record({**base, **fields}, extra, **(maps or {}))


def _unwired(record, name: str):
    return secure_sum.unwired(record, name, MAX_REPLY)


def _signed(roster, member: int, signature: object, message: bytes) -> bool:
    """Whether the member signed it, by its key on the server's roster (True without a roster: then only the
    owners check, each against its own)."""
    if roster is None:
        return True
    key = roster.key(member)
    return key is not None and verify(key, signature, message)


def _sized(value, size: int | None = None) -> bool:
    return isinstance(value, bytes) and (size is None or len(value) == size)


def _channel(record) -> dict:
    if not isinstance(record["key"], bytes) or not isinstance(record["sig"], bytes):
        raise BadMessage("a channel key and its signature were expected")
    return {"key": record["key"], "sig": record["sig"]}


def _dealing(batch: int, holders: list[int], size: int):
    """A dealer's reply, reduced to the protocol's fields, each of its size (BadMessage otherwise): nothing
    else reaches a holder (a member padded its dealing past the holders' limit, stalling the batch)."""
    rounds = list(rounds_of(batch, size))

    def parse(record) -> dict:
        d = _unwired(record, "dealing")
        d = d if isinstance(d, dict) else {}
        to, hashes, entries, channel = (d.get(k) for k in ("to", "list_hashes", "entries", "channel"))
        if not (d.get("batch") == batch and isinstance(to, dict) and to and set(to) <= set(holders) and all(
                isinstance(v, dict) and _sized(v.get("commits"), COMMIT * len(rounds))
                and _sized(v.get("ciphertext"), NONCE + SHARE_BYTES * len(rounds) + 16) for v in to.values())
                and isinstance(hashes, dict) and set(hashes) == set(to) and all(_sized(v, 32) for v in hashes.values())
                and isinstance(entries, dict) and sorted(entries) == rounds and all(
                    isinstance(e, dict) and _sized(e.get("digest"), 32) and _sized(e.get("s_public"), 32)
                    and _sized(e.get("sig"), 64) for e in entries.values())
                and _sized(d.get("root"), 32) and _sized(d.get("sig"), 64) and isinstance(channel, dict)
                and _sized(channel.get("key"), 32) and _sized(channel.get("sig"), 64)):
            raise BadMessage(f"dealing: not a batch {batch} of the protocol's fields and sizes")
        return {"batch": batch, "root": d["root"], "sig": d["sig"], "list_hashes": dict(hashes),
                "channel": {"key": channel["key"], "sig": channel["sig"]},
                "entries": {r: {k: entries[r][k] for k in ("digest", "s_public", "sig")} for r in rounds},
                "to": {h: {"ciphertext": v["ciphertext"], "commits": v["commits"]} for h, v in to.items()}}
    return parse


def _acks(record) -> dict[int, bytes]:
    return read_map(record, "acks")


def _input(content: RecordDict, length: int) -> dict:
    """E1's reply: the masked input (as the per-round stage's) and the receipt's fields (what the owner
    signed beside y's digest)."""
    vector, receipt = _masked(length)(content[secure_sum.RECORD]), content["receipt"]
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
        except Exception as e:  # noqa: BLE001 - anything a member's bytes make numpy raise drops that member
            exchange.stages["mr_masked"]["failed"].setdefault(str(client), f"a reply that does not parse: {e}"[:300])
        if client not in out:
            exchange.stages["mr_masked"]["failed"].setdefault(str(client), "a masked input without its metrics")
    return out


class RoundFacts:
    """What the rounds (fedsd.app.server.secure_rounds) read of a round's protocol: the threshold, the
    members summed, the culprits named and any spoiler's evidence (none: a multi-round spoiler is
    named in `culprits` and left out of the run)."""

    def __init__(self, threshold: int, culprits: dict):
        self.threshold, self.culprits, self.masked, self.evidence = threshold, culprits, {}, {}


class RunExchange:
    """One Flower run's multi-round protocol: its holders, threshold, the batches dealt, the members left
    out for the rest of the run, and the server's routing (fedsd.secure.secagg_runs_server.RunServer)."""

    def __init__(self, run_id: int, experiment: str, threshold_setting: int):
        self.tau = run_tag(secure_sum.round_id(run_id, experiment, 0))
        self.threshold_setting = threshold_setting
        self.server: RunServer | None = None
        self.dealt: dict[int, list[int]] = {}  # batch → the members who can sit its rounds together
        self.barred: dict[int, str] = {}  # member → what it did that left it out of the rest of the run
        self.ahead: dict[int, dict] = {}  # the next batch, dealt in rides: its channel keys, then its dealings

    def facts(self, present: list[int]) -> RoundFacts:
        """A round's facts, the run's holders set at its first (the nodes identified then)."""
        if self.server is None:
            self.server = RunServer(self.tau, present, cohort_threshold(len(present), self.threshold_setting))
        return RoundFacts(self.server.threshold, self.server.culprits)

    def _bar(self, exchange: Exchange, member: int, why: str) -> None:
        self.barred.setdefault(member, why)
        exchange.named[str(member)] = why

    def round(self, exchange: Exchange, facts: RoundFacts, r: int, base: dict, train: RecordDict, evidence: str,
              length: int) -> tuple[np.ndarray, list]:
        """Round r: a batch dealt where r's is not (the run's setup at its first), then E1 and the
        unmask; the sum and the summed members' E1 replies (in id order). `facts.masked`: who was summed."""
        present, server = sorted(exchange.nodes), self.server
        here = cohort = [c for c in present if c in server.holders and c not in self.barred]
        strangers = sorted(set(present) - set(server.holders))
        exchange.named.update({str(c): "joined after this run's setup: it sits the run out" for c in strangers})
        batch = batch_of(r, server.batch)
        cohort = self._deal(exchange, base, r, cohort) if batch not in self.dealt else \
            [c for c in cohort if c in self.dealt[batch]]
        if len(cohort) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(cohort)} of the run's holders here, below the threshold "
                                 f"{server.threshold}", server.culprits)
        exchange.aside = {c: exchange.nodes[c] for c in here if c not in cohort}  # asked the next batch's rides too
        exchange.identified({c: exchange.nodes[c] for c in cohort})
        extra = {"evidence": evidence} if evidence else {}
        acks = secure_sum.wire(server.acks_for(r, cohort))
        asked = {c: _message(base, {"arrays": train["arrays"], "config": train["config"]}, cohort=cohort, acks=acks,
                             **extra) for c in cohort}
        replies = self._ahead_deal(exchange, base, r, asked)
        digest = round_digest(secure_sum.settings_digest(train["config"]),
                              [train["arrays"][k].numpy() for k in sorted(train["arrays"])])
        sent = self._receipted(exchange, r, cohort, digest, _inputs(exchange, replies, length))
        return self._unmasked(exchange, base, r, cohort, sent, replies, facts)

    def _receipted(self, exchange: Exchange, r: int, cohort: list[int], digest: bytes, sent: dict) -> dict:
        """The inputs whose receipts every honest holder will take: signed by the member (its key on the
        server's roster) over this round, cohort and digest, with a t + f in [2, holders]. Any other is
        dropped, and its member left out of the run: a receipt it signed over another digest is its own
        doing, and without this every owner paid for rounds the holders then refused to open."""
        rid, cohort_hash, keys, kept = round_tag(self.tau, r), cohort_digest(cohort), exchange.roster, {}
        for c, reply in sent.items():
            receipt = reply["receipt"]
            needed = receipt["needed"]
            good = isinstance(needed, int) and not isinstance(needed, bool) and 2 <= needed <= len(
                self.server.holders) and receipt["digest"] == digest and _signed(
                keys, c, receipt["sig"], receipt_message(rid, c, cohort_hash, digest, needed, receipt["y_hash"]))
            if good:
                kept[c] = reply
            else:
                self._bar(exchange, c, f"round {r}: a receipt not signed over the round's cohort and digest: left out "
                                       f"of the rest of the run")
        return kept

    def _unmasked(self, exchange: Exchange, base: dict, r: int, cohort: list[int], sent: dict, replies: dict,
                  facts: RoundFacts) -> tuple[np.ndarray, list]:
        """E1's checked inputs unmasked: the sum and the summed members' replies."""
        server = self.server
        survivors, dropped = sorted(sent), sorted(set(cohort) - set(sent))
        if len(survivors) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(survivors)} masked inputs, below the threshold "
                                 f"{server.threshold}; nothing was unmasked", server.culprits)
        receipts = {c: sent[c]["receipt"] for c in survivors}
        answers = self._unmask(exchange, base, r, cohort, survivors, dropped, receipts)
        if len(answers) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(answers)} holders answered the unmask, below the "
                                 f"threshold {server.threshold}; nothing was unmasked", server.culprits)
        try:
            total = server.finish(r, {c: sent[c]["y"] for c in survivors}, dropped, answers)
        except RoundAbandoned:
            for dealer, why in list(server.culprits.items()):  # its T shares rebuild another secret than it signed
                if why.startswith("dealt shares that rebuild"):
                    self._bar(exchange, dealer, f"round {r}: {why}: left out of the rest of the run")
            raise
        facts.masked = {c: True for c in survivors}
        return total, [replies[c] for c in survivors]

    def _unmask(self, exchange: Exchange, base: dict, r: int, cohort: list[int], survivors: list[int],
                dropped: list[int], receipts: dict) -> dict[int, dict]:
        """E2 when no one dropped (the next batch's set-up riding on it, where it is due); E2' and E3 when
        someone did. Each holder's answer."""
        wired = secure_sum.wire(receipts)
        if not dropped:
            return _parsed(self._ahead_unmask(exchange, base, r, {c: _message(base, cohort=cohort, receipts=wired)
                                                                  for c in cohort}), _unmask_answer)
        signatures = _parsed(exchange.ask("mr_view", {c: _message(base, survivors=survivors, dropped=dropped,
                                                                  receipts=wired) for c in cohort}), _signature)
        if len(signatures) < self.server.threshold:
            raise RoundAbandoned(f"secure aggregation: {len(signatures)} holders signed the round's view, below the "
                                 f"threshold {self.server.threshold}; nothing was unmasked", self.server.culprits)
        return _parsed(exchange.ask("mr_unmask_view", {c: _message(base, maps={"signatures": signatures})
                                                       for c in signatures}), _unmask_answer)

    def _checked_channels(self, exchange: Exchange, batch: int, replies: dict[int, RecordDict]) -> dict[int, dict]:
        """Each holder's channel key for the batch, canonical and signed by it for this run and batch (with the
        server's roster): an unsigned one made every honest dealer refuse the batch."""
        out = {}
        for h, c in _parsed(replies, _channel).items():
            try:
                _public(c["key"], "a channel key")
            except ProtocolError:
                c = None
            if c is None or not _signed(exchange.roster, h, c["sig"], channel_message(self.tau, h, batch, c["key"])):
                self._bar(exchange, h, f"batch {batch}: a channel key it did not sign: left out of the rest of the run")
            else:
                out[h] = c
        for h, c in list(out.items()):  # one key given by two: a copy (every dealer would refuse the batch)
            twins = [j for j in out if j != h and out[j]["key"] == c["key"]]
            for who in twins + [h] if twins else []:
                out.pop(who, None)
                exchange.named[str(who)] = (f"batch {batch}: a channel key another holder gave too: both sit the "
                                            f"batch out")
        return out

    def _setup_message(self, base: dict, batch: int) -> RecordDict:
        return _message(base, holders=self.server.holders, threshold=self.server.threshold, batch=batch)

    @staticmethod
    def _deal_message(base: dict, batch: int, channels: dict[int, dict]) -> RecordDict:
        return _message(base, maps={"channel-keys": {h: c["key"] for h, c in channels.items()},
                                    "channel-sigs": {h: c["sig"] for h, c in channels.items()}}, batch=batch)

    def _deliveries(self, exchange: Exchange, dealings: dict[int, dict]) -> dict[int, dict]:
        """Each holder's part of every dealing, the dealings kept for the unmask; a dealer whose second
        dealing of a batch has another root than its first is left out of the run (its holders refuse it)."""
        deliveries: dict[int, dict] = {}
        for dealer, dealing in dealings.items():
            try:
                kept = self.server.keep_dealing(dealer, dealing)
            except ProtocolError as e:  # a second root: its holders keep the first and refuse this one
                self._bar(exchange, dealer, f"{e}: left out of the rest of the run")
                continue
            for holder, delivery in kept.items():
                deliveries.setdefault(holder, {})[dealer] = delivery
        return deliveries

    @staticmethod
    def _deliver_message(base: dict, batch: int, deliveries: dict) -> RecordDict:
        return _message(base, batch=batch, dealings=secure_sum.wire(deliveries))

    def _seat(self, exchange: Exchange, batch: int, dealings: dict, replies: dict[int, RecordDict]) -> list[int]:
        """The acknowledgements kept; the members who can sit the batch's rounds together."""
        acks = _parsed(replies, _acks)
        for holder, signed in acks.items():
            roots = {d: self.server.dealings.get((d, batch), {}).get("root") for d in signed}
            if not all(_sized(sig, 64) and roots[d] is not None and _signed(
                    exchange.roster, holder, sig, held_message(self.tau, holder, d, batch, roots[d]))
                    for d, sig in signed.items()):  # each owner would refuse it at E1 (a padded one, every round)
                self._bar(exchange, holder, f"batch {batch}: an acknowledgement it did not sign over the dealing "
                                            f"kept: left out of the rest of the run")
                continue
            for dealer, signature in signed.items():
                self.server.keep_ack(dealer, batch, holder, signature)
        return self._seatable(exchange, batch, sorted((set(dealings) & set(acks)) - set(self.barred)))

    def _deal(self, exchange: Exchange, base: dict, r: int, cohort: list[int]) -> list[int]:
        """Round r's batch set up and dealt in three exchanges of its own (the run's first round, or a batch
        the rides before it did not seat): the holders' channel keys, every dealer's batch, each delivered
        and acknowledged. The members who can sit the batch's rounds together; below the threshold the
        round is abandoned and the batch dealt again at the next (an honest owner's dealing is the same)."""
        server, batch = self.server, batch_of(r, self.server.batch)
        self.ahead.pop(batch, None)
        channels = self._checked_channels(exchange, batch, exchange.ask(
            "mr_setup", {c: self._setup_message(base, batch) for c in cohort}))
        dealings = {} if len(channels) < server.threshold else _parsed(exchange.ask(
            "mr_deal", {c: self._deal_message(base, batch, channels) for c in channels}),
            _dealing(batch, server.holders, server.batch))
        deliveries = self._deliveries(exchange, dealings)
        seat = [] if not dealings else self._seat(exchange, batch, dealings, exchange.ask(
            "mr_deliver", {h: self._deliver_message(base, batch, deliveries.get(h, {})) for h in channels}))
        if len(seat) < server.threshold:
            raise RoundAbandoned(f"secure aggregation: batch {batch} dealt and acknowledged among {len(seat)} "
                                 f"members, below the threshold {server.threshold}; it is dealt again at the next "
                                 f"round", server.culprits)
        self.dealt[batch] = seat
        return seat

    # -- the next batch, dealt riding on the rounds before it (design §2: no exchange of its own) ----------
    @staticmethod
    def _here(exchange: Exchange) -> list[int]:
        """The round's holders here and not barred: its cohort, and those this batch did not seat."""
        return sorted({**exchange.aside, **exchange.nodes})

    def _due(self, r: int) -> tuple[int, int]:
        """(the batch after round r's, how many rounds before its first r is): its channel keys ride on the
        unmask two rounds before, its dealing on the masked input of the round before, its delivery on that
        round's unmask; 0 rounds where it is dealt already."""
        nxt = batch_of(r, self.server.batch) + 1
        return nxt, 0 if nxt in self.dealt else rounds_of(nxt, self.server.batch)[0] - r

    def _ahead_deal(self, exchange: Exchange, base: dict, r: int, asked: dict[int, RecordDict]) -> dict:
        """E1's replies; the round before a batch, each keyed holder's dealing of it rides on E1."""
        nxt, due = self._due(r)
        channels = self.ahead.get(nxt, {}).get("channels", {})
        if due != 1 or len(channels) < self.server.threshold:
            return exchange.ask("mr_masked", asked)
        replies, ridden = exchange.ask_with_ride("mr_masked", asked, "mr_deal", {
            c: self._deal_message(base, nxt, channels) for c in self._here(exchange) if c in channels})
        self.ahead[nxt]["dealings"] = _parsed(ridden, _dealing(nxt, self.server.holders, self.server.batch))
        return replies

    def _ahead_unmask(self, exchange: Exchange, base: dict, r: int, asked: dict[int, RecordDict]) -> dict:
        """E2's replies; two rounds before a batch its channel keys ride on E2, the round before its delivery
        (its members seated where they reach the threshold; else it is dealt at its first round)."""
        nxt, due = self._due(r)
        if due == 2:
            replies, ridden = exchange.ask_with_ride("mr_unmask", asked, "mr_setup", {
                c: self._setup_message(base, nxt) for c in self._here(exchange)})
            self.ahead[nxt] = {"channels": self._checked_channels(exchange, nxt, ridden)}
            return replies
        ahead = self.ahead.pop(nxt, {})
        dealings, channels = ahead.get("dealings", {}), ahead.get("channels", {})
        if due != 1 or not dealings:
            return exchange.ask("mr_unmask", asked)
        deliveries = self._deliveries(exchange, dealings)
        replies, ridden = exchange.ask_with_ride("mr_unmask", asked, "mr_deliver", {
            h: self._deliver_message(base, nxt, deliveries.get(h, {})) for h in self._here(exchange) if h in channels})
        seat = self._seat(exchange, nxt, dealings, ridden)
        if len(seat) >= self.server.threshold:
            self.dealt[nxt] = seat
        return replies

    def _seatable(self, exchange: Exchange, batch: int, candidates: list[int]) -> list[int]:
        """The batch's members who can sit its rounds together: each one's shares held (acknowledged) by every
        other, as each owner checks before it is charged. A pair where one did not acknowledge the other's
        batch leaves both out of the batch, named: the server cannot tell which one lied, and a member that
        withholds costs one other owner at most, never without its own seat."""
        seat, acks = set(candidates), self.server.acks
        for c in candidates:
            for j in candidates:
                if c in seat and j in seat and acks.get((j, batch), {}).get(c) is None:
                    seat -= {c, j}
                    for who in {c, j}:
                        exchange.named[str(who)] = (f"batch {batch}: {exchange.name(c)} holds no acknowledged batch "
                                                    f"of {exchange.name(j)}: both sit the batch out")
        return sorted(seat)
