"""`--share-pages`: many clients of a local deployment in one machine's memory, for a trial of a
hundred SuperNodes on a machine that would otherwise hold about twenty.

Why it is needed: every client is several Python processes (its owner's data service, its
SuperNode, the SuperNode's SuperExec and warm ClientApp process), and each holds its own copy of
what it imported: torch alone is about 280 MiB of private memory a process, most of it Python
objects and torch's operator tables, identical from one process to the next but for their
addresses and Python's per-process hash secret. Measured on this machine (4 processes importing
the data service's code): 312 MiB private each as they start, 216 MiB with the kernel merging
identical pages (KSM), 30 MiB with KSM and the same layout and hash secret in each.

What it does (each part the kernel's own mechanism; nothing here copies or compares memory):
- Starts the kernel's page merging (`/sys/kernel/mm/ksm`, restored on the way out) and marks
  every process the deployment starts as mergeable (`prctl(PR_SET_MEMORY_MERGE)`, Linux 6.4+,
  inherited by children and kept across exec since 6.7).
- Starts them without address-space randomisation (`personality(ADDR_NO_RANDOMIZE)`, as
  `setarch -R` does), so that the same imports lay out the same pages.
- Gives each group of processes (the owners' data services; the SuperNodes and their
  ClientApps; the SuperLink and ServerApp) one Python hash secret (PYTHONHASHSEED), drawn from
  the OS for this deployment: no group learns another's.

What it costs, and why it is a trial's option and never a deployment's: every process of the
deployment has the same addresses as the others, so a flaw in one would be easier to exploit
in another; the processes of a group share one hash secret (a ClientApp the server ships could
learn its own group's, and flood a dict of another process of that group: a denial of service
only); and merged pages leak, through the time a write to one takes, whether another process
holds a page of the same content (the known deduplication side channel: a guess of a whole
4 KiB page at a time). On separate machines, as real owners run, none of this applies, and
none of it is needed.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from fedsd.deployment.processes import DeploymentError

KSM = Path("/sys/kernel/mm/ksm")
# ksmd's pace while a deployment runs: 2,000 pages every 10 ms (up to about 800 MB/s scanned), so
# merging keeps up with a hundred services importing torch at once (the default, 100 pages every
# 20 ms, takes minutes to go once over 20 GiB)
KSM_SETTINGS = {"pages_to_scan": "2000", "sleep_millisecs": "10", "run": "1"}
PR_SET_MEMORY_MERGE, ADDR_NO_RANDOMIZE = 67, 0x0040000
# Run by each started process's launcher: mark it mergeable, turn randomisation off, exec the command
# (both kept across exec, so they hold for what the command starts too).
LAUNCH = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0) != 0:\n"
    "    sys.exit(f'--share-pages: prctl(PR_SET_MEMORY_MERGE): {os.strerror(ctypes.get_errno())}')\n"
    f"libc.personality(libc.personality(0xffffffff) | {ADDR_NO_RANDOMIZE})\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n")
GROUPS = ("owners", "nodes", "server")


class SharedPages:
    """The kernel's page merging for one deployment: `check` before anything starts, `start`
    and `stop` around it, `command` and `env` for each process it starts."""

    def __init__(self):
        self.seeds = {group: str(secrets.randbelow(2**32)) for group in GROUPS}
        self._saved: dict[str, str] = {}

    @staticmethod
    def check() -> None:
        if os.geteuid() != 0:
            raise DeploymentError("--share-pages needs root: it starts the kernel's page merging (/sys/kernel/mm/ksm)")
        if not (KSM / "run").is_file():
            raise DeploymentError("--share-pages: this kernel has no page merging (/sys/kernel/mm/ksm; CONFIG_KSM)")
        probe = subprocess.run([sys.executable, "-I", "-c", LAUNCH, "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise DeploymentError(f"--share-pages: this kernel cannot mark a process mergeable (Linux 6.4+): "
                                  f"{probe.stderr.strip()}")

    def start(self) -> None:
        for name, value in KSM_SETTINGS.items():
            path = KSM / name
            self._saved.setdefault(name, path.read_text().strip())
            path.write_text(value)

    def stop(self) -> None:
        """ksmd's settings as they were (`run` last: merged pages stay merged until written)."""
        for name in ("pages_to_scan", "sleep_millisecs", "run"):
            if name in self._saved:
                (KSM / name).write_text(self._saved.pop(name))

    @staticmethod
    def command(cmd: list[str]) -> list[str]:
        return [sys.executable, "-I", "-c", LAUNCH, *cmd]

    def env(self, group: str) -> dict:
        return {"PYTHONHASHSEED": self.seeds[group]}


def merged_mib() -> float:
    """What the merging saves now: pages_sharing (mappings of a merged page beyond its first) in MiB."""
    try:
        return int((KSM / "pages_sharing").read_text()) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0

