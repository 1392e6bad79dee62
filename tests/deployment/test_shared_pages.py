"""--share-pages (fedsd/deployment/shared_pages.py): the processes a deployment starts are
mergeable by the kernel and laid out alike, each group with a hash secret of its own that no
command line shows, and ksmd's settings come back as they were, however deployments overlap or
end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedsd.deployment.local_deployment import LocalDeployment
from fedsd.deployment.processes import DeploymentError
from fedsd.deployment.processes import started
from fedsd.deployment.shared_pages import GROUPS, KSM_SETTINGS, KsmSettings, SharedPages
from tests.deployment.test_deploy import isolation_unavailable

# What a started process reports of itself: KSM's merge-any flag (PR_GET_MEMORY_MERGE), its
# personality, where its executable was mapped, its hash secret and its uid.
REPORT = ("import ctypes, json, os; libc = ctypes.CDLL(None); "
          "print(json.dumps([libc.prctl(68, 0, 0, 0, 0), libc.personality(0xffffffff), "
          "open('/proc/self/maps').readline().split('-')[0], os.environ.get('PYTHONHASHSEED'), os.getuid()]))")
NO_RANDOMIZE = 0x0040000


def _unavailable() -> str | None:
    try:
        SharedPages.check()
    except DeploymentError as e:
        return str(e)
    return None


UNAVAILABLE = _unavailable() if os.geteuid() == 0 else "not root"
needs_ksm = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"{UNAVAILABLE}")


def report(cmd: list[str], env: dict | None = None) -> list:
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env,
                                     timeout=60).stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_ksm
def test_a_started_process_is_mergeable_and_laid_out_as_the_others():
    first, second = (report(SharedPages.command([sys.executable, "-c", REPORT])) for _ in range(2))
    assert first[0] == 1 and first[1] & NO_RANDOMIZE
    assert first[2] == second[2]  # the same address twice: no randomisation
    plain = report([sys.executable, "-c", REPORT])  # without the launcher: as this process is
    assert (plain[0], plain[1] & NO_RANDOMIZE) == _own_flags()


def _own_flags() -> tuple[int, int]:
    import ctypes

    libc = ctypes.CDLL(None)
    return libc.prctl(68, 0, 0, 0, 0), libc.personality(0xffffffff) & NO_RANDOMIZE


def test_each_group_has_a_hash_secret_of_its_own_drawn_for_each_deployment():
    one, two = SharedPages(), SharedPages()
    seeds = [one.env(g)["PYTHONHASHSEED"] for g in GROUPS]
    assert len(set(seeds)) == len(GROUPS) and all(s.isdigit() and 1 <= int(s) < 2**32 for s in seeds)
    assert seeds != [two.env(g)["PYTHONHASHSEED"] for g in GROUPS]


@pytest.fixture
def ksm(tmp_path):
    """A stand-in for /sys/kernel/mm/ksm with a machine's own settings, and a state folder."""
    folder = tmp_path / "ksm"
    folder.mkdir()
    for name, value in {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20"}.items():
        (folder / name).write_text(value + "\n")
    return folder, tmp_path / "state"


def _settings(folder) -> dict:
    return {name: (folder / name).read_text().strip() for name in KSM_SETTINGS}


ORIGINAL = {"run": "0", "pages_to_scan": "100", "sleep_millisecs": "20"}


def test_ksmd_gets_its_settings_back_after_the_last_of_two_overlapping_deployments(ksm):
    folder, state = ksm
    first, second = KsmSettings(folder, state), KsmSettings(folder, state)
    first.use()
    assert _settings(folder) == KSM_SETTINGS
    second.use()
    second.use()  # twice: the same
    first.release()
    assert _settings(folder) == KSM_SETTINGS  # the other still runs
    second.release()
    assert _settings(folder) == ORIGINAL


def test_a_killed_deployments_settings_do_not_become_the_machines(ksm):
    folder, state = ksm
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    KsmSettings(folder, state).use()  # a deployment that was then killed: its pid no longer runs
    record = json.loads((state / "state.json").read_text())
    record["pids"] = [[gone.pid, "1", "killed"]]
    (state / "state.json").write_text(json.dumps(record))
    later = KsmSettings(folder, state)
    later.use()
    later.release()
    assert _settings(folder) == ORIGINAL
    assert started(gone.pid) != "1"


@pytest.mark.slow
@needs_ksm
@pytest.mark.skipif(isolation_unavailable() is not None, reason=f"{isolation_unavailable()}")
def test_an_isolated_owners_service_starts_so_with_its_groups_secret_on_no_command_line(tmp_path):
    with LocalDeployment(tmp_path / "work", 1, isolate=True, share_pages=True) as deployment:
        deployment.make_credentials()
        deployment._network()
        iso = deployment.isolation
        _, _, env = deployment._owner(0, deployment.credentials / "keys" / "node-0", None,
                                      "partition-id=0 num-partitions=1")
        cmd, outer = deployment._as_client(0, iso.uid(0), [sys.executable, "-P", "-c", REPORT], env,
                                           deployment.owner_dir(0), deployment.owner_needs(0), "owners")
        cmd = deployment.shared_pages.command(cmd)
        seed = deployment.shared_pages.env("owners")["PYTHONHASHSEED"]
        assert not any(seed in part for part in cmd)  # every uid reads a command line (/proc/PID/cmdline)
        merge, personality, _, got, uid = report(cmd, env=outer)
        assert (merge, bool(personality & NO_RANDOMIZE), got, uid) == (1, True, seed, iso.uid(0))
        assert seed != deployment.shared_pages.env("nodes")["PYTHONHASHSEED"] == deployment.env["PYTHONHASHSEED"]
        assert deployment._server_env["PYTHONHASHSEED"] == deployment.shared_pages.env("server")["PYTHONHASHSEED"]


def _replaced(path, text: str):
    """Written whole, as the kernel's files read: a thread's write_text, read half-done (empty)
    by the pace beside it, failed a fresh clone's run."""
    (path.parent / (path.name + ".tmp")).write_text(text)
    os.replace(path.parent / (path.name + ".tmp"), path)


def _meminfo(path, available_share: float):
    _replaced(path, f"MemTotal: 1000000 kB\nMemFree: 1 kB\nMemAvailable: {int(available_share * 1e6)} kB\n")
    return path


def test_starts_are_paced_by_the_merging_only_while_memory_is_short(tmp_path, monkeypatch):
    """`pace`, between one client's start and the next: at once while a quarter of the memory is
    free; under that, while ksmd goes on merging (more pages shared), until memory is back, at most
    its limit (a stand-in ksm folder and /proc/meminfo)."""
    import threading
    import time

    import fedsd.deployment.shared_pages as shared_pages

    monkeypatch.setattr(shared_pages, "STALL_SECONDS", 1.0)
    ksm = tmp_path / "ksm"
    ksm.mkdir()
    (ksm / "pages_sharing").write_text("7\n")
    pages = SharedPages(ksm=ksm, state=tmp_path / "state")
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 1\nprocs_blocked 0\n")
    monkeypatch.setattr(shared_pages, "STAT", stat)
    assert pages.pace(meminfo=_meminfo(tmp_path / "plenty", 0.6), most=30) < 2.5  # the machine quiet: 3 looks
    stat.write_text("procs_running 5\n")  # the last client still starting
    threading.Timer(2.0, lambda: _replaced(stat, "procs_running 2\n")).start()
    assert 3.0 <= pages.pace(meminfo=_meminfo(tmp_path / "plenty", 0.6), most=30) < 6  # until it was done
    short = _meminfo(tmp_path / "short", 0.1)
    assert 2.5 <= pages.pace(meminfo=short, most=30) < 7  # nothing merging: it stops waiting after the stall
    merging = threading.Event()

    def merge():  # ksmd merging for 3 s, then the memory back
        for n in range(6):
            _replaced(ksm / "pages_sharing", f"{8 + n}\n")
            time.sleep(0.5)
        _meminfo(short, 0.5)
        merging.set()

    worker = threading.Thread(target=merge)
    worker.start()
    waited = pages.pace(meminfo=short, most=30)
    worker.join()
    assert merging.is_set() and 3.0 <= waited < 12  # until the memory came back, past the stall
    _meminfo(short, 0.1)
    (ksm / "pages_sharing").write_text("100\n")
    assert pages.pace(meminfo=short, most=0.5) < 1.5  # its limit


@pytest.mark.slow
@needs_ksm
def test_a_clients_processes_yield_the_cpu_to_the_servers():
    """A client's process starts in a session (the kernel's autogroup) of nice 19, the server's at 0:
    a hundred clients' sessions at 0 left the ServerApp a two-hundredth of two cores when their work
    came at once, and the SuperLink ended the run when its heartbeat lapsed."""
    def autogroup(client: bool) -> str:
        return subprocess.run(SharedPages.command(["cat", "/proc/self/autogroup"], client=client), capture_output=True,
                              text=True, check=True, start_new_session=True, timeout=60).stdout
    assert autogroup(True).endswith(" nice 19\n") and autogroup(False).endswith(" nice 0\n")
