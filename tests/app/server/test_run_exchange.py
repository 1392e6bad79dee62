"""The server's side of the multi-round protocol (fedsd.app.server.run_exchange.RunExchange) against hostile
members (the server honest): found by a review playing F members against it, each a test that fails without its
defence. The federation: n owners,
each an honest fedsd.secure.secagg_runs.RunMember behind handlers that mirror
fedsd.app.client.run_stages (its wire format, its 8 MB limit on encoded fields, refusals as Error
replies carrying the ProtocolError text); no training: E1's vector is a fixed one, and
`self.charged[id]` counts the E1 inputs each owner computed (= rounds it paid for).
`tamper(stage, client, reply) -> reply` lets hostile members rewrite what they send."""
# (adapted from the reviewer's harness)
from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from fedsd.app import rides, secure_sum
from fedsd.app.client.run_stages import _encoded_field, _round_digest
from fedsd.app.secure_sum import BadMessage, read_map, write_map
from fedsd.app.server.run_exchange import RunExchange
from fedsd.app.server.stage_exchange import Exchange
from fedsd.secure.identity import Identity, Roster
from fedsd.secure.secagg_primitives import (ProtocolError, _commitment, channel_message, cohort_digest, receipt_message,
                                            round_tag)
from fedsd.secure.secagg_runs import BATCH, COMMIT, RunMember, batch_of, decoded, encoded
from fedsd.secure.secagg_server import RoundAbandoned

RUN, EXP, LENGTH = 7, "attack-exp", 4
STAGE = {v: k for k, v in secure_sum.MESSAGE_TYPES.items()}
KIND_STAGE = {v: k for k, v in secure_sum.KINDS.items()}


class _Refused(Exception):
    """An owner's refusal of a ride's part, as the ClientApp sees its service's."""

    def __init__(self, error):
        super().__init__(error.reason)
        self.error = error


def wire(x) -> bytes:
    return json.dumps(encoded(x)).encode()


class Fed:
    def __init__(self, n=7, t=2, f=1, threshold_setting=0, tamper=None, seed=0):
        rng = np.random.default_rng(seed)
        keys = [Identity() for _ in range(n)]
        self.roster = Roster.of({f"owner{k}": key.public for k, key in enumerate(keys)})
        self.runs = RunExchange(RUN, EXP, threshold_setting)
        self.members = {k.id: RunMember(k, self.roster, self.runs.tau, t, f) for k in keys}
        self.ids = sorted(self.members)
        self.x = {i: rng.integers(0, 2 ** 30, LENGTH, dtype=np.uint64) for i in self.ids}
        self.charged = {i: 0 for i in self.ids}
        self.tamper = tamper or (lambda stage, client, reply: reply)
        self.run = SimpleNamespace(run_id=RUN)
        self.asked: list[tuple[int, str, list]] = []  # (round, stage, who was asked)

    # -- the grid -----------------------------------------------------------------------------
    def get_node_ids(self):
        return list(self.ids)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        if messages:  # the send's stage is its first message's; another stage's in it is a ride sent alone
            first = messages[0].metadata.message_type
            self.asked.append((messages[0].content[secure_sum.RECORD]["server-round"], STAGE[first],
                               sorted(m.metadata.dst_node_id for m in messages if m.metadata.message_type == first)))
            for m in messages:
                if m.metadata.message_type != first:
                    self.asked.append((m.content[secure_sum.RECORD]["server-round"],
                                       "ride:" + STAGE[m.metadata.message_type], [m.metadata.dst_node_id]))
        for m in messages:
            client, stage = m.metadata.dst_node_id, STAGE[m.metadata.message_type]
            if rides.RECORD in m.content:
                self.asked.append((m.content[secure_sum.RECORD]["server-round"], "ride:" + KIND_STAGE[
                    m.content[rides.RECORD]["kind"]], [client]))

            def reply_for(kind, content, client=client):  # the ClientApp forwards each part alone (fedsd.app.rides)
                reply = self._answer(KIND_STAGE[kind], client, content)
                if isinstance(reply, Error):
                    raise _Refused(reply)
                return reply
            try:
                reply = rides.answer(secure_sum.KINDS[stage], m.content, reply_for)
            except _Refused as e:
                reply = e.error
            out.append(Message(reply, reply_to=m))
        return out

    def _answer(self, stage, client, content):
        try:
            reply = getattr(self, stage)(self.members[client], content)
        except (BadMessage, ProtocolError, TypeError) as e:
            reply = Error(code=0, reason=f"secure aggregation refused: {e}"[:300])
        return self.tamper(stage, client, reply)

    # -- the honest owners' handlers (fedsd.app.client.run_stages, minus the ledger and training) --
    @staticmethod
    def _rec(content):
        rec = content[secure_sum.RECORD]
        return rec, rec["server-round"]

    def mr_setup(self, m, content):
        rec, r = self._rec(content)
        m.setup(list(rec.get("holders", [])), rec.get("threshold"), r)
        ch = m.channel_key(rec.get("batch"))
        return RecordDict({secure_sum.RECORD: ConfigRecord({"key": ch["key"], "sig": ch["sig"]})})

    def mr_deal(self, m, content):
        rec, r = self._rec(content)
        keys, sigs = read_map(rec, "channel-keys"), read_map(rec, "channel-sigs")
        dealing = m.deal(rec.get("batch"), {h: {"key": keys[h], "sig": sigs[h]} for h in keys})
        return RecordDict({secure_sum.RECORD: ConfigRecord({"dealing": wire(dealing)})})

    def mr_deliver(self, m, content):
        rec, r = self._rec(content)
        dealings = _encoded_field(rec, "dealings")
        acks, refused = {}, []
        for dealer, dealing in dealings.items():
            try:
                acks[dealer] = m.deliver(dealer, rec.get("batch"), dealing)
            except ProtocolError:
                refused.append(dealer)
        out = ConfigRecord({"refused": refused})
        write_map(out, "acks", acks)
        return RecordDict({secure_sum.RECORD: out})

    def mr_masked(self, m, content):
        rec, r = self._rec(content)
        digest = _round_digest(content, (None, RUN, EXP, r))
        sent = m.sent(r)
        if sent is None:
            m.admit(r, list(rec.get("cohort", [])), digest, _encoded_field(rec, "acks"))
            self.charged[m.me] += 1  # charged and trained here in a deployment
            sent = m.mask(r, self.x[m.me])
        return RecordDict({secure_sum.RECORD: ArrayRecord({"masked": Array(sent["y"])}),
                           "receipt": ConfigRecord({"sig": sent["receipt"], "digest": digest, "needed": m.needed}),
                           "metrics": MetricRecord({"epsilon": 0.1})})

    def mr_unmask(self, m, content):
        rec, r = self._rec(content)
        a = m.unmask(r, list(rec.get("cohort", [])), _encoded_field(rec, "receipts"))
        out = ConfigRecord({})
        write_map(out, "b", a["b"])
        return RecordDict({secure_sum.RECORD: out})

    def mr_view(self, m, content):
        rec, r = self._rec(content)
        sig = m.view(r, list(rec.get("survivors", [])), list(rec.get("dropped", [])),
                     _encoded_field(rec, "receipts"))
        return RecordDict({secure_sum.RECORD: ConfigRecord({"sig": sig})})

    def mr_unmask_view(self, m, content):
        rec, r = self._rec(content)
        a = m.unmask_view(r, read_map(rec, "signatures"))
        out = ConfigRecord({})
        write_map(out, "b", a["b"])
        write_map(out, "s", a["s"])
        return RecordDict({secure_sum.RECORD: out})

    # -- the server's round, as SecureRounds.one_round drives RunExchange ------------------------
    def round(self, r: int):
        """(total, exchange) or (RoundAbandoned, exchange); any other exception escapes, as it does
        from SecureRounds.one_round (which catches only RoundAbandoned)."""
        exchange = Exchange(self, r, 60.0, list(self.ids), self.roster)
        facts = self.runs.facts(sorted(exchange.nodes))
        base = {"experiment-id": EXP, "server-round": r}
        train = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(LENGTH, dtype=np.float32))}),
                            "config": ConfigRecord({**base})})
        try:
            try:
                total, _ = self.runs.round(exchange, facts, r, base, train, "", LENGTH)
                return total, exchange, facts
            finally:  # as SecureRounds._summed does
                exchange.named.update({str(k): v for k, v in facts.culprits.items()})
        except RoundAbandoned as e:
            return e, exchange, facts

    def cohort_of(self, r: int) -> list:
        return next(who for rr, stage, who in self.asked if rr == r and stage == "mr_masked")


def unwire(record, name):
    return decoded(json.loads(record[name]))


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):  # as a ServerApp's process has them
        monkeypatch.setattr(TaskIdentity, name, value)


def _summed(fed, r, without=()):
    total, exchange, _ = fed.round(r)
    assert not isinstance(total, Exception), total
    assert np.array_equal(total, sum(fed.x[i] for i in fed.ids if i not in without))
    return exchange


def _rewired_dealing(reply, original: dict, bend) -> RecordDict:
    """A member's mr_deal reply with its dealing bent (`original` keeps what it dealt)."""
    dealing = unwire(reply[secure_sum.RECORD], "dealing")
    original.update(dealing)
    return RecordDict({secure_sum.RECORD: ConfigRecord({"dealing": wire(bend(dealing))})})


def _mine(original, member):
    return {**{k: v for k, v in original.items() if k != "to"}, "to": original["to"][member]}


def test_honest_rounds_sum_every_owners_input():
    fed = Fed()
    for r in (1, 2):
        _summed(fed, r)
    assert all(v == 2 for v in fed.charged.values())


def _bad_npy(reply, data):
    a = Array(np.zeros(4, dtype=np.uint64))
    a.data = data
    reply[secure_sum.RECORD] = ArrayRecord({"masked": a})
    return reply


@pytest.mark.parametrize("stage, bend", [
    ("mr_deal", lambda reply: RecordDict({secure_sum.RECORD: ConfigRecord({"dealing": b"[" * 100_000})})),
    ("mr_masked", lambda reply: _bad_npy(reply, b"")),
    ("mr_masked", lambda reply: _bad_npy(reply, b"PK\x03\x04" + bytes(30))),
])
def test_a_reply_no_parser_can_read_drops_its_member_and_the_round_goes_on(stage, bend):
    """A dealing nested 100,000 deep (RecursionError) and a masked input numpy cannot load (EOFError,
    BadZipFile) escaped the server's parsers and ended the Flower run."""
    hostile = []
    fed = Fed(tamper=lambda s, client, reply: bend(reply) if s == stage and client in hostile else reply)
    hostile.append(fed.ids[3])
    _summed(fed, 1, without=hostile)


def test_a_dealing_with_other_fields_or_shapes_is_refused_and_the_batch_is_dealt_among_the_others():
    """A dealer's own batch with to[M] = 7 crashed the unmask after every owner paid; one padded with 4.3 MB
    pushed every holder's deliveries past their limit, stalling the batch with no one named."""
    M, original = [], {}

    def tamper(stage, client, reply):
        if client not in M or stage != "mr_deal":
            return reply
        return _rewired_dealing(reply, original, lambda d: {**d, "to": {**d["to"], M[0]: 7}} if client == M[0]
                                else {**d, "pad": bytes(9)})

    fed = Fed(tamper=tamper)
    M += [fed.ids[2], fed.ids[4]]
    _summed(fed, 1, without=M[:1])  # the padded one goes on, stripped to the protocol's fields
    assert M[0] not in fed.runs.dealt[1] and M[1] in fed.runs.dealt[1]
    assert "pad" not in fed.runs.server.dealings[(M[1], 1)]


@pytest.mark.parametrize("how", ["forged-signature", "signed-other-digest"])
def test_a_member_whose_receipt_no_holder_takes_is_dropped_before_the_unmask_and_left_out(how):
    """The honest holders refused E2 over one member's bad receipt: every owner paid for a round abandoned
    after E1, again every round, with that member seated (and, signed over another digest, never named)."""
    M = []

    def tamper(stage, client, reply):
        if stage == "mr_masked" and client in M:
            rec = reply["receipt"]
            if how == "forged-signature":
                reply["receipt"] = ConfigRecord({**dict(rec), "sig": bytes(64)})
            else:
                r = fed.members[client].counters.submitted
                y = reply[secure_sum.RECORD]["masked"].numpy()
                other = hashlib.sha256(b"another model").digest()
                sig = fed.members[client].identity.sign(receipt_message(
                    round_tag(fed.runs.tau, r), client, cohort_digest(fed.cohort_of(r)), other, rec["needed"],
                    hashlib.sha256(y.tobytes()).digest()))
                reply["receipt"] = ConfigRecord({"sig": sig, "digest": other, "needed": rec["needed"]})
        return reply

    fed = Fed(tamper=tamper)
    M.append(fed.ids[3])
    exchange = _summed(fed, 1, without=M)  # its masks removed as a dropped member's
    assert "receipt" in exchange.named[str(M[0])] and "mr_view" in exchange.stages
    _summed(fed, 2, without=M)
    assert M[0] not in fed.cohort_of(2) and fed.charged[M[0]] == 1


@pytest.mark.parametrize("size", [16, 32])
def test_a_dealer_whose_shares_rebuild_another_secret_is_left_out_of_the_rest_of_the_run(size):
    """Named, the round abandoned, and seated again in the next, which it spoiled again. A share of another
    length than b's (32) crashed the rebuild after every owner paid: that answer is dropped, the sum made."""
    M, original, fake = [], {}, {}

    def tamper(stage, client, reply):
        if client not in M:
            return reply
        if stage == "mr_deal":
            def bend(dealing):
                mine = dict(dealing["to"][client])
                lines = bytearray(mine["commits"])
                for k, r in enumerate(range(1, 9)):
                    fake[r] = bytes([r]) * size
                    lines[k * COMMIT:k * COMMIT + 32] = _commitment(round_tag(fed.runs.tau, r), client, client, "b",
                                                                    fake[r])
                return {**dealing, "to": {**dealing["to"], client: {**mine, "commits": bytes(lines)}}}
            return _rewired_dealing(reply, original, bend)
        if stage == "mr_deliver":  # its own member takes the real delivery (its real shares)
            acks = read_map(reply[secure_sum.RECORD], "acks")
            acks[client] = fed.members[client].deliver(client, 1, _mine(original, client))
            write_map(reply[secure_sum.RECORD], "acks", acks)
        if stage == "mr_unmask":
            b = read_map(reply[secure_sum.RECORD], "b")
            b[client] = fake[fed.members[client].counters.answered]
            write_map(reply[secure_sum.RECORD], "b", b)
        return reply

    fed = Fed(tamper=tamper)
    M.append(fed.ids[0])  # the lowest id: its share is among the T chosen
    if size != 16:
        _summed(fed, 1)  # its answer set aside: the others' shares of every b, its own input included
        return
    result, exchange, _ = fed.round(1)
    assert isinstance(result, RoundAbandoned) and "rebuild another secret" in str(result)
    _summed(fed, 2, without=M)
    assert M[0] not in fed.cohort_of(2) and "left out of the rest of the run" in fed.runs.barred[M[0]]


def test_a_member_withholding_an_acknowledgement_loses_its_own_seat_with_the_one_it_accuses():
    """The member missing the most acknowledgements was left out, ties to the higher id: one hostile member
    kept an honest owner out of every batch, unnamed, and sat every round itself."""
    hostile, victim = [], []

    def tamper(stage, client, reply):
        if stage == "mr_deliver" and client in hostile:
            acks = read_map(reply[secure_sum.RECORD], "acks")
            acks.pop(victim[0], None)
            write_map(reply[secure_sum.RECORD], "acks", acks)
        return reply

    fed = Fed(tamper=tamper)
    hostile.append(fed.ids[0])
    victim.append(fed.ids[-1])
    exchange = _summed(fed, 1, without=hostile + victim)
    assert str(hostile[0]) in exchange.named and str(victim[0]) in exchange.named


def test_an_unsigned_channel_key_leaves_its_member_out_and_the_batch_is_dealt_among_the_others():
    """Routed unchecked, it made every honest dealer refuse the batch: eight rounds abandoned, every batch."""
    M = []
    fed = Fed(tamper=lambda stage, client, reply: RecordDict({secure_sum.RECORD: ConfigRecord(
        {"key": bytes([9]) * 32, "sig": bytes(64)})}) if stage == "mr_setup" and client in M else reply)
    M.append(fed.ids[3])
    _summed(fed, 1, without=M)
    assert M[0] in fed.runs.barred


def test_a_batch_dealt_among_fewer_than_the_threshold_is_dealt_again_at_the_next_round():
    gone = []
    fed = Fed(tamper=lambda stage, client, reply: Error(code=0, reason="gone")
              if stage == "mr_deliver" and client in gone else reply)
    gone += fed.ids[:3]
    result, _, _ = fed.round(1)
    assert isinstance(result, RoundAbandoned) and "dealt again" in str(result) and 1 not in fed.runs.dealt
    gone.clear()
    _summed(fed, 2)


def test_a_refusal_naming_another_member_is_said_as_its_accusers_word():
    M, V = [], []
    fed = Fed(tamper=lambda stage, client, reply: Error(
        code=0, reason=f"secure aggregation refused: bad key (culprit: {V[0]})")
        if stage == "mr_setup" and client in M else reply)
    M.append(fed.ids[3])
    V.append(fed.ids[5])
    exchange = _summed(fed, 1, without=M)
    assert exchange.named[str(V[0])].startswith(f"named by {fed.roster.name(M[0])}:")


def _exchanges(fed, r) -> list[str]:
    return [stage for rr, stage, _ in fed.asked if rr == r and not stage.startswith("ride:")]


def _rides(fed, r) -> dict[str, list]:
    out = {}
    for rr, stage, who in fed.asked:
        if rr == r and stage.startswith("ride:"):
            out.setdefault(stage[5:], []).extend(who)
    return {k: sorted(v) for k, v in out.items()}


def test_each_later_batch_is_dealt_riding_on_the_two_rounds_before_it_and_every_round_after_the_first_is_two():
    """The design's top-up (§2, §13): the next batch's channel keys ride on the unmask two rounds before it, its
    dealing on the masked input of the round before, its delivery on that round's unmask; no round after the
    run's first has an exchange of the batch's own (they were three, every eighth round)."""
    fed = Fed()
    for r in range(1, 2 * BATCH + 2):
        _summed(fed, r)
    assert _exchanges(fed, 1) == ["mr_setup", "mr_deal", "mr_deliver", "mr_masked", "mr_unmask"]
    assert all(_exchanges(fed, r) == ["mr_masked", "mr_unmask"] for r in range(2, 2 * BATCH + 2))
    for first in (BATCH + 1, 2 * BATCH + 1):
        assert _rides(fed, first - 2) == {"mr_setup": fed.ids}
        assert _rides(fed, first - 1) == {"mr_deal": fed.ids, "mr_deliver": fed.ids}
        assert fed.runs.dealt[batch_of(first, BATCH)] == fed.ids
    assert not any(_rides(fed, r) for r in range(1, 2 * BATCH + 2) if r % BATCH not in (0, BATCH - 1))


def test_a_batch_whose_rides_too_few_answered_is_dealt_in_exchanges_of_its_own_at_its_first_round():
    """Fewer than the threshold gave their channel keys riding: no dealing rides, and the batch is set up at its
    first round as before; the members who did not answer a ride are not taken for culprits."""
    fed = Fed(tamper=lambda stage, client, reply: Error(code=0, reason="gone") if stage == "mr_setup" and
              client in fed.ids[:5] and fed.asked[-1][0] == BATCH - 1 else reply)
    for r in range(1, BATCH + 2):
        _summed(fed, r)
    assert _rides(fed, BATCH) == {}
    assert _exchanges(fed, BATCH + 1) == ["mr_setup", "mr_deal", "mr_deliver", "mr_masked", "mr_unmask"]
    assert not fed.runs.barred


def test_a_dealing_bent_in_its_ride_leaves_its_dealer_out_of_that_batch_and_the_round_carrying_it_is_summed():
    M = []

    def tamper(stage, client, reply):
        if stage == "mr_deal" and client in M and fed.asked[-1][0] == BATCH and not isinstance(reply, Error):
            dealing = unwire(reply[secure_sum.RECORD], "dealing")
            dealing["entries"].popitem()
            return RecordDict({secure_sum.RECORD: ConfigRecord({"dealing": wire(dealing)})})
        return reply

    fed = Fed(tamper=tamper)
    M.append(fed.ids[2])
    for r in range(1, BATCH + 1):
        _summed(fed, r)  # round BATCH carried the bent dealing: summed with every input
    assert fed.runs.dealt[2] == [i for i in fed.ids if i not in M]
    _summed(fed, BATCH + 1, without=M)


def _at(fed, r) -> bool:
    return fed.asked[-1][0] == r  # the round of the send being answered


def test_a_member_that_sat_a_batch_out_is_dealt_the_next_one_alone_and_sits_its_rounds():
    """A review: the rides went to the round's cohort only, so a member out of one batch (its delivery lost once)
    was never dealt another and sat the whole run out, unnamed; it is asked the rides alone."""
    V = []
    fed = Fed(tamper=lambda stage, client, reply: Error(code=0, reason="gone")
              if stage == "mr_deliver" and client in V and _at(fed, 1) else reply)
    V.append(fed.ids[-1])
    for r in range(1, BATCH + 1):
        _summed(fed, r, without=V)
    assert V[0] in _rides(fed, BATCH - 1)["mr_setup"] and V[0] in _rides(fed, BATCH)["mr_deliver"]
    _summed(fed, BATCH + 1)


def test_a_batch_whose_delivery_rides_seat_fewer_than_the_threshold_is_dealt_at_its_first_round():
    gone = []
    fed = Fed(tamper=lambda stage, client, reply: Error(code=0, reason="gone")
              if stage == "mr_deliver" and client in gone and _at(fed, BATCH) else reply)
    gone += fed.ids[:4]
    for r in range(1, BATCH + 1):
        _summed(fed, r)
    assert 2 not in fed.runs.dealt
    _summed(fed, BATCH + 1)
    assert _exchanges(fed, BATCH + 1) == ["mr_setup", "mr_deal", "mr_deliver", "mr_masked", "mr_unmask"]


@pytest.mark.parametrize("signature", [bytes(64), bytes(1 << 20)])
def test_an_acknowledgement_the_holder_did_not_sign_leaves_it_out_not_every_owner(signature):
    """A review: the server kept and shipped any acknowledgement, and a padded one made every owner refuse E1 in
    every round of the batch, its sender unnamed; now it is checked against the holder's key and the kept root."""
    H = []

    def tamper(stage, client, reply):
        if stage == "mr_deliver" and client in H and _at(fed, BATCH) and not isinstance(reply, Error):
            acks = read_map(reply[secure_sum.RECORD], "acks")
            write_map(reply[secure_sum.RECORD], "acks", {d: signature for d in acks})
        return reply

    fed = Fed(tamper=tamper)
    H.append(fed.ids[1])
    for r in range(1, BATCH + 1):
        _summed(fed, r)
    assert H[0] in fed.runs.barred and H[0] not in fed.runs.dealt[2]
    _summed(fed, BATCH + 1, without=H)


def test_a_channel_key_copied_from_another_holder_leaves_both_out_of_the_batch_and_it_is_dealt():
    """A review: a member that signed another holder's channel key as its own made every dealer refuse the batch
    ("two holders gave the same channel key"); the server leaves both out of it, named."""
    C, V = [], []

    def tamper(stage, client, reply):
        if stage == "mr_setup" and client in C and _at(fed, BATCH - 1):
            key = fed.members[V[0]].channel_key(2)["key"]
            sig = fed.members[C[0]].identity.sign(channel_message(fed.runs.tau, C[0], 2, key))
            return RecordDict({secure_sum.RECORD: ConfigRecord({"key": key, "sig": sig})})
        return reply

    fed = Fed(n=10, tamper=tamper)  # T = 7: a batch is dealt to T + f = 8 holders or more
    C.append(fed.ids[0])
    V.append(fed.ids[4])
    for r in range(1, BATCH + 1):
        _summed(fed, r)
    _summed(fed, BATCH + 1, without=C + V)
    assert fed.runs.dealt[2] == [i for i in fed.ids if i not in C + V] and not fed.runs.barred


def test_a_dealer_that_deals_a_batch_again_with_another_root_is_left_out_of_the_run():
    """A review: when the rides fall short the batch is dealt at its first round, and the server kept a second
    dealing with another root over the first, while its holders kept the first: their good shares then failed
    the kept commitments at the unmask."""
    gone, D = [], []

    def tamper(stage, client, reply):
        if stage == "mr_deliver" and client in gone and _at(fed, BATCH):
            return Error(code=0, reason="gone")
        if stage == "mr_deal" and client in D and _at(fed, BATCH + 1) and not isinstance(reply, Error):
            dealing = unwire(reply[secure_sum.RECORD], "dealing")
            dealing["root"] = bytes(32)
            return RecordDict({secure_sum.RECORD: ConfigRecord({"dealing": wire(dealing)})})
        return reply

    fed = Fed(tamper=tamper)
    gone += fed.ids[:4]
    D.append(fed.ids[5])
    for r in range(1, BATCH + 1):
        _summed(fed, r)
    _summed(fed, BATCH + 1, without=D)
    assert "dealt twice" in fed.runs.barred[D[0]]
