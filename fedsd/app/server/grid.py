"""Flower's Grid, with a shorter wait between pulls for a round's replies, and a missing reply
known as missing at once.

flwr 1.41's deployed Grid (flwr/superlink/grid/http_grid.py, `send_and_receive`) sleeps 3 s
after every pull that leaves a reply outstanding, so each round ends up to 3 s after its last
client replied. This wrapper keeps every other method of the Grid it wraps and implements
`send_and_receive` over the Grid's public push_messages / pull_messages, pulling every
POLL_SECONDS instead.

Flower 1.43 (read in the flwr-nightly 1.43.0.dev20261026 wheel) changes two things under it:
- push_messages returns "" for a message the SuperLink did not take, where 1.42 raised;
- a reply whose objects cannot be pulled is logged ("Message … objects unavailable") and
  dropped, where 1.42 returned an error reply.
Either would leave an id outstanding until the round's timeout (an hour by default). Here a
message not taken gets an error reply at once, naming its node; and once every reply still
outstanding is one the Grid dropped, the wait ends and each gets an error reply. The strategy
then records those nodes as missing and the round goes on with the others.

A third change is in 1.43's SuperLink (servicer/runtime/runtime_handlers.py, pull_messages): the
error reply it makes for a node that went offline (its heartbeat lapsed) has no objects in its
store, so it logs the miss on its own side and cancels the reply; the ServerApp sees nothing.
1.42 delivered that reply. So every OFFLINE_CHECK_SECONDS the wait also asks which nodes are
online (the Grid's get_node_ids: ONLINE nodes only, in both versions), pulls once more, and
answers a message whose node is no longer online with an error reply naming it.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from contextlib import contextmanager

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedsd.app import packing

# Every 0.2 s: one request a pull, for all of a stage's replies. At 0.1 s, with every node's
# SuperExec polling at 0.1 s too, the pollers took enough of two cores from the training clients
# to make rounds slower and noisier (results/deploy-vs-sim.md); the SuperExecs now wait for their
# node's bell, and 0.5 s here left each stage's last reply unseen 0.25 s on average, twice a round
# (results/deploy-distributed.md).
POLL_SECONDS = 0.2
POLL_ENV = "FEDSD_GRID_POLL_SECONDS"  # another interval (Flower's own is 3), e.g. to measure the difference
# How often a wait asks which nodes are online (an offline node's reply will never come): an
# RPC, so not at every pull; a SuperLink marks a node offline a heartbeat period after it went.
OFFLINE_CHECK_SECONDS = 5.0


# Flower pulls a message's objects with a wait of 1 s, doubling up to 10 s, after each one its store
# does not hold yet (flwr/supercore/inflatable/inflatable_utils.py, `pull_objects`). A reply is seen
# by the ServerApp once its node's PushMessages is in, before its objects are pushed: a pull between
# the two waited out a second (in a deployed round of ten nodes, one reply in twenty). The first
# wait here is OBJECT_BACKOFF; the doubling, its cap and the number of tries are Flower's.
OBJECT_BACKOFF = 0.05


# Messages pushed in one request, with one object-push session (the SuperLink's, which it drops
# 180 s after its last object, or on a second session for the same message): a stage's messages to
# more nodes than this go in several, so that a session the SuperLink refuses costs those nodes alone.
PUSH_BATCH = 25
try:
    from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

    PUSH_ERRORS: tuple[type[BaseException], ...] = (ObjectPushError,)
except ImportError:  # another Flower: its errors stop the run, as they did
    PUSH_ERRORS = ()


def shorten_object_backoff() -> None:
    """Flower's deployed Grid pulls objects with OBJECT_BACKOFF as its first wait. Process-wide
    (the module Flower's Grid calls): the ServerApp's main sets it, once, at its start."""
    import functools
    import inspect

    try:
        from flwr.superlink.grid import http_grid
    except ImportError:  # another Flower: its waits as they are
        return
    pull = getattr(http_grid, "pull_objects", None)
    if not callable(pull) or isinstance(pull, functools.partial) or \
            "initial_backoff" not in inspect.signature(pull).parameters:  # another Flower, or set already
        return
    http_grid.pull_objects = functools.partial(pull, initial_backoff=OBJECT_BACKOFF)


def default_poll_seconds() -> float:
    """The wait between pulls: FEDSD_GRID_POLL_SECONDS, else POLL_SECONDS."""
    return float(os.environ.get(POLL_ENV, POLL_SECONDS))


class PollingGrid(Grid):
    def __init__(self, grid: Grid, poll_seconds: float | None = None):
        self.grid = grid
        self.poll_seconds = poll_seconds if poll_seconds is not None else default_poll_seconds()
        # Packed where a message travels as objects over the network (fedsd.app.packing); Flower's
        # in-memory grid (a simulation) hands each Message itself to its ClientApp: nothing to save.
        self.packs = not in_memory(grid)

    # -- everything but the waiting is the wrapped Grid's -----------------------------------
    def set_run(self, run):
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push the messages, then pull their replies until all are in or `timeout` passes (the
        contract of Flower's Grid.send_and_receive); a message not taken, or a reply dropped,
        answered at once by an error reply naming its node."""
        messages = list(messages)
        ids, refused = self._push(messages)
        replies = [missing(m, refused.get(n, "the SuperLink did not take the message for it"))
                   for n, (m, i) in enumerate(zip(messages, ids)) if not i]
        asked = {i: m for m, i in zip(messages, ids) if i}
        outstanding = set(asked)
        deadline = time.monotonic() + (timeout if timeout is not None else 0.0)
        next_offline_check = time.monotonic() + OFFLINE_CHECK_SECONDS
        with DroppedReplies() as dropped:
            while outstanding and (timeout is None or time.monotonic() < deadline):
                outstanding -= self._pull(outstanding, replies)
                if outstanding and dropped.count >= len(outstanding):  # what is left will never come
                    replies += [missing(asked[i], "its reply reached the SuperLink but could not be pulled from it")
                                for i in sorted(outstanding)]
                    break
                if outstanding and time.monotonic() >= next_offline_check:
                    next_offline_check = time.monotonic() + OFFLINE_CHECK_SECONDS
                    online = set(self.grid.get_node_ids())
                    gone = {i for i in outstanding if asked[i].metadata.dst_node_id not in online}
                    if gone:
                        gone -= self._pull(gone, replies)  # a reply that came in just before its node went
                        replies += [missing(asked[i], "it went offline (its heartbeat lapsed) before replying")
                                    for i in sorted(gone)]
                        outstanding -= gone
                if outstanding:
                    time.sleep(self.poll_seconds)
        replies = [unpacked(reply, asked.get(reply.metadata.reply_to_message_id)) for reply in replies]
        return [reply for reply in replies if reply is not None]

    def _push(self, messages: list[Message]) -> tuple[list[str], dict[int, str]]:
        """Push the messages PUSH_BATCH at a time (one Flower object-push session each); returns each
        message's id ("" where not taken) and, by position, why a batch was not taken. A batch whose
        objects the SuperLink refused (Flower's ObjectPushError: its push session expired or was
        replaced, as a SuperLink under a hundred nodes' polls did) leaves its messages unsent, each
        answered as missing, and the other batches go on: the round goes on without those nodes,
        as without any that drop out, where the whole ServerApp stopped."""
        ids, refused = [], {}
        with packed(messages if self.packs else []):
            for start in range(0, len(messages), PUSH_BATCH):
                batch = messages[start:start + PUSH_BATCH]
                try:
                    ids += list(self.grid.push_messages(batch))
                except PUSH_ERRORS as e:
                    logging.getLogger(__name__).warning("%d message(s) not sent: %s", len(batch), e)
                    ids += [""] * len(batch)
                    refused.update({start + n: f"the SuperLink refused the message's objects ({e})"
                                    for n in range(len(batch))})
        return ids, refused

    def _pull(self, ids: set[str], replies: list[Message]) -> set[str]:
        """Pull the replies to `ids` into `replies`; the ids answered."""
        pulled = list(self.grid.pull_messages(ids))
        replies.extend(pulled)
        return {m.metadata.reply_to_message_id for m in pulled}


@contextmanager
def packed(messages: list[Message]):
    """The messages with their content as one Flower object each while the `with` lasts
    (fedsd.app.packing: three requests at each hop where an ArrayRecord of a model made nine);
    each its own content again afterwards."""
    contents = [m.content if m.has_content() else None for m in messages]
    packs: dict[int, RecordDict] = {}  # a strategy sends one RecordDict to every node: packed once
    try:
        for message, content in zip(messages, contents):
            if content is not None:
                if id(content) not in packs:
                    packs[id(content)] = packing.pack(content)
                message.content = packs[id(content)]
        yield messages
    finally:
        for message, content in zip(messages, contents):
            if content is not None:
                message.content = content


def unpacked(reply: Message, asked: Message | None) -> Message | None:
    """A reply with the content its ClientApp packed; one whose packed content does not parse is
    an error reply naming its node, as one that never came (the strategy records it missing), and
    dropped (None, logged) where it answers nothing asked here."""
    if not reply.has_content() or not packing.is_packed(reply.content):
        return reply
    try:
        reply.content = packing.unpack(reply.content)
        return reply
    except packing.PackError as e:
        if asked is None:
            logging.getLogger(__name__).warning("a message that answers nothing asked, dropped: %s", e)
            return None
        return missing(asked, f"its reply does not parse: {e}")


def in_memory(grid: Grid) -> bool:
    try:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # another Flower: packed, as over a network
        return False
    return isinstance(grid, InMemoryGrid)


def missing(message: Message, why: str) -> Message:
    """An error reply to `message`, as the SuperLink makes for a node that is gone: the strategy
    records its node as missing the round, with this reason."""
    reason = f"node {message.metadata.dst_node_id}: {why}"
    return Message(Error(code=ErrorCode.REPLY_MESSAGE_UNAVAILABLE, reason=reason), reply_to=message)


class DroppedReplies(logging.Handler):
    """Counts the replies Flower's Grid drops while it pulls (1.43: it logs "Message <id> objects
    unavailable" and goes on without the reply), for as long as the `with` lasts."""

    MARK = "objects unavailable"

    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.MARK in str(record.msg):
            self.count += 1

    def __enter__(self) -> "DroppedReplies":
        logging.getLogger("flwr").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("flwr").removeHandler(self)
