"""A review of the owners' promises playing the attacker (the server through its ClientApp, another
local account, an owner's slip): each test here is an attack that worked against the code as
merged, and checks the fix.

- the service's bound on the memory of messages being read (MAX_BYTES) counted a message's bytes
  only while they arrived: read ones then waited for the answer lock, parsed and uncounted, so a
  peer held any number of 128 MiB messages (up to the 128 connections) in the owner's memory;
- the owner's service made its socket 0666 with a chmod by path after binding it: a link put in
  its place in between (a socket folder another user can write) made that user's chosen file of
  the owner's world-writable;
- a link the owner left at state-dir/calibrations was refused with its resolved target in the
  reason sent to the server;
- a FIFO in place of the roster (read again for every message) held the service for ever;
- a node config that stopped parsing (a roster others can write, a data folder gone) was refused
  with the owner's paths in the reason sent to the server.
"""
import json
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from fedsd.app.client import owner_service as data_service, service_wire
from tests.app.client.test_server_threat import own_npz

pytestmark = pytest.mark.usefixtures("flower_task")
assert own_npz  # the module's fixture, used by name below


def frame(payload: bytes) -> bytes:
    return struct.pack("!Q", len(payload)) + payload


def records_of(nbytes: int) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(nbytes // 4, dtype=np.float32))})})
    return recorddict_to_proto(content).SerializeToString()


class Blocking(data_service.DataService):
    """A warm worker whose first taken message holds the answer lock until `release` is set, as a
    long training round the server asked for does."""

    def __init__(self, address: Path):
        super().__init__(address)
        self.release = threading.Event()

    def _reply(self, header, content):
        self.release.wait(30)
        return [json.dumps({"status": "error", "error": "held"}).encode()]


def test_messages_waiting_for_the_answer_lock_count_against_the_services_memory_bound(tmp_path, monkeypatch):
    """One message is being answered (a long round); the same peer sends 5 more of 1 MB each to a
    service that reads at most 3 MB of records at once. Each is read whole, parsed and held while
    it waits for the lock, so what waits is in the service's memory: past 3 MB, the rest must be
    refused at once, not held (else 128 connections × 128 MiB wait in memory)."""
    monkeypatch.setenv("FEDSD_TUNE_PROCESS", "0")
    monkeypatch.setattr(service_wire, "MAX_BYTES", 3 << 20)
    monkeypatch.setattr(service_wire, "PEER_BYTES", 1 << 30)
    address = tmp_path / "s.sock"
    service = Blocking(address)
    threading.Thread(target=service.serve, daemon=True).start()
    deadline = time.monotonic() + 60
    while not address.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    header = frame(json.dumps({"kind": "evaluate", "run_id": 1, "node_id": 1, "node_config": {}}).encode())
    body = frame(records_of(1 << 20))
    sockets = []
    try:
        for _ in range(6):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(address))
            try:
                s.sendall(header + body)
            except OSError:
                pass  # refused and closed before the records: its refusal is there to read
            sockets.append(s)
            time.sleep(0.3)  # read whole before the next: the reservation of each has come and gone
        time.sleep(0.5)
        said = []
        for s in sockets:
            s.setblocking(False)
            try:
                said.append(s.recv(4096))
            except BlockingIOError:
                said.append(b"")
        refused = sum(b"refused" in m for m in said)
        waiting = sum(not m for m in said)
        print(f"6 messages of 1 MB under a 3 MB bound: 1 taken, {waiting} waiting in memory, {refused} refused")
        assert b"taken" in said[0]
        assert waiting <= 3 and refused >= 2, said
    finally:
        service.release.set()
        for s in sockets:
            s.close()


@contextmanager
def bound_then_swapped(address: Path, victim: Path):
    """Bind at `address`; right after the bind (before the service's next step) another user who
    can write the socket's folder moves the socket away and leaves a link to `victim`."""
    yield str(address)
    os.rename(address, address.with_name("moved.sock"))
    os.symlink(victim, address)


def test_the_owners_socket_is_never_made_world_writable_through_a_link(tmp_path, monkeypatch):
    """The owner's service gives its socket mode 0666 (who may talk is decided by the peer's uid).
    Done by path after the bind, a link put at the socket's address in between made the file it
    leads to 0666: the other user picks any file of the owner's (its ~/.bashrc, say)."""
    victim = tmp_path / "owners-file"
    victim.write_text("the owner's")
    victim.chmod(0o600)
    address = tmp_path / "service.sock"
    monkeypatch.setattr(data_service, "_reachable", lambda a: bound_then_swapped(a, victim))
    service = data_service.DataService(address, node=object())  # the owner's service (a node config)
    try:
        listener = service._listen()
        listener.close()
    except OSError:
        pass  # refusing is fine: what matters is the victim's mode
    assert oct(victim.stat().st_mode & 0o777) == oct(0o600)


@pytest.mark.slow
def test_a_link_in_the_state_folder_is_refused_without_telling_the_server_where_it_leads(own_npz, tmp_path):
    """The owner left state-dir/calibrations as a link to a folder elsewhere. The round is refused
    (the link is not followed), and the server is told the state folder is not the owner's alone,
    never the link's target (a path of the owner's machine)."""
    from fedsd.settings.federation import client_config
    from fedsd.training.loop import initial_model
    from tests.app.client.test_server_threat import ask, node, one_step_run

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    target = tmp_path / "owners-private-place-7f3a"
    target.mkdir(mode=0o700)
    (state / "calibrations").symlink_to(target)
    cfg, fed, flat = one_step_run(experiment="leak")
    reply = ask(flat, node(own_npz, state), initial_model(client_config(cfg, fed), 10))
    assert reply["metrics"]["refused"] == 1
    reason = reply["refusal"]["reason"]
    print("told the server:", reason)
    assert "owners-private-place" not in reason and str(tmp_path) not in reason, reason
    assert not list(target.iterdir())


def roster_of(path: Path) -> Path:
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    path.write_text(f"alice ed25519:{base64.b64encode(public).decode()}\n")
    return path


def test_a_fifo_in_place_of_the_roster_is_refused_not_waited_on(tmp_path):
    """The roster is read again for every message. A FIFO put in its place (by anyone who can
    write its folder) held the open, and the service's answer lock with it, for ever."""
    from fedsd.secure.identity import RosterError, read_roster

    fifo = tmp_path / "roster"
    os.mkfifo(fifo, 0o600)
    outcome = []

    def read():
        try:
            read_roster(fifo)
            outcome.append("read")
        except RosterError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # unblock it: a writer opens the FIFO
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome and "not a regular file" in outcome[0], outcome


@pytest.mark.parametrize("slip", ["roster-others-can-write", "data-gone"])
def test_a_node_config_that_no_longer_parses_is_refused_without_the_owners_paths(tmp_path, slip):
    """The owner's roster became group-writable, or its data folder was moved, while the node
    runs: every round is refused, and the reason the server reads named the roster's or the data's
    path (and the owner's uid). Its owner's log has it in full; the server gets `<secagg-roster>`
    and `<data>`. The same through secure aggregation's stages."""
    from flwr.app import ConfigRecord, Context

    from fedsd.app.client import handler as local, secure_stages as secure_aggregation
    from fedsd.app.client.secure_owner import StageRefused
    from fedsd.app import secure_sum

    private = tmp_path / "owners-private-place-7f3a"
    private.mkdir()
    roster, data = roster_of(private / "roster"), private / "data.npz"
    data.write_bytes(b"")
    node_config = {"partition-id": 0, "data": str(data), "max-epsilon": 1.0, "state-dir": str(private / "state"),
                   "secagg-roster": str(roster)}
    if slip == "roster-others-can-write":
        roster.chmod(0o664)
    else:
        data.unlink()
    context = Context(run_id=1, node_id=11, node_config=node_config, state=RecordDict(), run_config={})
    content = RecordDict({"config": ConfigRecord({"server-round": 1, "client-data": "own", "experiment-id": "x"})})
    reason = local.train_reply(content, context)["refusal"]["reason"]
    print("told the server:", reason)
    assert "owners-private-place" not in reason, reason
    stage = RecordDict({secure_sum.RECORD: ConfigRecord({"experiment-id": "x", "server-round": 1})})
    with pytest.raises(StageRefused) as refused:
        secure_aggregation.identify_reply(stage, context)
    assert "owners-private-place" not in str(refused.value), str(refused.value)
