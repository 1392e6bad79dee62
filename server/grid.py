"""Flower's Grid, with a shorter wait between pulls for a round's replies.

flwr 1.41's deployed Grid (flwr/superlink/grid/http_grid.py, `send_and_receive`) sleeps 3 s
after every pull that leaves a reply outstanding, so each round ends up to 3 s after its last
client replied. This wrapper keeps every other method of the Grid it wraps and implements
`send_and_receive` over the Grid's public push_messages / pull_messages, pulling every
POLL_SECONDS instead.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

# Every 0.5 s: at 0.1 s (with SuperExec's poll at 0.1 s too) the pollers took enough of two
# cores from the training clients to make rounds slower and noisier (results/deploy-vs-sim.md).
POLL_SECONDS = 0.5
POLL_ENV = "FEDSD_GRID_POLL_SECONDS"  # another interval (Flower's own is 3), e.g. to measure the difference


def default_poll_seconds() -> float:
    """The wait between pulls: FEDSD_GRID_POLL_SECONDS, else POLL_SECONDS."""
    return float(os.environ.get(POLL_ENV, POLL_SECONDS))


class PollingGrid(Grid):
    def __init__(self, grid: Grid, poll_seconds: float | None = None):
        self.grid = grid
        self.poll_seconds = poll_seconds if poll_seconds is not None else default_poll_seconds()

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
        contract of Flower's Grid.send_and_receive)."""
        outstanding = set(self.grid.push_messages(messages))
        deadline = time.monotonic() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while outstanding and (timeout is None or time.monotonic() < deadline):
            pulled = list(self.grid.pull_messages(outstanding))
            replies.extend(pulled)
            outstanding -= {m.metadata.reply_to_message_id for m in pulled}
            if outstanding:
                time.sleep(self.poll_seconds)
        return replies
