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
- Starts the kernel's page merging (`/sys/kernel/mm/ksm`; its settings given back when the last
  deployment using it stops, also after one that was killed: `KsmSettings`) and marks every
  process the deployment starts as mergeable (`prctl(PR_SET_MEMORY_MERGE)`; kept across exec,
  and so for everything the process starts, since Linux 6.7: `check` asks the kernel, through
  /proc/self/ksm_stat, that a process started so is mergeable).
- Starts them without address-space randomisation (`personality(ADDR_NO_RANDOMIZE)`, as
  `setarch -R` does), so that the same imports lay out the same pages.
- Gives each group of processes (the owners' data services; the SuperNodes and their
  ClientApps; the SuperLink, ServerApp and `flwr run`) one Python hash secret (PYTHONHASHSEED),
  drawn from the OS for this deployment. It reaches a process through the environment, which
  only that process's uid (and root) can read, never through a command line, which every uid
  can (Isolation.wrap's `from_env`).

What it costs, and why it is a trial's option and never a deployment's:
- Every process of the deployment has the same addresses as the others, so a flaw in one
  would be easier to exploit in another.
- A group's processes share one hash secret, owners that do not trust each other included, and
  PYTHONHASHSEED is 32 bits where Python draws 128: a process that sees the order of a set can
  search for it, and then flood a dict of another process of its group (a denial of service).
- Merged pages leak, across uids and so across `--isolate`'s boundaries, whether another
  process holds a page of the same content: a write to a merged page takes longer (the known
  deduplication side channel). A ClientApp the server ships could confirm a guess of a whole
  4 KiB page of an owner's records, keys or ledger, which no privacy accounting covers; and
  merged pages are the target of rowhammer attacks on shared memory (Flip Feng Shui).
So a run with it shows what many clients cost and how the protocol behaves, not the isolation.
On separate machines, as real owners run, none of this applies, and none of it is needed.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from fedsd.deployment.processes import DeploymentError, started

KSM = Path("/sys/kernel/mm/ksm")
# The settings ksmd had before the first deployment that changed them, and the deployments (pids)
# using them now: root's alone (0700), locked while read and written.
KSM_STATE = Path("/run/fedsd-share-pages")
# ksmd's pace while a deployment runs: 2,000 pages every 10 ms (up to about 800 MB/s scanned), so
# merging keeps up with a hundred services importing torch at once (the default, 100 pages every
# 20 ms, takes minutes to go once over 20 GiB)
KSM_SETTINGS = {"pages_to_scan": "2000", "sleep_millisecs": "10", "run": "1"}
PR_SET_MEMORY_MERGE, ADDR_NO_RANDOMIZE = 67, 0x0040000
# Run by each started process's launcher: mark it mergeable, turn randomisation off, exec the command
# (both kept across exec, so they hold for what the command starts too).
# Its first argument: the nice value of the process's session (its autogroup, which the kernel
# schedules as one: `start_new_session` gave each process one of its own), kept across exec.
LAUNCH = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MEMORY_MERGE}, 1, 0, 0, 0) != 0:\n"
    "    sys.exit(f'--share-pages: prctl(PR_SET_MEMORY_MERGE): {os.strerror(ctypes.get_errno())}')\n"
    f"libc.personality(libc.personality(0xffffffff) | {ADDR_NO_RANDOMIZE})\n"
    "if sys.argv[1] != '0' and os.path.exists('/proc/self/autogroup'):\n"
    "    open('/proc/self/autogroup', 'w').write(sys.argv[1])\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n")
# The clients' sessions' nice value: a hundred clients' sessions each weigh as much as the server's
# in the kernel's scheduler, so when their round's work came at once (a load of 71 on two cores) the
# ServerApp got a two-hundredth of the CPU, its heartbeat to the SuperLink lapsed (60 s) and the
# SuperLink ended the run. At 19 each weighs 15 against the server's 1,024: the server stands for a
# machine of its own.
CLIENT_NICE = 19
GROUPS = ("owners", "nodes", "server")
# `pace`: a client's processes start at once while this share of the memory is available; under it,
# each waits for the merging to give memory back, at most PACE_SECONDS, while it merges more pages
# within STALL_SECONDS (ksmd's full scans say nothing here: since Linux 6.7 its smart scan skips pages
# that did not merge before, and a scan ends in a second)
FREE_FLOOR, PACE_SECONDS, STALL_SECONDS, MEMINFO, STAT = 0.25, 60.0, 10.0, Path("/proc/meminfo"), Path("/proc/stat")
# A probe that the launcher's mark holds after exec: what the kernel says of the process
PROBE = ("import sys; stat = open('/proc/self/ksm_stat').read()\n"
         "sys.exit(0 if 'ksm_merge_any: yes' in stat else 'the mark did not survive exec (Linux 6.7 and later keep "
         "it)')")


class SharedPages:
    """The kernel's page merging for one deployment: `check` before anything starts, `start`
    and `stop` around it, `command` and `env` for each process it starts."""

    def __init__(self, ksm: Path = KSM, state: Path = KSM_STATE):
        # 1 to 2**32 - 1: PYTHONHASHSEED=0 would turn the hash secret off
        self.seeds = {group: str(1 + secrets.randbelow(2**32 - 1)) for group in GROUPS}
        self.settings = KsmSettings(ksm, state)

    @staticmethod
    def check(ksm: Path = KSM) -> None:
        if os.geteuid() != 0:
            raise DeploymentError("--share-pages needs root: it starts the kernel's page merging (/sys/kernel/mm/ksm)")
        if not (ksm / "run").is_file():
            raise DeploymentError("--share-pages: this kernel has no page merging (/sys/kernel/mm/ksm; CONFIG_KSM)")
        probe = subprocess.run(SharedPages.command([sys.executable, "-I", "-c", PROBE]), capture_output=True,
                               text=True)
        if probe.returncode != 0:
            raise DeploymentError(f"--share-pages: this kernel cannot keep a process mergeable across exec (Linux "
                                  f"6.7 and later): {(probe.stderr.strip().splitlines() or [''])[-1]}")

    def start(self) -> None:
        self.settings.use()

    def pace(self, floor: float = FREE_FLOOR, most: float = PACE_SECONDS, meminfo: Path = MEMINFO,
             stat: Path | None = None) -> float:
        """Before the next client's processes start: wait until at most one other process runs, three
        times in a row half a second apart (the last client is done with its start); then, while less
        than `floor` of the machine's memory is available, for ksmd's merging to give memory back, as
        long as it goes on merging (more pages shared within STALL_SECONDS); `most` seconds at the
        longest in all. Started faster than ksmd merged, a hundred services importing torch went to
        swap before ksmd had seen their pages, and a page swapped out is not merged (4 MiB merged,
        against 32.7 GiB paced). Returns the seconds it waited."""
        began = time.monotonic()
        # first the last client's start itself: its imports done, its pages no longer changing (pages
        # still written are never merged: a hundred services importing at once left 13 GiB volatile)
        quiet = 0  # samples in a row with at most one other process running (the caller is one)
        while time.monotonic() - began < most and quiet < 3:
            quiet = quiet + 1 if runnable(stat or STAT) <= 2 else 0
            time.sleep(0.5)
        shared, changed = self.settings.read("pages_sharing"), time.monotonic()
        while time.monotonic() - began < most and available(meminfo) < floor:
            time.sleep(0.5)
            now, sharing = time.monotonic(), self.settings.read("pages_sharing")
            if sharing > shared:
                shared, changed = sharing, now
            elif now - changed > STALL_SECONDS:  # nothing more to merge: memory will not come back by waiting
                break
        return time.monotonic() - began

    def stop(self) -> None:
        self.settings.release()

    @staticmethod
    def command(cmd: list[str], client: bool = False) -> list[str]:
        """cmd, started mergeable and laid out as the others; a client's at CLIENT_NICE."""
        return [sys.executable, "-I", "-c", LAUNCH, str(CLIENT_NICE if client else 0), *cmd]

    def env(self, group: str) -> dict:
        return {"PYTHONHASHSEED": self.seeds[group]}


def runnable(stat: Path = STAT) -> int:
    """The processes running or ready to run now (/proc/stat's procs_running, this one among them)."""
    return int(next(line for line in stat.read_text().splitlines() if line.startswith("procs_running")).split()[1])


def available(meminfo: Path = MEMINFO) -> float:
    """The share of the machine's memory available (MemAvailable over MemTotal, /proc/meminfo)."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    return int(fields["MemAvailable"].split()[0]) / int(fields["MemTotal"].split()[0])


class KsmSettings:
    """ksmd's pace for the deployments that use it, and its own settings back after the last:
    the first saves them (in `state`, root's), each adds its entry (pid, start, token), the last that stops (or a later
    one that finds only dead pids) writes them back. So two deployments that overlap, or one that
    was killed, leave ksmd as the machine had it."""

    def __init__(self, ksm: Path, state: Path):
        self.ksm, self.state = ksm, state
        self.using = False
        self.token = secrets.token_hex(8)  # this deployment's entry (a process may run more than one)

    @contextmanager
    def _locked(self):
        self.state.mkdir(mode=0o700, exist_ok=True)
        with open(self.state / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.state / "state.json"
            record = json.loads(path.read_text()) if path.is_file() else {}
            record["pids"] = [p for p in record.get("pids", []) if started(p[0]) == p[1]]  # a pid reused is dead
            yield record
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)

    def use(self) -> None:
        if self.using:
            return
        with self._locked() as record:
            if not record["pids"]:  # the first user; after one that was killed, its saved originals stand
                record.setdefault("saved", {name: (self.ksm / name).read_text().strip() for name in KSM_SETTINGS})
            record["pids"].append([os.getpid(), started(os.getpid()), self.token])
            self._write(KSM_SETTINGS)
            self.using = True

    def release(self) -> None:
        """Back to the saved settings when no other deployment uses them (`run` last: merged pages
        stay merged until written)."""
        if not self.using:
            return
        with self._locked() as record:
            record["pids"] = [p for p in record["pids"] if p[2] != self.token]
            if not record["pids"] and record.get("saved"):
                self._write(record.pop("saved"))
            self.using = False

    def read(self, name: str) -> int:
        """One of ksmd's counters (pages_sharing, ...)."""
        return int((self.ksm / name).read_text())

    def _write(self, settings: dict) -> None:
        for name in ("pages_to_scan", "sleep_millisecs", "run"):
            (self.ksm / name).write_text(settings[name])

