"""What secure aggregation's messages carry, shared by the ServerApp (fedsd/app/server/secure_rounds.py)
and the owners' data services (fedsd/app/client/secure_stages.py): the five stages' message types,
the round id both sides derive, maps of client id to bytes as ConfigRecord lists, and a model
update as the uint64 vector the protocol sums (fedsd.secure.secagg), and back.

A map {id: bytes} travels as two lists of one length, "<name>-ids" and "<name>-values"; what
comes from the other side is hostile, so `read_map` checks both before anything uses them. On a
ring, a member's signed set of the neighbours it masked with travels as one bytes value
(`packed_set`).
"""
from __future__ import annotations

import hashlib

import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

# The stages as Flower message types ("query.<action>") and as the data service's kinds.
STAGES = ("identify", "advertise", "share", "masked", "confirm", "unmask")
# A multi-round run's (fedsd.secure.secagg_runs; the owner's side: fedsd/app/client/run_stages.py)
RUN_STAGES = ("mr_setup", "mr_deal", "mr_deliver", "mr_masked", "mr_unmask", "mr_view", "mr_unmask_view")
MESSAGE_TYPES = {stage: f"query.secagg_{stage}" for stage in STAGES + RUN_STAGES}
KINDS = {stage: f"secagg-{stage}" for stage in STAGES + RUN_STAGES}
KEY_FIELDS = ("c", "s", "v", "sig")  # a client's stage-0 keys: its two X25519 keys, its signing key, its signature
RECORD = "secagg"  # the stage's own fields, beside a masked-input message's "config" and "arrays"
SCALE = 2 ** 20  # a float update's fixed point: x → round(x · 2^20), as int64 in a uint64
MAX_ID = (1 << 63) - 1
MASKED_SET = "secagg-masked-set"  # a ring member's masked reply: its signed M (`packed_set`), as "set"


class BadMessage(ValueError):
    """A stage message whose fields are not what the stage carries; the text names the field."""


def secagg_id(node_id: int) -> int:
    """A Flower node id (64 bits, unsigned) as the protocol's client id, which a ConfigRecord
    carries as a signed 64-bit integer: its low 63 bits. Both sides derive it; two nodes that
    share one are refused by the protocol (an id twice), never confused."""
    return int(node_id) & MAX_ID


def round_id(run_id: int, experiment_id: str, server_round: int) -> bytes:
    """The id both sides bind a round's shares and masks to: the Flower run, the experiment and
    the round (never a string the other side chose)."""
    return f"fedsd|{int(run_id)}|{experiment_id}|{int(server_round)}".encode()


def settings_digest(config: ConfigRecord | None) -> bytes:
    """SHA-256 of a round's settings (the "config" record its advertise and masked-input messages
    carry: the run's settings, and with distributed noise the plan): what each client signs at
    advertise, so that clients given different settings cannot go on together, and what the
    masked-input message's settings must match. Values by their repr (a float's is exact),
    keys sorted; no config, no bytes."""
    if not isinstance(config, ConfigRecord):
        return b""
    items = sorted((str(k), v) for k, v in dict(config).items())
    return hashlib.sha256(repr([(k, type(v).__name__, v) for k, v in items]).encode()).digest()


def write_map(record: ConfigRecord, name: str, values: dict[int, bytes]) -> None:
    ids = sorted(values)
    record[f"{name}-ids"] = ids
    record[f"{name}-values"] = [bytes(values[i]) for i in ids]


def wire(value) -> bytes:
    """A protocol value (fedsd.secure.secagg_runs.encoded: bytes and int keys kept) as one bytes field."""
    import json

    from fedsd.secure.secagg_runs import encoded  # where it is used: the forwarding ClientApp imports this module

    return json.dumps(encoded(value)).encode()


def unwired(record: ConfigRecord, name: str, limit: int):
    """The value of a bytes field `wire` wrote, at most `limit` bytes (decoding costs about 25 times its
    size); BadMessage for anything else, whichever side reads it."""
    import json

    from fedsd.secure.secagg_runs import decoded

    raw = record.get(name)
    if not isinstance(raw, bytes) or len(raw) > limit:
        raise BadMessage(f"{name}: one bytes field of at most {limit} bytes was expected")
    try:
        return decoded(json.loads(raw))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise BadMessage(f"{name}: not the protocol's encoding") from None


def packed_set(entry: dict) -> bytes:
    """A ring member's signed M (fedsd.secure.secagg.SecAggClient.masked_set) as one bytes value:
    its 64-byte signature, then the ids it masked with, 8 bytes each, big-endian."""
    return bytes(entry["sig"]) + np.asarray(entry["with"], dtype=">u8").tobytes()


def unpacked_set(value: object) -> dict | None:
    """`packed_set` read back (from its bytes, or a masked reply's MASKED_SET record), or None for
    anything that is not one (64 bytes and a whole number of ids, at most 256 of them); the
    signature is for the protocol to check."""
    if isinstance(value, RecordDict):
        record = value.get(MASKED_SET) if MASKED_SET in value else None
        value = record.get("set") if isinstance(record, ConfigRecord) else None
    if not isinstance(value, bytes) or len(value) < 64 or (len(value) - 64) % 8 or len(value) > 64 + 8 * 256:
        return None
    return {"sig": value[:64], "with": [int(i) for i in np.frombuffer(value[64:], dtype=">u8")]}


def read_map(record: ConfigRecord, name: str, max_items: int = 1 << 16) -> dict[int, bytes]:
    ids, values = record.get(f"{name}-ids", []), record.get(f"{name}-values", [])
    if not isinstance(ids, list) or not isinstance(values, list) or len(ids) != len(values) or len(ids) > max_items:
        raise BadMessage(f"{name}: two lists of one length (ids, values) were expected")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID for i in ids):
        raise BadMessage(f"{name}: client ids are integers in [0, 2^63)")
    if not all(isinstance(v, bytes) for v in values):
        raise BadMessage(f"{name}: the values are bytes")
    if len(set(ids)) != len(ids):
        raise BadMessage(f"{name}: an id appears twice")
    return dict(zip(ids, values))


def float_keys(arrays: ArrayRecord) -> list[str]:
    """The arrays an update moves (the floating ones), in the order the vector holds them."""
    return sorted(k for k in arrays if np.issubdtype(np.dtype(arrays[k].dtype), np.floating))


def vector_length(arrays: ArrayRecord) -> int:
    return int(sum(int(np.prod(arrays[k].shape)) for k in float_keys(arrays)))


def update_vector(old: ArrayRecord, new: ArrayRecord, max_norm: float = math.inf) -> np.ndarray:
    """new − old over the floating arrays, flattened, scaled down to L2 norm `max_norm` where it
    is above it (the run's public bound on an honest update: fedsd.secure.sum_bound), in fixed
    point, as uint64 (mod 2^64)."""
    keys = float_keys(old)
    if keys != float_keys(new) or any(old[k].shape != new[k].shape for k in keys):
        raise BadMessage("the update's arrays are not the global model's")
    delta = np.concatenate([(new[k].numpy().astype(np.float64) - old[k].numpy().astype(np.float64)).ravel()
                            for k in keys]) if keys else np.zeros(0)
    norm = float(np.linalg.norm(delta))
    if not norm <= max_norm:  # a NaN too: the whole update is left out, not sent as garbage
        delta = delta * (max_norm / norm) if math.isfinite(norm) and norm > 0 else np.zeros_like(delta)
    return np.round(delta * SCALE).astype(np.int64).view(np.uint64)


def apply_sum(arrays: ArrayRecord, total: np.ndarray, count: int) -> ArrayRecord:
    """The global model moved by the mean of `count` clients' updates, from their sum (uint64)."""
    mean = np.asarray(total, dtype=np.uint64).view(np.int64).astype(np.float64) / SCALE / count
    offsets, at = {}, 0
    for key in float_keys(arrays):
        offsets[key], at = at, at + int(np.prod(arrays[key].shape))
    if at != len(mean):
        raise BadMessage(f"a sum of {len(mean)} values for a model of {at}")
    out = {}
    for key in arrays:
        a = arrays[key].numpy()
        if key in offsets:
            a = (a.astype(np.float64) + mean[offsets[key]:offsets[key] + a.size].reshape(a.shape)).astype(a.dtype)
        out[key] = Array(np.ascontiguousarray(a))
    return ArrayRecord(out)
