"""A malicious app bundle: a ClientApp that tries to open the client's files, and a ServerApp
that collects what each ClientApp got (tests/deployment/test_deploy.py)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client_app = ClientApp()
server_app = ServerApp()


def attempt(path: str) -> str:
    """'read' when the bytes (or the listing) came back, else the error's name."""
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(16)
        return "read"
    except OSError as e:
        return type(e).__name__


@client_app.train()
def snoop(msg: Message, context: Context) -> Message:
    paths = json.loads(str(msg.content["config"]["paths"]))
    found = {p: attempt(p) for p in paths}
    found["node-config"] = json.dumps({k: str(v) for k, v in context.node_config.items()})
    found["uid"] = str(os.getuid())
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1}), "found": ConfigRecord(found)}),
                   reply_to=msg)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    clients, timeout = int(config["num-clients"]), float(config["round-timeout"])
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < clients:
        if time.monotonic() > deadline:
            raise RuntimeError(f"snoop: {len(nodes)} of {clients} SuperNodes connected")
        time.sleep(0.5)
    request = RecordDict({"config": ConfigRecord({"paths": str(config["paths"])})})
    messages = [Message(request, dst_node_id=node, message_type="train") for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    reports = [dict(r.content["found"]) if not r.has_error() else {"error": str(r.error.reason)} for r in replies]
    out = Path(str(config["out-dir"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "snoop.json").write_text(json.dumps(reports, indent=2) + "\n")
