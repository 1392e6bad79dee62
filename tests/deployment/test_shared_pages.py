"""--share-pages (fedsd/deployment/shared_pages.py): the processes a deployment starts are
mergeable by the kernel and laid out alike, each group with a hash secret of its own, and
ksmd's settings come back as they were."""
from __future__ import annotations

import json
import sys

import pytest

from fedsd.deployment.local_deployment import LocalDeployment
from fedsd.deployment.processes import DeploymentError
from fedsd.deployment.shared_pages import GROUPS, KSM, SharedPages

# What a started process reports of itself: KSM's merge-any flag (PR_GET_MEMORY_MERGE), its
# personality, where its executable was mapped, and its hash secret.
REPORT = ("import ctypes, json, os; libc = ctypes.CDLL(None); "
          "print(json.dumps([libc.prctl(68, 0, 0, 0, 0), libc.personality(0xffffffff), "
          "open('/proc/self/maps').readline().split('-')[0], os.environ.get('PYTHONHASHSEED')]))")


def unavailable() -> str | None:
    try:
        SharedPages.check()
    except DeploymentError as e:
        return str(e)
    return None


needs_ksm = pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")


@pytest.mark.slow
@needs_ksm
def test_a_started_process_is_mergeable_and_laid_out_as_the_others(tmp_path):
    import subprocess

    reports = [json.loads(subprocess.run(SharedPages.command([sys.executable, "-c", REPORT]), capture_output=True,
                                         text=True, check=True).stdout) for _ in range(2)]
    merge, personality, base, _ = reports[0]
    assert merge == 1
    assert personality & 0x0040000  # ADDR_NO_RANDOMIZE
    assert base == reports[1][2]  # the same address twice: no randomisation
    plain = json.loads(subprocess.run([sys.executable, "-c", REPORT], capture_output=True, text=True,
                                      check=True).stdout)
    assert plain[0] == 0 and not plain[1] & 0x0040000  # without it, neither


def test_each_group_has_a_hash_secret_of_its_own_drawn_for_each_deployment():
    one, two = SharedPages(), SharedPages()
    seeds = [one.env(g)["PYTHONHASHSEED"] for g in GROUPS]
    assert len(set(seeds)) == len(GROUPS) and all(s.isdigit() and int(s) < 2**32 for s in seeds)
    assert seeds != [two.env(g)["PYTHONHASHSEED"] for g in GROUPS]


@pytest.mark.slow
@needs_ksm
def test_a_deployment_starts_its_processes_so_and_gives_ksmd_back_its_settings(tmp_path):
    before = {name: (KSM / name).read_text() for name in ("run", "pages_to_scan", "sleep_millisecs")}
    with LocalDeployment(tmp_path / "work", 1, share_pages=True) as deployment:
        deployment._network()
        assert (KSM / "run").read_text().strip() == "1"
        proc = deployment._start("report", [sys.executable, "-c", REPORT])
        proc.wait(timeout=60)
        merge, personality, _, seed = json.loads((deployment.logs / "report.log").read_text())
        assert merge == 1 and personality & 0x0040000
        assert seed == deployment.shared_pages.env("nodes")["PYTHONHASHSEED"]  # a node's, by default
        assert deployment._server_env["PYTHONHASHSEED"] == deployment.shared_pages.env("server")["PYTHONHASHSEED"]
    assert {name: (KSM / name).read_text() for name in before} == before
