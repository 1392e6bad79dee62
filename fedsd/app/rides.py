"""A second stage's message riding in one Flower exchange: the server sends two messages to a node in
one, and the node's ClientApp hands them to the owner's data service one after the other, as two
messages, and answers both in one reply.

The multi-round protocol deals each batch of rounds ahead of its rounds (docs/design/multi-round-
secure-aggregation.md §2 and §13: "a top-up rides in an E1 reply ... at no extra exchange"): the next
batch's channel keys ride on the unmask two rounds before it, its dealing on the masked input of the
round before, and its delivery on that round's unmask. Without rides each batch cost three exchanges of
its own, every eighth round.

What this changes for an owner: nothing it checks. The owner's data service, the trust boundary,
receives the carrier and then the ride as two ordinary messages, each answered by its own kind's
handler with every check it makes alone (the server could have sent them one after the other). The
ride is forwarded only once the carrier was answered; a refused ride is said in the reply, the
carrier's answer stands. Which kind may ride on which is fixed here (`CARRIES`); anything else is
refused before either is forwarded, as is a ride in a ride.

The wire: the ride's records, each under `PREFIX` + its name, and `RECORD` = {"kind": the ride's kind}
beside the carrier's own records; the reply likewise, with `RECORD` = {"refused": why} where the ride
was refused.
"""
from __future__ import annotations

from collections.abc import Callable

from flwr.app import ConfigRecord, RecordDict

from fedsd.app import secure_sum

RECORD = "fedsd.ride"
PREFIX = RECORD + "/"
MAX_REASON = 300  # characters of a ride's refusal said back

# carrier kind → the kinds that may ride on it (the owners' service kinds, fedsd.app.secure_sum.KINDS)
CARRIES = {secure_sum.KINDS["mr_unmask"]: (secure_sum.KINDS["mr_setup"], secure_sum.KINDS["mr_deliver"]),
           secure_sum.KINDS["mr_masked"]: (secure_sum.KINDS["mr_deal"],)}


class RideError(ValueError):
    """A message whose ride the carrier may not carry, or that is not laid out as one."""


def carry(content: RecordDict, kind: str, ride: RecordDict) -> RecordDict:
    """`content` with `ride`, a message of `kind`, riding in it (a new RecordDict; both left as they are)."""
    out = RecordDict(dict(content.items()))
    for name, record in ride.items():
        out[PREFIX + name] = record
    out[RECORD] = ConfigRecord({"kind": kind})
    return out


def _split(content: RecordDict) -> tuple[RecordDict, RecordDict]:
    own = RecordDict({k: v for k, v in content.items() if k != RECORD and not k.startswith(PREFIX)})
    ride = RecordDict({k[len(PREFIX):]: v for k, v in content.items() if k.startswith(PREFIX)})
    return own, ride


def split(content: RecordDict, kind: str) -> tuple[RecordDict, str | None, RecordDict | None]:
    """(the carrier's own records, the ride's kind, the ride's records); (content, None, None) with no
    ride. RideError where a ride is there but `kind` may not carry it, or it is not laid out as one."""
    own, ride = _split(content)
    if RECORD not in content:
        if ride:
            raise RideError("a message with a ride's records but no ride")
        return content, None, None
    marker = content[RECORD]
    ride_kind = marker.get("kind") if isinstance(marker, ConfigRecord) and list(marker.keys()) == ["kind"] else None
    if ride_kind not in CARRIES.get(kind, ()):
        raise RideError(f"a message of kind {kind!r} carries no ride of kind {str(ride_kind)[:40]!r}")
    if not ride or any(name == RECORD or name.startswith(PREFIX) for name in ride.keys()):
        raise RideError("a ride is one message's records, with no ride in it")
    return own, ride_kind, ride


def answer(kind: str, content: RecordDict, reply_for: Callable[[str, RecordDict], RecordDict]) -> RecordDict:
    """The reply to a message and to what rides in it: `reply_for(kind, records)` answers each, the carrier
    first (its failure fails the message: nothing rides on it), then the ride, whose refusal is said in
    the reply beside the carrier's answer."""
    own, ride_kind, ride = split(content, kind)
    reply = reply_for(kind, own)
    if ride_kind is None:
        return reply
    try:
        ride_reply = reply_for(ride_kind, ride)
    except Exception as e:  # noqa: BLE001  (the ride's refusal, said; the carrier's answer stands)
        reply[RECORD] = ConfigRecord({"refused": f"{type(e).__name__}: {e}"[:MAX_REASON]})
        return reply
    for name, record in ride_reply.items():
        reply[PREFIX + name] = record
    reply[RECORD] = ConfigRecord({"answered": True})
    return reply


def reply_of(reply: RecordDict) -> tuple[RecordDict, RecordDict | None, str | None]:
    """(the carrier's reply, the ride's reply or None, why the ride was refused or None), from a member's
    reply (hostile: a ride's reply that is not laid out as one is a refused ride)."""
    own, ride = _split(reply)
    marker = reply[RECORD] if RECORD in reply else None
    if not isinstance(marker, ConfigRecord):
        return own, None, "no ride's reply"
    refused = marker.get("refused")
    if list(marker.keys()) == ["answered"] and marker["answered"] is True and ride:
        return own, ride, None
    return own, None, (refused[:MAX_REASON] if isinstance(refused, str) else "a ride's reply not laid out as one")
