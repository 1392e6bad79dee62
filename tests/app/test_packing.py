"""A message's records as one Flower object (fedsd.app.packing): fewer objects, the same records,
identical messages one object still, and packed bytes from a member read as hostile."""
from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedsd.app import packing


def masked_stage() -> RecordDict:
    """What a secure round's masked-input message holds: the model, the run's settings, the stage's record."""
    arrays = ArrayRecord({"student/0.weight": Array(np.arange(39690, dtype=np.float32).reshape(10, 3969)),
                          "student/0.bias": Array(np.ones(10, dtype=np.float32))})
    return RecordDict({"secagg": ConfigRecord({"server-round": 3, "cohort": [5, 7, 9], "acks": b"\x01" * 64}),
                       "arrays": arrays, "config": ConfigRecord({"lr": 3.0, "method": "dp3sd"}),
                       "metrics": MetricRecord({"epsilon": 1.5})})


def objects(content: RecordDict) -> int:
    return len(get_all_nested_objects(content)) + 1  # and the message


def test_packed_records_are_one_object_and_unpack_to_the_same_records():
    content = masked_stage()
    packed = packing.pack(content)
    assert objects(content) == 10 and objects(packed) == 3
    back = packing.unpack(packed)
    assert sorted(back.keys()) == sorted(content.keys())
    for name in ("student/0.weight", "student/0.bias"):
        assert np.array_equal(back["arrays"][name].numpy(), content["arrays"][name].numpy())
    assert dict(back["secagg"]) == dict(content["secagg"]) and dict(back["config"]) == dict(content["config"])
    assert dict(back["metrics"]) == dict(content["metrics"])
    assert packing.unpack(content) is content  # what is not packed goes as it is


def test_the_same_records_packed_twice_are_one_object_the_superlink_stores_once():
    assert packing.pack(masked_stage())[packing.RECORD].object_id == \
        packing.pack(masked_stage())[packing.RECORD].object_id


def test_content_larger_than_the_bound_goes_as_flower_chunks_it():
    big = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(packing.MAX_PACKED // 4 + 1, np.float32))})})
    assert packing.pack(big) is big


@pytest.mark.parametrize("record, needle", [
    (ConfigRecord({packing.FIELD: b"\xff\xff\xff"}), "not Flower's RecordDict"),
    (ConfigRecord({packing.FIELD: "text"}), "at most"),
    (ConfigRecord({packing.FIELD: b"\x00" * (packing.MAX_PACKED + 1)}), "at most"),
    (ConfigRecord({packing.FIELD: b"", "more": 1}), "one field"),
    (MetricRecord({packing.FIELD: 1.0}), "one field"),
])
def test_packed_bytes_that_are_not_records_are_refused_with_the_fault(record, needle):
    with pytest.raises(packing.PackError, match=needle):
        packing.unpack(RecordDict({packing.RECORD: record}))


def test_more_records_than_a_message_holds_are_refused():
    many = packing.pack(RecordDict({f"m{i}": MetricRecord({"a": 1.0}) for i in range(packing.MAX_RECORDS + 1)}))
    with pytest.raises(packing.PackError, match="over the 64 allowed"):
        packing.unpack(many)


def test_records_packed_twice_are_refused():
    twice = packing.pack(packing.pack(RecordDict({"m": MetricRecord({"a": 1.0})})))
    with pytest.raises(packing.PackError, match="packed again"):
        packing.unpack(twice)


class PackingNodes:
    """A Grid whose node 21 answers with the records it was sent, packed as a ClientApp packs its
    reply, whose node 22 answers with packed bytes that are not records, and that also hands over
    a message with such bytes that answers nothing asked."""

    def push_messages(self, messages):
        self.sent = {}
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.sent[m.metadata.message_id] = (m, m.content)
        return list(self.sent)

    def pull_messages(self, message_ids):
        replies = []
        for i in message_ids:
            asked, content = self.sent[i]
            assert packing.is_packed(content)
            answer = packing.pack(packing.unpack(content)) if asked.metadata.dst_node_id == 21 else \
                RecordDict({packing.RECORD: ConfigRecord({packing.FIELD: b"\x0a\xff"})})
            replies.append(Message(answer, reply_to=asked))
        stray = Message(RecordDict(), dst_node_id=23, message_type="query.x")
        stray.metadata.__dict__["_message_id"] = "not-asked"
        garbage = RecordDict({packing.RECORD: ConfigRecord({packing.FIELD: b"\x0a\xff"})})
        replies.append(Message(garbage, reply_to=stray))
        return replies


def test_the_grid_sends_packed_and_a_reply_that_does_not_unpack_is_its_node_missing(flower_task):
    from fedsd.app.server.grid import PollingGrid

    stage = masked_stage()  # one RecordDict to every node, as a strategy sends
    messages = [Message(content=stage, dst_node_id=node, message_type="query.x") for node in (21, 22)]
    nodes = PackingNodes()
    answered = PollingGrid(nodes, poll_seconds=0.05).send_and_receive(messages, timeout=30)
    replies = {r.metadata.src_node_id: r for r in answered}
    assert len(answered) == 2  # the stray message that answers nothing asked is dropped
    assert [m.content for m in messages] == [stage, stage]  # the caller's messages as they were
    first, second = (content for _, content in nodes.sent.values())
    assert first is second  # packed once for both
    sent = {21: stage}
    assert np.array_equal(replies[21].content["arrays"]["student/0.weight"].numpy(),
                          sent[21]["arrays"]["student/0.weight"].numpy())
    bad = next(r for r in replies.values() if r.has_error())
    assert "node 22: its reply does not parse" in bad.error.reason
