"""The owner's data service shares its connection slots by peer uid: one allowed user
with many processes, each holding half frames, holds at most its own share of the 128, and a
request from another allowed user is answered at once, tried against a real `fedsd data-service`
process with 16 processes of an unprivileged uid holding 128 half frames."""
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedsd.app.client import service_wire
from tests.app.client.test_service_processes_under_slips import HOLDER, NOBODY, SYSTEM_PYTHON, run_of
from tests.app.client.test_server_threat import own_npz, via_service

pytestmark = pytest.mark.usefixtures("flower_task")
assert own_npz  # the module's fixture, used by name below
ROOT = Path(__file__).resolve().parents[3]


@contextmanager
def service_allowing(npz, tmp_path, uid: int):
    """The owner's `fedsd data-service` (as this test's user, root) that also answers `uid`, at a
    socket in a folder `uid` can reach: yields (address, log, process) once it listens."""
    folder = Path(tempfile.mkdtemp(prefix="fedsd-uid-slots-", dir="/tmp"))  # a short socket path
    folder.chmod(0o711)  # reachable by the other user; the socket itself is 0666 from its bind
    address, log = folder / "service.sock", tmp_path / "owner.log"
    config = f"partition-id=0 data='{npz}' max-epsilon=inf state-dir='{tmp_path / 'owner-state'}' " \
             f"federated-evaluation=true min-evaluation-samples=10"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "fedsd"), "data-service", "--socket",
                                 str(address), "--node-config", config, "--allow-uid", str(uid)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not address.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield address, log, proc
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def lines_of(procs, seconds: float) -> list[int]:
    """The first line each of `procs` prints, as an int, waited for at most `seconds` in all."""
    said, deadline = {}, time.monotonic() + seconds
    while len(said) < len(procs):
        left = deadline - time.monotonic()
        assert left > 0, f"{len(said)} of {len(procs)} holders reported within {seconds:g} s"
        ready, _, _ = select.select([p.stdout for p in procs if p.pid not in said], [], [], left)
        for p in procs:
            if p.stdout in ready:
                said[p.pid] = int(p.stdout.readline())
    return [said[p.pid] for p in procs]


def answered_within(seconds: float, ask) -> tuple[object, float]:
    """(what `ask()` returned or raised, how long it took), or (None, seconds) if it did not end."""
    result = []
    began = time.monotonic()

    def run():
        try:
            result.append(ask())
        except Exception as e:  # noqa: BLE001  (a refusal is an answer, and a failure of this test)
            result.append(e)
        result.append(time.monotonic() - began)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=seconds)
    return (result[0], result[1]) if len(result) == 2 else (None, seconds)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="another local account is used by root only, and runs the system's python3")
def test_one_uid_holding_half_frames_from_16_processes_leaves_another_uid_its_slots(own_npz, tmp_path):
    """16 processes of uid 65534 (an allowed user: the SuperNode's, say) open 8 connections each,
    128 in all, each with half a frame, and hold them. A request from another allowed uid (here
    the owner's own, root) is answered within 5 s all the while; the holders' connections past
    their user's share (128 / 2 allowed uids = 64) are refused at once."""
    cfg, fed, flat, start = run_of("uid-slots", rounds=1)
    with service_allowing(own_npz, tmp_path, NOBODY) as (address, log, proc):
        assert via_service(address, flat, start)["metrics"]["skipped"] == 0  # warm: the trainer is built
        holders = []
        try:
            for _ in range(16):
                holders.append(subprocess.Popen([SYSTEM_PYTHON, "-I", "-c", HOLDER, str(address), "8"], user=NOBODY,
                                                stdout=subprocess.PIPE, text=True, cwd="/"))
            refused = sum(lines_of(holders, 60))
            reply, seconds = answered_within(5.0, lambda: via_service(address, flat, start, kind="evaluate"))
            print(f"uid {NOBODY}: 16 processes x 8 half frames, {refused} refused at once; uid {os.geteuid()}'s "
                  f"request: {type(reply).__name__} after {seconds:.3f} s")
            assert reply is not None and not isinstance(reply, Exception), f"no answer within 5 s: {reply!r}"
            assert "metrics" in reply
            assert seconds < 5.0
            assert refused == 128 - service_wire.MAX_CONNECTIONS // 2, refused
        finally:
            for h in holders:
                h.kill()
            for h in holders:
                h.wait()
        assert proc.poll() is None
        said = log.read_text()
        assert f"(uid {NOBODY}): this user has {service_wire.MAX_CONNECTIONS // 2} connections open" in said, \
            said[-2000:]


def test_slots_give_each_uid_its_share_of_connections_and_bytes(monkeypatch):
    """Without processes: with 2 uids answered, one uid's many processes hold at most half the
    connections and half the bytes, and the other uid's are still taken; a lone uid (a warm
    worker's) has the whole; and what is closed or released is free again."""
    monkeypatch.setattr(service_wire, "MAX_CONNECTIONS", 16)
    monkeypatch.setattr(service_wire, "MAX_BYTES", 1000)
    slots = service_wire.Slots(users=2)
    taken = [(pid, 7) for pid in range(100, 104) for _ in range(service_wire.PEER_CONNECTIONS)]
    said = [slots.open(peer) for peer in taken]
    assert said[:8] == [None] * 8 and all("this user has 8 connections open" in w for w in said[8:]), said
    assert slots.open((200, 0)) is None and slots.total_connections == 9
    for peer in taken[:8]:
        slots.close(peer)
    assert slots.open((100, 7)) is None and slots.uid_connections == {7: 1, 0: 1}
    with slots.reserve((100, 7), 300), slots.reserve((101, 7), 200):
        with pytest.raises(service_wire.Refused, match="over its share of 500"):
            with slots.reserve((102, 7), 1):
                pass
        with slots.reserve((200, 0), 500):  # the other uid's share is whole
            assert slots.total_bytes == 1000
    assert slots.uid_bytes == {} and slots.bytes == {} and slots.total_bytes == 0
    alone = service_wire.Slots(users=1)
    assert [alone.open((pid, 7)) for pid in range(2) for _ in range(8)] == [None] * 16
    assert "the service has 16 connections open" in alone.open((3, 7))  # its share is the whole
