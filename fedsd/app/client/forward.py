"""The ClientApp's side of an owner's data service: hand a message to the service listening at a
Unix socket and read its answer (the service's side: fedsd/app/client/owner_service.py).

Kept apart, and light, because on a deployed SuperNode Flower starts a ClientApp task for every
message, and a task pays every import it makes: with a service, this module, the wire's frames
and the message's packing are all of fedsd a task imports (the ClientApp's import took 9 ms, not
32). The node's settings and the service's own code (node_config, owner_service) load only where
the node has no service: twenty tasks a secure round of ten owners each paid them.
"""
from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.app import Context, RecordDict
# The wire's frames (and with them Flower) load where a message is sent, not on import: the node
# config's module imports SUPERNODE_WITH_SERVICE from here, and commands without Flower
# (`fedsd ledger`) import that.

TAKEN = {"status": "taken"}  # the service's word that it has the message and will answer it
# With service=...: what the SuperNode's own node config holds (the rest is the service's).
SUPERNODE_WITH_SERVICE = ("partition-id", "num-partitions", "service")
# A Unix socket's address is at most 107 bytes. A state folder deeper than that (a long home,
# a test's temporary folder) keeps its socket: bind and connect reach it through an open
# descriptor of its folder (/proc/self/fd/N/NAME, Linux), where the path alone would fail.
SUN_PATH_MAX = 107


class ServiceError(RuntimeError):
    """The data service stopped while answering a message it had taken, or said it failed."""


class ServiceUnavailable(RuntimeError):
    """No data service could be started or reached; the message was not taken."""


def service_of(node_config: Mapping) -> str | None:
    """The service a SuperNode's node config forwards to, where it is in the form a node with a
    service has (SUPERNODE_WITH_SERVICE's keys only, `service` a path, partition-id a number ≥ 0,
    which the service checks against its own); else None, and the
    ClientApp reads the node config whole (fedsd.app.client.node_config: every mistake named).
    The service checks what it is sent against its owner's own node config."""
    service, partition = node_config.get("service"), node_config.get("partition-id")
    if isinstance(service, str) and service and all(key in SUPERNODE_WITH_SERVICE for key in node_config) and \
            _count(partition) and _count(node_config.get("num-partitions", 1)):
        return service
    return None


def _count(value) -> bool:
    """An int ≥ 0 (not a bool), as the node config's reading takes partition-id and num-partitions."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def ask_service(service: str, kind: str, content: RecordDict, context: Context) -> RecordDict:
    """Forward a message to the owner's data service at `service` (ServiceUnavailable if none
    listens there: the ClientApp never answers an own-data round itself)."""
    sock = connect(Path(service))
    if sock is None:
        raise ServiceUnavailable(f"no data service listens at service='{service}' (start it with "
                                 f"`fedsd data-service`, clients/README.md)")
    with sock:
        taken = offer(sock, kind, content, context)
        if not taken:
            raise ServiceUnavailable(f"the data service at {service} did not take the message")
        return answer(sock, kind, service)


def offer(sock: socket.socket, kind: str, content: RecordDict, context: Context) -> bool:
    """Whether the service took the message (ServiceError when it refused it, with its reason)."""
    from fedsd.app.client.service_wire import recv_json, send_json, send_records

    try:
        send_json(sock, {"kind": kind, "run_id": int(context.run_id), "node_id": int(context.node_id),
                         "node_config": dict(context.node_config)})
        send_records(sock, content)
        said = recv_json(sock)
    except (EOFError, OSError, ValueError):
        return False
    if said.get("status") == "refused":
        raise ServiceError(f"the data service refused the message: {said.get('error')}")
    return said == TAKEN


def answer(sock: socket.socket, kind: str, where) -> RecordDict:
    """The service's answer to a message it took (ServiceError, naming `where` to look, if none)."""
    from fedsd.app.client.service_wire import recv_json, recv_records

    try:
        header = recv_json(sock)
        if header.get("status") == "ok":
            return recv_records(sock)
    except (EOFError, OSError, ValueError):
        raise ServiceError(f"the data service stopped while answering a {kind} message (see {where})") from None
    raise ServiceError(str(header.get("error", "the data service failed")))


@contextmanager
def reachable(address: Path):
    """`address` as bind and connect take it."""
    if len(os.fsencode(address)) <= SUN_PATH_MAX or not os.path.isdir("/proc/self/fd"):
        yield str(address)
        return
    fd = os.open(address.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{address.name}"
    finally:
        os.close(fd)


def connect(address: Path, remove_stale: bool = True) -> socket.socket | None:
    """A connection to the service listening at `address`, or None; a socket file nobody
    listens at (a worker that has gone) is removed when it is ours, unless `remove_stale` is
    False (a worker starting: its socket file exists from its bind, before it listens)."""
    try:
        st = os.lstat(address)
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise ServiceUnavailable(f"{address} is not a socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with reachable(address) as where:
            sock.connect(where)
        return sock
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        if remove_stale and st.st_uid == os.geteuid():
            address.unlink(missing_ok=True)
        return None
