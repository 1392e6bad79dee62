"""A message's records as one Flower object, and back: what the ServerApp's Grid sends and what a
ClientApp answers.

Why: Flower sends a message as a tree of objects (the message, its RecordDict, each record, each
array of an ArrayRecord and each chunk of an array), and each object is its own request at every
hop of a deployment: the SuperNode pulls each from the SuperLink, the node's ClientApp task each
from its SuperNode, and the ServerApp each of a reply's. A secure round's masked-input message
was nine objects (two config records, the model's ArrayRecord, its two arrays and their two
chunks); packed, it is three (the message, its RecordDict and one ConfigRecord holding the
records' bytes), and its reply five to three. The bytes are Flower's own protobuf serialisation
of the RecordDict (`flwr.common.serde`, as an owner's data service already reads them),
deterministic, so ten identical messages are still one object the SuperLink stores once.

Content larger than MAX_PACKED goes as it is: no packed object is larger than the chunks Flower
itself sends (5 MiB by default), and a large model's cost is its bytes, not its requests.

What is unpacked is read as hostile: at most MAX_PACKED bytes are parsed (Flower has pulled the
record whole before: the bound is on what is parsed, as a plain reply's records are bounded by
nothing but Flower's own limits), into at most MAX_RECORDS of Flower's records, or refused
(PackError) with what was wrong; nothing else in the message is taken.
"""
from __future__ import annotations

from flwr.app import ConfigRecord, RecordDict

RECORD = "fedsd.packed"  # the one record of a packed message's content
FIELD = "records"  # its one field: the RecordDict's protobuf bytes
MAX_PACKED = 4 << 20  # bytes: under Flower's 5 MiB array chunks
MAX_RECORDS = 64  # records in a packed RecordDict (fedsd's messages hold at most a handful)


class PackError(ValueError):
    """Packed content that is not a RecordDict (the reason names the fault, nothing of the data)."""


def pack(content: RecordDict) -> RecordDict:
    """`content` as one ConfigRecord of its protobuf bytes; as it is when larger than MAX_PACKED."""
    from flwr.common.serde import recorddict_to_proto

    raw = recorddict_to_proto(content).SerializeToString(deterministic=True)
    if len(raw) > MAX_PACKED:
        return content
    return RecordDict({RECORD: ConfigRecord({FIELD: raw})})


def is_packed(content: RecordDict) -> bool:
    return list(content.keys()) == [RECORD]


def records_from_bytes(raw: bytes, max_records: int | None = None) -> RecordDict:
    """Flower's RecordDict from its protobuf bytes, as Flower's own serde builds it; ValueError,
    saying why, for bytes that do not parse as one or that hold more than `max_records` records.
    The one parse of hostile records: the packed messages here and the owner's service wire."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    proto = ProtoRecordDict()
    try:
        proto.ParseFromString(raw)
        count = len(proto.items)
        records = None if max_records is not None and count > max_records else recorddict_from_proto(proto)
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError, or records Flower cannot build)
        raise ValueError(f"records that are not Flower's RecordDict ({type(e).__name__})") from None
    if records is None:
        raise ValueError(f"records: {count}, over the {max_records} allowed")
    return records


def unpack(content: RecordDict) -> RecordDict:
    """The records `pack` packed; content not packed as it is. PackError for a packed record that
    is not one field of at most MAX_PACKED bytes of a RecordDict."""
    if not is_packed(content):
        return content
    record = content[RECORD]
    if not isinstance(record, ConfigRecord) or list(record.keys()) != [FIELD]:
        raise PackError(f"a packed message's record holds one field, {FIELD!r}")
    raw = record[FIELD]
    if not isinstance(raw, bytes) or len(raw) > MAX_PACKED:
        raise PackError(f"a packed message's records are at most {MAX_PACKED} bytes")
    try:
        out = records_from_bytes(raw, MAX_RECORDS)
    except ValueError as e:
        raise PackError(f"packed {e}") from None
    if is_packed(out):
        raise PackError("packed records that are packed again")
    return out
