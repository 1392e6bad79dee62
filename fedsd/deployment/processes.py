"""The processes a local deployment (fedsd/deployment/local_deployment.py) starts, and how they
are known and stopped: a process group each, its descendants read from /proc by pid and start
time (a later process given the same pid is never signalled)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


class DeploymentError(RuntimeError):
    """A deployment's process did not start or answer, or --isolate cannot be set up here."""


def running(proc: subprocess.Popen) -> bool:
    """Whether anything of proc's process group still runs. Its leader is reaped first: an exited
    leader not yet waited for is a zombie, which the group keeps, so the group looked alive (every
    stop waited out its grace and the kill's 5 s: 7 s a process, 2.5 min for ten isolated owners)."""
    proc.poll()
    return group_alive(proc.pid)


def started(pid: int) -> str | None:
    """pid's start time (None once it has exited): with the pid, it names one process, not a later
    one given the same pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields[19]  # state, then starttime (proc(5): fields 3 and 22)


def descendants(pid: int) -> list[tuple[int, str]]:
    """pid's descendants as (pid, start time), read from /proc."""
    found, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(c) for c in children.read_text().split()]
            except OSError:
                continue
            found += [(c, t) for c in kids if (t := started(c)) is not None]
            todo += kids
    return found


def stop_children(children: list[tuple[int, str]], grace: float) -> None:
    """The processes in `children` that still run: SIGTERM, then SIGKILL after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        alive = [(c, t) for c, t in children if started(c) == t]
        for c, _ in alive:
            try:
                os.kill(c, sig)
            except OSError:  # gone, or not ours to signal: the stop goes on to the rest
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [(c, t) for c, t in alive if started(c) == t]
        if not alive:
            return


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_groups(procs: list[tuple[subprocess.Popen, list[tuple[int, str]]]], grace: float) -> None:
    """Stops each proc's process group, then its descendants outside the group that still run:
    those found now and those known from before (each checked by its start time). Every group is
    signalled before any is waited for, so a stop of a hundred clients takes one grace, not a
    hundred (two seconds each, one after another, took minutes)."""
    # taken before the signal: a child in a session of its own (Flower's SuperLink starts its
    # SuperExec so) is not in the group, and under load it outlived the SuperLink's stop
    children = sorted({c for proc, known in procs for c in [*known, *(descendants(proc.pid) if running(proc) else [])]})
    alive = [proc for proc, _ in procs if running(proc)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for proc in alive:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [proc for proc in alive if running(proc)]
        if not alive:
            break
    for proc, _ in procs:
        try:
            proc.wait(timeout=0.1 if alive else 1)
        except subprocess.TimeoutExpired:
            pass
    stop_children(children, grace)
