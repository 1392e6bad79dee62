"""Flower's floor: the cheapest round a deployed Flower app can have.

Each round the ServerApp sends every SuperNode a model of the given shapes (float32 arrays)
and waits for all of them to send it back; the ClientApp returns what it received. Nothing
else is imported or done, so its round is Flower's own cost: a SuperNode's pull, a fresh
`flwr-clientapp` process per message, the transfers, and the ServerApp's wait for replies.
The ServerApp pulls replies as often as fedsd's does, and its messages and replies are packed as
fedsd's are (fedsd/app/server/grid.py, fedsd/app/packing.py), so the two differ only in what fedsd
does. It writes out-dir/floor.json: the seconds of every round.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedsd.app import packing
from fedsd.app.server.grid import PollingGrid

client_app = ClientApp()
server_app = ServerApp()


@client_app.train()
def echo(msg: Message, context: Context) -> Message:
    arrays = packing.unpack(msg.content)["arrays"]  # packed by fedsd's grid, answered packed, as fedsd's ClientApp
    return Message(packing.pack(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})),
                   reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    rounds, clients = int(config["num-server-rounds"]), int(config["num-clients"])
    grid = PollingGrid(grid)  # pulls as often as fedsd's ServerApp (same environment, same default)
    rng = np.random.default_rng(0)
    arrays = ArrayRecord([rng.standard_normal(shape).astype(np.float32) for shape in json.loads(config["shapes"])])
    nodes = wait_for_nodes(grid, clients, float(config["round-timeout"]))
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        messages = [Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train") for node in nodes]
        replies = list(grid.send_and_receive(messages, timeout=float(config["round-timeout"])))
        if len(replies) != clients or any(r.has_error() for r in replies):
            raise RuntimeError(f"floor: {len(replies)} of {clients} clients replied (errors: "
                               f"{[str(r.error) for r in replies if r.has_error()]})")
        seconds.append(time.perf_counter() - started)
    if config["out-dir"]:
        out = Path(str(config["out-dir"]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "floor.json").write_text(json.dumps({"round_seconds": seconds, "clients": clients}, indent=2) + "\n")


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"floor: {len(nodes)} of {count} SuperNodes connected after {timeout:.0f} s")
        time.sleep(0.1)
    return nodes[:count]
