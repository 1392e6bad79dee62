"""Multi-round secure aggregation in the owner's data service (the protocol: fedsd.secure.secagg_runs;
docs/design/multi-round-secure-aggregation.md, step 5 of its migration): each kind of a run set up
once answered by the process that holds the data, the ledger, the identity key and the owner's record.

A member's state lives in its state folder, `secagg-run-<run>-<experiment>.sealed`, sealed under the
wrap key in the owner's record (fedsd.privacy.owner_record.Records.wrap_key), so a copy of the folder
opens nothing; its counters (the last round it masked, answered, viewed, dealt, and the latest it was
asked about) are raised in that record before it replies, and mirrored in the folder. Every message
is hostile until checked, as in the per-round stages (fedsd.app.client.secure_stages): its fields, its
round (the run's tag is derived here from the run and the experiment), the owner's t and f. A
refusal is a `StageRefused`, before anything is charged: the masked-input kind checks the cohort, every
member's dealing and the acknowledgements of its batch (`RunMember.admit`, which raises `submitted`
in the record), then charges and trains as today's masked stage (fedsd.app.client.secure_contribution),
then masks. Multi-round needs a roster and the owner's record (own data): without them it is refused.

The ServerApp sends them under run config `secure-sum = multi-round` (fedsd.app.server.run_exchange).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from fedsd.errors import ConfigError
from fedsd.secure.secagg_primitives import ProtocolError, round_digest, run_tag
from fedsd.secure.secagg_runs import Counters, RunMember
from fedsd.app import secure_sum
from fedsd.app.secure_sum import BadMessage, read_map, write_map

from fedsd.app.client.secure_contribution import contribution, distributed_contribution
from fedsd.app.client.secure_owner import Owner, _refused, keep_input
from fedsd.app.client.secure_stages import _stage_fields

log = logging.getLogger("fedsd.secure_aggregation")
# A JSON-encoded field from the server: at most this many bytes. The largest the protocol sends is a
# holder's deliveries, 128 dealers' batches (about 3 MB as JSON); decoding costs about 25 times its size.
MAX_ENCODED = 8 << 20


def _fields(content: RecordDict, context: Context) -> tuple[tuple, ConfigRecord, Owner]:
    key, record, owner = _stage_fields(content, context)
    if owner.roster is None:
        raise ProtocolError("multi-round secure aggregation needs the owner's roster (secagg-roster)")
    if owner.node.records() is None:
        raise ProtocolError("multi-round secure aggregation needs the owner's own data and its record (record-dir)")
    return key, record, owner


def _counters(found: dict) -> Counters:
    viewed = found.get("viewed") or [0, ""]
    return Counters(submitted=found["submitted"], answered=found["answered"], dealt=found["dealt"],
                    seen=found["seen"], viewed=(int(viewed[0]), bytes.fromhex(viewed[1])))


def _found(c: Counters) -> dict:
    return dict(submitted=c.submitted, answered=c.answered, dealt=c.dealt, seen=c.seen,
                viewed=[c.viewed[0], c.viewed[1].hex()])


@contextmanager
def member_of(owner: Owner, key: tuple):
    """This owner's member of the run `key` names, as its state folder and record keep it: its
    counters the record's (raised to the folder's mirror), its state unsealed; after the block, the
    record raised first, then the folder's sealed state and mirror written (a crash between the two
    leaves a folder behind its record, whose older secrets the counters then never use)."""
    state, records = owner.node.state(), owner.node.records()
    name = f"secagg-run-{key[1]}-{key[2]}"
    wrap = records.wrap_key(state)
    with state.lock(name + ".lock"):
        mirror = state.read_json(name + ".json") or {}
        with records.run_counters(state, f"{key[1]}|{key[2]}", dict(mirror).get("counters", {})) as found:
            node = owner.node
            member = RunMember(owner.identity, owner.roster, run_tag(secure_sum.round_id(key[1], key[2], 0)),
                               node.secagg_min_clients, node.secagg_max_colluders, counters=_counters(found))
            blob = state.read_bytes(name + ".sealed")
            if blob is not None:
                try:
                    member.unseal(blob, wrap)
                except ProtocolError as e:  # a folder copied without its record: it starts with nothing
                    log.warning("secure aggregation: %s", e)
            yield member
            found.update(_found(member.counters))
        if member.holders or blob is not None:  # a run never set up leaves nothing behind
            state.write_atomic(name + ".sealed", member.sealed(wrap))
            state.write_json(name + ".json", {"counters": _found(member.counters)})


def _encoded_field(record: ConfigRecord, name: str):
    return secure_sum.unwired(record, name, MAX_ENCODED)


def _reply(**fields) -> RecordDict:
    return RecordDict({secure_sum.RECORD: ConfigRecord(fields)})


def _answered(handler):
    """A kind's refusals as StageRefused, its reason the protocol's (nothing of the data)."""
    def answer(content: RecordDict, context: Context) -> RecordDict:
        try:
            return handler(content, context)
        except (BadMessage, ProtocolError, ConfigError, TypeError) as e:
            raise _refused(e) from None
    answer.__doc__, answer.__name__ = handler.__doc__, handler.__name__
    return answer


@_answered
def setup_reply(content: RecordDict, context: Context) -> RecordDict:
    """The run's holders and threshold (set once; the owner's t and f checked); this member's signed
    channel key for the batch asked."""
    key, record, owner = _fields(content, context)
    with member_of(owner, key) as member:
        member.setup(list(record.get("holders", [])), record.get("threshold"), key[3])
        channel = member.channel_key(record.get("batch"))
    return _reply(key=channel["key"], sig=channel["sig"])


@_answered
def deal_reply(content: RecordDict, context: Context) -> RecordDict:
    """Every holder's signed channel key for a batch; this member's dealing of it (once; asked again,
    the same reply)."""
    key, record, owner = _fields(content, context)
    keys, sigs = read_map(record, "channel-keys"), read_map(record, "channel-sigs")
    if set(keys) != set(sigs):
        raise BadMessage("channel-keys and channel-sigs name different holders")
    with member_of(owner, key) as member:
        dealing = member.deal(record.get("batch"), {h: {"key": keys[h], "sig": sigs[h]} for h in keys})
    return _reply(dealing=secure_sum.wire(dealing))


@_answered
def deliver_reply(content: RecordDict, context: Context) -> RecordDict:
    """Each dealer's batch for this holder; an acknowledgement of each that checks, and the dealers
    whose did not (named, never a reason to refuse a round)."""
    key, record, owner = _fields(content, context)
    dealings = _encoded_field(record, "dealings")
    if not isinstance(dealings, dict):
        raise BadMessage("dealings: a map of dealer to its batch was expected")
    acks, refused = {}, []
    with member_of(owner, key) as member:
        for dealer, dealing in dealings.items():
            try:
                acks[dealer] = member.deliver(dealer, record.get("batch"), dealing)
            except ProtocolError as e:
                log.warning("secure aggregation: %s", e)
                refused.append(dealer if isinstance(dealer, int) and not isinstance(dealer, bool)
                               and 0 <= dealer <= secure_sum.MAX_ID else -1)
    out = ConfigRecord({"refused": refused})
    write_map(out, "acks", acks)
    return RecordDict({secure_sum.RECORD: out})


def _round_digest(content: RecordDict, key: tuple) -> bytes:
    config, arrays = content.get("config"), content.get("arrays")
    if not isinstance(config, ConfigRecord) or not isinstance(arrays, ArrayRecord):
        raise BadMessage("the round's settings and model were expected beside its stage record")
    if (config.get("experiment-id"), config.get("server-round")) != key[2:4]:
        raise BadMessage("the round's settings name another experiment or round than its stage record")
    return round_digest(secure_sum.settings_digest(config), [arrays[k].numpy() for k in sorted(arrays)])


@_answered
def masked_reply(content: RecordDict, context: Context) -> RecordDict:
    """E1: the cohort and the acknowledgements of every member's batch, with the round's settings and
    model; admitted (nothing charged before), then this owner's vector (charged and trained as in the
    per-round masked stage), masked, with its signed receipt."""
    key, record, owner = _fields(content, context)
    digest, cohort = _round_digest(content, key), list(record.get("cohort", []))
    owner.refuse_spoilers(key, record.get("evidence"), cohort)
    acks = _encoded_field(record, "acks")
    with member_of(owner, key) as member:  # the record says `submitted` before anything is charged
        sent = member.sent(key[3])  # a lost reply: sent again as it was, nothing trained or charged
        if sent is None:
            # one input a round, whichever protocol asks: the per-round stages' record of the rounds
            # joined is raised here too (a review released a round both ways)
            owner.join(key)
            member.admit(key[3], cohort, digest, acks)
    if sent is not None:
        return _masked_out(sent, digest, member.needed)
    distributed = content["config"].get("noise") == "distributed"
    vector, metrics = (distributed_contribution if distributed else contribution)(content, context, owner)
    with member_of(owner, key) as member:
        sent = member.mask(key[3], np.asarray(vector, dtype=np.uint64))
    if owner.node.secagg_keep_inputs:
        keep_input(owner, key, vector)
    log.info("secure aggregation: round %d's masked input (%d values) sent", key[3], len(vector))
    return _masked_out(sent, digest, member.needed, metrics)


def _masked_out(sent: dict, digest: bytes, needed: int, metrics=None) -> RecordDict:
    """E1's reply: y, and the receipt with what it signed beside y's digest (metrics: none for a resend)."""
    reply = RecordDict({secure_sum.RECORD: ArrayRecord({"masked": Array(sent["y"])}),
                        "receipt": ConfigRecord({"sig": sent["receipt"], "digest": digest, "needed": needed})})
    if metrics is not None:
        reply["metrics"] = metrics
    return reply


@_answered
def unmask_reply(content: RecordDict, context: Context) -> RecordDict:
    """E2, nobody dropped: the cohort's receipts; this holder's share of every member's self mask."""
    key, record, owner = _fields(content, context)
    receipts = _encoded_field(record, "receipts")
    with member_of(owner, key) as member:
        answer = member.unmask(key[3], list(record.get("cohort", [])), receipts)
    out = ConfigRecord({})
    write_map(out, "b", answer["b"])
    return RecordDict({secure_sum.RECORD: out})


@_answered
def view_reply(content: RecordDict, context: Context) -> RecordDict:
    """E2', someone dropped: the survivors with their receipts and the dropped; this holder's
    signature of that one view."""
    key, record, owner = _fields(content, context)
    receipts = _encoded_field(record, "receipts")
    with member_of(owner, key) as member:
        signature = member.view(key[3], list(record.get("survivors", [])), list(record.get("dropped", [])), receipts)
    return _reply(sig=signature)


@_answered
def unmask_view_reply(content: RecordDict, context: Context) -> RecordDict:
    """E3: the holders' signatures of the view; the survivors' self-mask shares and the dropped
    members' key shares, never both for one member."""
    key, record, owner = _fields(content, context)
    with member_of(owner, key) as member:
        answer = member.unmask_view(key[3], read_map(record, "signatures"))
    out = ConfigRecord({})
    write_map(out, "b", answer["b"])
    write_map(out, "s", answer["s"])
    return RecordDict({secure_sum.RECORD: out})


HANDLERS = {secure_sum.KINDS[stage]: handler for stage, handler in zip(secure_sum.RUN_STAGES, (
    setup_reply, deal_reply, deliver_reply, masked_reply, unmask_reply, view_reply, unmask_view_reply))}
