"""The owner's data service keeps its promises under its owner's own slips and against another
account on the same machine, tried against real `fedsd data-service` processes: two
services on one state folder, a restored state folder, a state-dir link re-pointed during the
charge, a peer holding half frames, and a package planted in the working directory."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from fedsd.settings.federation import client_config, to_flat
from fedsd.models.networks import build_model
from fedsd.training.loop import initial_model
from fedsd.app.records import record_to_model
from tests.app.client.test_server_threat import (B, ask, flat_parameters, node, one_step_run, own_npz, owner_service,
                                                 via_service)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("flower_task")]
ROOT = Path(__file__).resolve().parents[3]
assert own_npz  # the module's fixture, used by name below


def run_of(experiment: str, rounds: int):
    cfg, fed, _ = one_step_run(experiment=experiment)
    fed = dataclasses.replace(fed, rounds=rounds)
    return cfg, fed, to_flat(cfg, fed), initial_model(client_config(cfg, fed), 10)


def released_update(cfg, fed, reply, start) -> torch.Tensor:
    """What the server reads off a reply: (start − trained)·B/lr, the clipped sum plus the noise."""
    c = client_config(cfg, fed)
    names = [n for n, _ in build_model(c.model, 10).named_parameters()]
    trained = record_to_model(reply["arrays"])["student"]
    return (flat_parameters(start["student"], names) - flat_parameters(trained, names)) * B / c.lr


def noise_left(cfg, fed, a, b, start) -> float:
    """The server's difference of two replies to one request, whose clipped sums are equal (q = 1,
    the same model and data), over the norm two independent noises would leave: σC√(2d). About 1
    for distinct noise; about 0 for a replayed keystream (the noise cancels)."""
    diff = released_update(cfg, fed, a, start) - released_update(cfg, fed, b, start)
    sigma_c = float(a["metrics"]["noise-multiplier"]) * client_config(cfg, fed).clip
    return diff.norm().item() / (sigma_c * (2 * len(diff)) ** 0.5)


def charged_rounds(state: Path) -> list:
    return sorted(e.get("round") for p in state.glob("ledger-*.json") for e in json.loads(p.read_text())["entries"])


def test_a_second_service_on_a_state_folder_in_use_is_refused_at_start(own_npz, tmp_path):
    """A second `fedsd data-service` on the folder of a running one is refused at start, saying
    which process holds it; the running one goes on, and a ClientApp in another process on the
    same folder asked the same request finds the reply already released (same weights, no second
    charge, no second draw of the noise)."""
    state = tmp_path / "owner-state"
    cfg, fed, flat, start = run_of("shared", rounds=1)
    with owner_service(own_npz, tmp_path, state) as (address, _, proc):
        with owner_service(own_npz, tmp_path, state, name="second", wait=False) as (second, log, other):
            assert other.wait(timeout=60) != 0 and not second.exists()
        said = log.read_text()
        assert f"another data service already uses this state folder (pid {proc.pid})" in said, said
        first = via_service(address, flat, start)
        assert first["metrics"]["skipped"] == 0 and proc.poll() is None
    again = ask(flat, node(own_npz, state), start)  # this process, the same folder and request
    assert again["metrics"]["replayed"] == 1 and noise_left(cfg, fed, first, again, start) == 0.0
    assert charged_rounds(state) == [1]


def test_a_restored_state_folder_draws_new_noise(own_npz, tmp_path):
    """The owner restores a backup of the state folder (or copies it to a second machine) and the
    server asks round 2 again with the same model: refused while the folder is older than the
    owner's record (tests/app/client/test_restored_state.py); once the owner accepts the restore
    (--accept-restored-state, its ledger raised to the record), the reply's noise is new, so the
    difference of the two replies leaves noise of the norm two independent draws have (a
    replayed keystream would leave about 1e-5 of it)."""
    state, backup = tmp_path / "owner-state", tmp_path / "backup"
    cfg, fed, flat, start = run_of("restored", rounds=2)
    with owner_service(own_npz, tmp_path, state) as (address, _, _):
        first = via_service(address, flat, start)
        shutil.copytree(state, backup, ignore=shutil.ignore_patterns("service.lock"))
        after_first = {"student": record_to_model(first["arrays"])["student"]}
        a = via_service(address, flat, after_first, server_round=2)
        shutil.copytree(backup, state, dirs_exist_ok=True)  # the backup, restored in place
        refused = via_service(address, flat, after_first, server_round=2)
    assert refused["metrics"]["skipped"] == 1 and refused["refusal"]["reason"] == "refused: state"
    with owner_service(own_npz, tmp_path, state, flags=("--accept-restored-state",)) as (address, _, _):
        b = via_service(address, flat, after_first, server_round=2)
    assert [r["metrics"]["skipped"] for r in (first, a, b)] == [0, 0, 0] and "replayed" not in b["metrics"]
    ratio = noise_left(cfg, fed, a, b, after_first)
    print(f"restored copy: |difference| / σC√(2d) = {ratio:.4f}")
    assert 0.95 < ratio < 1.05, ratio


RACER = """
import os, sys, time
link, target, other = sys.argv[1:4]
os.mkdir(other, 0o777)
os.chmod(other, 0o777)
os.symlink(target, link)
print("ready", flush=True)
while True:
    for to in (other, target):
        try:
            os.unlink(link + ".new")
        except FileNotFoundError:
            pass
        os.symlink(to, link + ".new")
        os.rename(link + ".new", link)
        time.sleep(0.012)
"""
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # one another account can run



@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="another local account is made by root only, and runs the system's python3")
def test_a_state_dir_link_another_user_can_re_point_is_refused_and_no_raced_round_goes_uncharged(own_npz, tmp_path):
    """Another account (uid 65534) made the owner's state-dir, in a folder every user can write
    (sticky, as /tmp), a link to the owner's real folder, and re-points it at a folder of its own
    every 12 ms. The service refuses that state-dir at start, naming the link and the account;
    started with the resolved path, every one of 50 rounds released while the link flips is
    charged to the owner's ledger, and nothing reaches the other account's folder."""
    shared = Path(tempfile.mkdtemp(prefix="fedsd-shared-", dir="/tmp"))
    shared.chmod(0o1777)
    owner = tmp_path / "owner-state"
    owner.mkdir(mode=0o700)
    link, theirs = shared / "state", shared / "theirs"
    racer = subprocess.Popen([SYSTEM_PYTHON, "-I", "-c", RACER, str(link), str(owner), str(theirs)], user=NOBODY,
                             stdout=subprocess.PIPE, text=True)
    cfg, fed, flat, start = run_of("raced", rounds=50)
    try:
        assert racer.stdout.readline().strip() == "ready"
        with owner_service(own_npz, tmp_path, link, name="linked", wait=False) as (address, log, proc):
            assert proc.wait(timeout=60) != 0 and not address.exists()
        said = log.read_text()
        assert f"{link} is a symbolic link in {shared}, a folder every user can write to, where another user " \
               f"(uid {NOBODY}) could have made it" in said and "resolved path" not in said, said  # theirs to choose
        with owner_service(own_npz, tmp_path, owner) as (address, _, _):
            replies = [via_service(address, flat, start, server_round=r) for r in range(1, 51)]
        released = sorted(r for r, reply in enumerate(replies, 1) if reply["metrics"]["skipped"] == 0)
        print(f"raced link: {len(released)} of 50 rounds released, {len(charged_rounds(owner))} charged")
        assert released == list(range(1, 51)) and charged_rounds(owner) == released
        assert not list(theirs.iterdir())
    finally:
        racer.kill()
        racer.wait()
        shutil.rmtree(shared, ignore_errors=True)


# One process of another user: opens `n` connections, each sending half a header and then
# nothing, says how many the service refused at once, then holds the rest (until killed).
HOLDER = """
import socket, struct, sys, time
address, n = sys.argv[1], int(sys.argv[2])
held, refused = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(address)
    try:
        s.sendall(struct.pack("!Q", 1000) + b"{")  # half a header, then nothing
    except OSError:
        pass  # refused and closed already: its refusal is still there to read
    held.append(s)
time.sleep(0.5)
for s in held:
    s.setblocking(False)
    try:
        refused += b"refused" in s.recv(4096)
    except (BlockingIOError, ConnectionResetError):
        pass
print(refused, flush=True)
time.sleep(600)
"""


def test_a_peer_holding_half_frames_holds_only_its_own_slots(own_npz, tmp_path):
    """A process of an allowed user opens 8, then 24, connections, each with half a frame, and
    holds them: the owner's other clients are answered within a second all the while, and the
    holder's connections past its own 8 are refused at once."""
    cfg, fed, flat, start = run_of("stall", rounds=1)
    with owner_service(own_npz, tmp_path, tmp_path / "owner-state") as (address, log, proc):
        assert via_service(address, flat, start)["metrics"]["skipped"] == 0  # warm: the trainer is built
        for n in (8, 24):
            holder = subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(address), str(n)],
                                      stdout=subprocess.PIPE, text=True)
            try:
                refused = int(holder.stdout.readline())
                answered = []
                began = time.monotonic()
                asker = threading.Thread(target=lambda: answered.append(
                    (via_service(address, flat, start, kind="evaluate"), time.monotonic() - began)), daemon=True)
                asker.start()
                asker.join(timeout=5)
                assert answered, f"with {n} half frames held, no answer within 5 s"
                reply, seconds = answered[0]
                print(f"{n} half frames held: another client answered in {seconds:.3f} s; {refused} refused at once")
                assert "metrics" in reply and seconds < 1.0 and refused == n - 8
            finally:
                holder.kill()
                holder.wait()
        assert proc.poll() is None and "connections open to the service, the most one may have" in log.read_text()


PLANTED = """
import os
open(os.environ["PLANTED_MARK"], "a").write("ran as uid %d\\n" % os.getuid())
"""


def _start_service(tmp_path, own_npz, cwd, argv):
    mark = tmp_path / "planted-ran"
    config = f"partition-id=0 data='{own_npz}' state-dir='{tmp_path / 'state'}'"  # no budget: refused at start
    out = subprocess.run(argv + ["--socket", str(tmp_path / "s.sock"), "--node-config", config], cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PLANTED_MARK": str(mark)}, capture_output=True,
                         text=True, timeout=120)
    return out, mark


@pytest.mark.parametrize("command", [["fedsd", "data-service"], ["-P", "-m", "fedsd.app.client.owner_service"],
                                     ["-P", "-m", "fedsd.cli.main", "data-service"]],
                         ids=["fedsd", "safe-path-module", "safe-path-cli-module"])
def test_a_package_planted_in_the_working_directory_is_not_run(own_npz, tmp_path, command):
    """A folder the SuperNode's user can write (0777) holds a planted `fedsd` package; the owner
    starts the service from it, as clients/README.md says (`fedsd data-service`, or `python -P -m`):
    nothing of the plant runs, and the service starts (here refused for want of a budget)."""
    cwd = tmp_path / "writable"
    cwd.mkdir()
    cwd.chmod(0o777)
    (cwd / "fedsd").mkdir()
    (cwd / "fedsd" / "__init__.py").write_text(PLANTED)
    argv = ([str(Path(sys.executable).parent / "fedsd")] + command[1:] if command[0] == "fedsd"
            else [sys.executable] + command)
    out, mark = _start_service(tmp_path, own_npz, cwd, argv)
    assert not mark.exists(), mark.read_text()
    said = out.stdout + out.stderr
    assert out.returncode != 0
    if "owner_service" in command[-1]:  # the warm worker's entry point: not the service's
        assert "the owner's data service starts with `fedsd data-service` only" in said, said
    else:
        assert "max-epsilon" in said, said


@pytest.mark.parametrize("command", [["-m", "fedsd.app.client.owner_service"],
                                     ["-m", "fedsd.cli.main", "data-service"]],
                         ids=["module", "cli-module"])
def test_python_m_with_the_working_directory_on_the_path_is_refused(own_npz, tmp_path, command):
    """`python -m` puts the working directory first on the import path. Python itself imports a
    package planted there under the name `fedsd` before any of fedsd's code runs (so no check of
    fedsd's can stop it: the reason the service starts with `fedsd data-service`); where nothing
    is planted, each `python -m` entry point refuses before anything else, naming the safe ways."""
    cwd = tmp_path / "writable"
    cwd.mkdir()
    out, mark = _start_service(tmp_path, own_npz, cwd, [sys.executable] + command)
    assert out.returncode != 0 and not (tmp_path / "state").exists()
    assert "refused" in out.stderr and "fedsd data-service" in out.stderr and "python -P" in out.stderr, out.stderr
