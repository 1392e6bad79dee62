"""The ClientApp: local DP-SGD with self-distillation on this client's data (fedsd/app/client/handler.py).

Where a round runs: in a simulation, in this process (a Ray actor that lives across rounds).
On a deployed SuperNode whose owner runs a data service (node config `service=PATH`), this
code, which the server ships in the app bundle, only forwards the message to that service: the
owner's own installation, running as the user who alone can read the data, answers it
(fedsd/app/client/owner_service.py). Otherwise Flower starts this module in a fresh `flwr-clientapp`
process for every message, which would pay torch's import, the data's loading and the
trainer's set-up each round; there each message is handed to the node's warm worker, which
pays them once (the owner can say `worker=off`). So this module imports Flower and the node's
settings only; torch and fedsd's training load where the round runs.
"""
from __future__ import annotations

# An entry point: fedsd's process-wide speed settings, before torch loads (fedsd/runtime.py).
from fedsd.runtime import quiet_ray, tune_process

tune_process()
quiet_ray()  # before Flower's simulation engine starts Ray, which it does after importing this module

import os
from logging import WARNING

from flwr.app import Context, Message, RecordDict
from flwr.common import log
from flwr.clientapp import ClientApp

from fedsd.app.client import forward
from fedsd.app import packing, rides, secure_sum

app = ClientApp()
# Secure aggregation's keys live in the owner's data service, never in this process (the
# server's code); a simulation runs the protocol in its own process, not through ClientApps.
SECAGG_NEEDS_SERVICE = ("secure aggregation: this node has no owner's data service (node config service=...); "
                        "its stages are answered by the service alone, which holds the round's keys")


def answer(kind: str, msg: Message, context: Context) -> Message:
    # What a client writes while it answers (its ledger, its state, its prepared data) is its
    # own: umask 077 for the message, and the process's own umask back afterwards (a Ray actor,
    # or a test, answers in a process that writes other things too).
    # A message the ServerApp's Grid packed (fedsd.app.packing) is answered packed: one Flower
    # object a hop for its records. A second stage riding in it (fedsd.app.rides) goes to the
    # owner's service after the first, as a message of its own.
    umask = os.umask(0o077)
    try:
        asked = packing.is_packed(msg.content)
        content = rides.answer(kind, packing.unpack(msg.content), lambda k, records: reply_content(k, records, context))
        return Message(packing.pack(content) if asked else content, reply_to=msg)
    finally:
        os.umask(umask)


def reply_content(kind: str, content: RecordDict, context: Context) -> RecordDict:
    """The reply to a message of this kind: from the owner's data service, the node's warm worker
    or this process. A node with a service imports nothing more of fedsd (fedsd.app.client.forward)."""
    service = forward.service_of(context.node_config)
    if service:  # never answered here: this process cannot read the data
        return forward.ask_service(service, kind, content, context)
    from fedsd.app.client import node_config as node_configs, owner_service

    try:
        node = node_configs.parse(context.node_config)
    except node_configs.NodeConfigError:
        node = None  # said to the server by the round itself (a refusal naming the key)
    if node is not None and node.service:  # never answered here: this process cannot read the data
        return owner_service.ask_service(node, kind, content, context)
    if kind in owner_service.SECAGG_KINDS:
        raise ValueError(SECAGG_NEEDS_SERVICE)
    if node is not None and owner_service.wanted(node):
        try:
            return owner_service.ask_worker(node, kind, content, context)
        except owner_service.ServiceUnavailable as e:  # not taken: answered here, at the cold start's cost
            log(WARNING, "fedsd: %s; answering in the ClientApp's own process", e)
    from fedsd.app.client import handler

    return handler.HANDLERS[kind](content, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return answer("train", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return answer("evaluate", msg, context)


def _secagg_stage(stage: str):
    def handler(msg: Message, context: Context) -> Message:
        return answer(f"secagg-{stage}", msg, context)
    handler.__name__ = f"secagg_{stage}"
    return handler


for _stage in secure_sum.STAGES + secure_sum.RUN_STAGES:  # message type query.secagg_<stage>
    app.query(f"secagg_{_stage}")(_secagg_stage(_stage))
