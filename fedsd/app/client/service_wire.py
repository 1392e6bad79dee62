"""The wire both sides of an owner's data service speak (fedsd/app/client/owner_service.py): over
a Unix socket, frames of a length, then a JSON header or Flower's own protobuf serialisation of
a RecordDict, each bounded before it is parsed (nothing is unpickled: a peer can send data,
never code); each peer's credentials (SO_PEERCRED); and the connection slots shared out among
the peers' processes and uids."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
from contextlib import contextmanager

from flwr.app import RecordDict

from fedsd.app.packing import records_from_bytes

# What one message may be: everything that crosses into the service is read as hostile, so each
# part is bounded before it is parsed, and a frame that stops arriving is given up on.
MAX_HEADER = 1 << 16  # bytes of a JSON header (its keys are a kind, two ids and a node config)
MAX_DEPTH = 8  # nesting of that JSON (the node config is one level below the top)
MAX_RECORDS = 1 << 27  # bytes of a message's records: resnet18's weights are 45 MB
FRAME_SECONDS = 30.0  # a frame must arrive whole within this long, and a reply be taken within it
# Connections are never waited for: accepting goes on whatever the open ones do, and one over a
# limit is refused at once with the reason. Three levels, each checked on every connection and
# every message (SO_PEERCRED's pid and uid):
# - a peer process holds at most PEER_CONNECTIONS open and PEER_BYTES of records being read or
#   waiting to be answered (a message read whole waits for the answer lock, parsed, in memory);
# - a peer uid, all its processes together, holds at most its share of the service's limits:
#   MAX_CONNECTIONS and MAX_BYTES divided by the number of uids the service answers (its own and
#   each --allow-uid; at least 1 connection each). The shares add up to no more than the whole,
#   so however many processes one user runs, each other allowed user always has its full share
#   free: the owner's service with the SuperNode's user allowed gives each of the two 64
#   connections and 1 GiB; a warm worker, which answers its own user only, gives it all;
# - MAX_CONNECTIONS and MAX_BYTES bound the service as a whole (its memory).
# A slot held by half a frame is given up on after FRAME_SECONDS, as any slow frame is.
PEER_CONNECTIONS = 8
PEER_BYTES = 1 << 28  # 256 MiB: two messages of the largest size
MAX_CONNECTIONS = 128
MAX_BYTES = 1 << 31  # 2 GiB of records being read or waiting to be answered at once

class Refused(ValueError):
    """A message the service does not take (malformed, too large, too deep, too slow); the text
    names what was wrong with the message, nothing of the data."""



# -- frames ------------------------------------------------------------------------------------
def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def recv_frame(sock: socket.socket, limit: int, seconds: float | None = None, reserve=None) -> bytes:
    """One frame of at most `limit` bytes (Refused over it, before any of it is read); with
    `seconds`, all of it within that long (Refused when it stops arriving); with `reserve` (a
    context manager of the size), its bytes reserved while they are read."""
    deadline = None if seconds is None else time.monotonic() + seconds
    size = struct.unpack("!Q", _recv_exactly(sock, 8, deadline))[0]
    if size > limit:
        raise Refused(f"a frame of {size} bytes, over the {limit} allowed")
    if reserve is None:
        return _recv_exactly(sock, size, deadline)
    with reserve(size):
        return _recv_exactly(sock, size, deadline)


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Refused(f"a frame that did not arrive whole within {FRAME_SECONDS:g} s")
            sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except socket.timeout:
            raise Refused(f"a frame that did not arrive whole within {FRAME_SECONDS:g} s") from None
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    if deadline is not None:
        sock.settimeout(None)
    return b"".join(chunks)


def send_json(sock: socket.socket, obj: dict) -> None:
    send_frame(sock, json.dumps(obj).encode())


def recv_json(sock: socket.socket, seconds: float | None = None) -> dict:
    """A JSON object of at most MAX_HEADER bytes nested at most MAX_DEPTH deep (Refused else)."""
    raw = recv_frame(sock, MAX_HEADER, seconds)
    if json_depth(raw) > MAX_DEPTH:
        raise Refused(f"a header nested over {MAX_DEPTH} deep")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise Refused(f"a header that is not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise Refused("a header that is not a JSON object")
    return obj


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest, counted without parsing it (a
    parser recurses once a level: 100,000 levels end it in a RecursionError)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def send_records(sock: socket.socket, records: RecordDict) -> None:
    from flwr.common.serde import recorddict_to_proto

    send_frame(sock, recorddict_to_proto(records).SerializeToString())


def recv_records(sock: socket.socket, seconds: float | None = None, reserve=None) -> RecordDict:
    """Flower's RecordDict from its protobuf (at most MAX_RECORDS bytes; Refused if it does not
    parse as one)."""
    raw = recv_frame(sock, MAX_RECORDS, seconds, reserve)
    try:
        return records_from_bytes(raw)
    except ValueError as e:
        raise Refused(str(e)) from None


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel knows it."""
    return peer_credentials(sock)[1]


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that connected at the other end of a Unix socket, as the kernel
    knows them."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class Slots:
    """What the connections being read hold, by peer process, by peer uid and in all
    (PEER_CONNECTIONS and PEER_BYTES; MAX_CONNECTIONS and MAX_BYTES shared out among the `users`
    uids the service answers; MAX_CONNECTIONS and MAX_BYTES): taken without waiting, or refused
    with the reason. A peer is its (pid, uid), as SO_PEERCRED gives them."""

    def __init__(self, users: int = 1):
        self.users = max(1, users)  # the uids the service answers: each has a share of the whole
        self.lock = threading.Lock()
        self.connections: dict[int, int] = {}  # peer pid → connections open
        self.bytes: dict[int, int] = {}  # peer pid → bytes of records reserved
        self.uid_connections: dict[int, int] = {}  # peer uid → connections open
        self.uid_bytes: dict[int, int] = {}  # peer uid → bytes of records reserved
        self.total_connections = self.total_bytes = 0

    def uid_share(self) -> tuple[int, int]:
        """(connections, bytes) one uid may hold: the service's limits shared out (read when
        used, so a test's limits apply)."""
        return max(1, MAX_CONNECTIONS // self.users), MAX_BYTES // self.users

    def open(self, peer: tuple[int, int]) -> str | None:
        """A connection from `peer` (pid, uid) taken (None), or why not."""
        pid, uid = peer
        share = self.uid_share()[0]
        with self.lock:
            if self.connections.get(pid, 0) >= PEER_CONNECTIONS:
                return f"this process has {PEER_CONNECTIONS} connections open to the service, the most one may have"
            if share < MAX_CONNECTIONS and self.uid_connections.get(uid, 0) >= share:  # (a lone uid: the whole)
                return (f"this user has {share} connections open to the service, its share of the "
                        f"{MAX_CONNECTIONS} among the {self.users} users it answers; try again")
            if self.total_connections >= MAX_CONNECTIONS:
                return f"the service has {MAX_CONNECTIONS} connections open, the most it reads at once; try again"
            self.connections[pid] = self.connections.get(pid, 0) + 1
            self.uid_connections[uid] = self.uid_connections.get(uid, 0) + 1
            self.total_connections += 1
        return None

    def close(self, peer: tuple[int, int]) -> None:
        pid, uid = peer
        with self.lock:
            _less(self.connections, pid, 1)
            _less(self.uid_connections, uid, 1)
            self.total_connections -= 1

    @contextmanager
    def reserve(self, peer: tuple[int, int], size: int):
        """`size` bytes of records to be read for `peer` (pid, uid), held for the block (Refused
        if they do not fit its share, its user's or the service's)."""
        pid, uid = peer
        share = self.uid_share()[1]
        with self.lock:
            if self.bytes.get(pid, 0) + size > PEER_BYTES:
                raise Refused(f"records of {size} bytes, over the {PEER_BYTES} this process may have being read or "
                              f"waiting to be answered")
            if share < MAX_BYTES and self.uid_bytes.get(uid, 0) + size > share:
                raise Refused(f"records of {size} bytes while this user has {self.uid_bytes.get(uid, 0)} being read "
                              f"or waiting to be answered, over its share of {share}; try again")
            if self.total_bytes + size > MAX_BYTES:
                raise Refused(f"records of {size} bytes while the service holds {self.total_bytes} of others, over "
                              f"the {MAX_BYTES} it holds at once; try again")
            self.bytes[pid] = self.bytes.get(pid, 0) + size
            self.uid_bytes[uid] = self.uid_bytes.get(uid, 0) + size
            self.total_bytes += size
        try:
            yield
        finally:
            with self.lock:
                _less(self.bytes, pid, size)
                _less(self.uid_bytes, uid, size)
                self.total_bytes -= size


def _less(counts: dict[int, int], key: int, n: int) -> None:
    counts[key] -= n
    if not counts[key]:
        del counts[key]
