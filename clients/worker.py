"""A deployed SuperNode's warm worker: the process that answers the node's rounds.

Flower (1.41) runs every message a SuperNode receives in a fresh `flwr-clientapp` process that
exits once it has replied, and offers no ClientApp process that lives across rounds. Run in
that process, a round would pay torch's and Opacus' imports, the data's loading and the
trainer's set-up every time (several seconds: results/deploy-vs-sim.md), where a simulation's
Ray actor pays them once. So the ClientApp (clients/app.py), which imports only Flower, hands
each message's content and Context to this worker over a Unix socket and returns its reply.
The worker runs the same handlers the ClientApp would (clients/local.py), keeps the data and
the trainer between rounds as a Ray actor does, and sends back the reply and the Context's new
state. Nothing leaves the client's machine that the ClientApp would not have sent.

Where it lives: the node's own state folder (`state-dir`/worker, mode 0700), with a random key
that only the node's user can read (a connection without it is refused). One worker per node
and version of the app's code: its socket is named by a hash of the code it runs, so a new
app version starts a new worker and the old one idles out.

Its lifetime: the first message that finds no worker starts one (under a lock: two messages
never start two). It exits after `worker-idle-seconds` without a message, and within a second
of the process that started the ClientApp (the SuperNode's SuperExec) exiting. It stays in the
SuperNode's process group, so stopping that group stops it too. A message is either taken by
the worker, which says so before it starts (and then answers, or fails as the ClientApp would),
or not taken at all, in which case the ClientApp starts a fresh worker and asks it once more:
a round is never run twice.
"""
from __future__ import annotations

import argparse
import faulthandler
import fcntl
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from flwr.app import Context, RecordDict

from clients.node_config import NodeConfig
from fedsd.errors import BudgetRefused

APP_ROOT = Path(__file__).resolve().parents[1]  # the installed app's folder (clients/, fedsd/, task/)
CODE = ("clients", "fedsd", "task")  # what a worker runs: its socket is named by this code
START_SECONDS = 120.0  # how long a new worker may take to import torch and listen
TAKEN = "taken"  # the worker's word that it has the message and will answer it


class WorkerError(RuntimeError):
    """The warm worker stopped while answering a message it had taken."""


class WorkerUnavailable(RuntimeError):
    """No warm worker could be started or reached; the message was not taken (the ClientApp
    answers it in its own process instead)."""


def wanted(node: NodeConfig) -> bool:
    """Whether this message goes to the warm worker: the node allows it (worker=auto) and this
    process is Flower's per-message `flwr-clientapp` (in a simulation the ClientApp's process,
    a Ray actor, already lives across rounds; in a test it is the test's), and the node does
    not refuse every run outright (own data without an owner's budget)."""
    if node.worker != "auto" or Path(sys.argv[0]).name != "flwr-clientapp":
        return False
    try:  # a node that refuses before reading its data starts nothing and writes nothing
        node.require_budget()
    except BudgetRefused:
        return False
    return True


def code_id() -> str:
    """A hash of the code a worker would run (every .py file's path, size and time)."""
    h = hashlib.sha256(str(APP_ROOT).encode())
    for package in CODE:
        for path in sorted((APP_ROOT / package).rglob("*.py")):
            stat = path.stat()
            h.update(f"{path.relative_to(APP_ROOT)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def folder_of(node: NodeConfig) -> Path:
    folder = node.state_root / "worker"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # the node's user only: its socket, its key, its log
    return folder


@contextmanager
def start_lock(folder: Path):
    """Held while a worker is started or reached, and while an idle worker closes."""
    with open(folder / "start.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _key(folder: Path) -> bytes:
    path = folder / "key"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()


def _connect(address: Path, key: bytes) -> Connection | None:
    if not address.exists():
        return None
    try:
        return Client(str(address), family="AF_UNIX", authkey=key)
    except (ConnectionRefusedError, FileNotFoundError):  # a worker that has gone: a new one
        address.unlink(missing_ok=True)
        return None


def _start(folder: Path, address: Path, key: bytes, node: NodeConfig) -> Connection:
    """A new worker for this node, listening at `address`, connected to."""
    log = folder / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(APP_ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "clients.worker", "--socket", str(address),
                                 "--watch-pid", str(os.getppid()), "--idle-seconds", str(node.worker_idle_seconds)],
                                cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_SECONDS
    while (conn := _connect(address, key)) is None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise WorkerUnavailable(f"the warm worker exited on start ({log}): " + " | ".join(tail))
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGUSR1)  # its stacks into the log (faulthandler), then stop it
            time.sleep(0.5)
            proc.kill()
            raise WorkerUnavailable(f"the warm worker did not listen within {START_SECONDS:.0f} s ({log})")
        time.sleep(0.05)
    return conn


def ask(node: NodeConfig, kind: str, content: RecordDict, context: Context) -> RecordDict:
    """The reply to a message, from this node's warm worker (started if there is none). The
    Context's state becomes the one the worker leaves, as if the handler had run here."""
    folder = folder_of(node)
    address = folder / f"{code_id()}.sock"
    for _ in range(2):
        with start_lock(folder):
            key = _key(folder)
            conn = _connect(address, key) or _start(folder, address, key, node)
            try:
                conn.send((kind, content, context))
                taken = conn.recv() == TAKEN
            except (EOFError, OSError):
                taken = False
        if taken:
            break
        conn.close()  # an idle worker closing as the message came: not taken, so a new worker
    else:
        raise WorkerUnavailable(f"the warm worker at {address} did not take the message")
    with conn:
        try:
            status, payload, state = conn.recv()
        except (EOFError, OSError):
            raise WorkerError(f"the warm worker stopped while answering a {kind} message "
                              f"(see {folder / 'worker.log'})") from None
    if status == "error":
        raise WorkerError(payload)
    context.state = state
    return payload


# -- the worker's side ---------------------------------------------------------------------------
class Worker:
    """Accepts one message at a time and answers it with clients/local.py's handlers."""

    def __init__(self, address: Path, watch_pid: int, idle_seconds: float):
        self.address, self.watch_pid, self.idle_seconds = address, watch_pid, idle_seconds
        self.folder = address.parent
        self.last = time.monotonic()
        self.busy = False
        self.closing = False
        self.state_lock = threading.Lock()  # busy / closing: a message is taken, or the worker closes

    def serve(self) -> None:
        from fedsd.runtime import tune_process

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck worker's stacks, on request
        tune_process()
        from clients import local  # torch, Opacus, fedsd: once, for every round to come

        listener = Listener(str(self.address), family="AF_UNIX", authkey=_key(self.folder))
        threading.Thread(target=self._watch, daemon=True).start()
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a caller without the key, or one gone
                continue
            with conn:
                try:
                    kind, content, context = conn.recv()
                except (EOFError, OSError):
                    continue
                with self.state_lock:
                    if self.closing:
                        return  # not taken: the caller starts a new worker
                    self.busy = True
                try:
                    conn.send(TAKEN)
                    try:
                        reply = ("ok", local.HANDLERS[kind](content, context), context.state)
                    except Exception as e:  # the ClientApp raises it, as if the handler had run there
                        traceback.print_exc(file=sys.stderr)
                        sys.stderr.flush()
                        reply = ("error", f"{type(e).__name__}: {e}", None)
                    conn.send(reply)
                except (EOFError, OSError):
                    pass  # the ClientApp went away (its SuperNode stopping)
                finally:
                    with self.state_lock:
                        self.busy, self.last = False, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if not _alive(self.watch_pid):
                os._exit(0)  # the SuperNode that asked is gone: so is anyone to answer
            with self.state_lock:
                idle = not self.busy and time.monotonic() - self.last > self.idle_seconds
            if idle:
                with start_lock(self.folder), self.state_lock:
                    if not self.busy:
                        self.closing = True
                        self.address.unlink(missing_ok=True)
                        os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="the Unix socket to listen on (its folder holds the key)")
    p.add_argument("--watch-pid", type=int, required=True, help="exit when this process does")
    p.add_argument("--idle-seconds", type=float, required=True, help="exit after this long without a message")
    args = p.parse_args(argv)
    Worker(Path(args.socket), args.watch_pid, args.idle_seconds).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
