"""A client machine's data service: the one process that reads the node's data, its privacy
state and its budget, and answers the node's rounds with fedsd/app/client/handler.py's handlers.

Two ways it runs:

- **The owner's service** (`fedsd data-service --node-config "…" --socket PATH --allow-uid UID`,
  the one way to start it: `python -m` would import from the working directory first, and this
  module's entry point refuses it), started by the data owner from the owner's own installation of fedsd, as the user who alone
  can read the data and the state folder. The SuperNode runs as another user, with node config
  `partition-id=K service='PATH'`: its ClientApp, the code the server ships in the app bundle,
  only forwards each message here and cannot open the data, the state or the budget itself.
  The service answers with its own node config, never one a message brings, checks its peer's
  uid (SO_PEERCRED) on every connection, and reports its version and code hash in every reply.
  Its connection slots are shared out by that uid: a process holds at most 8 connections, a
  uid, all its processes together, at most its share of the 128 (128 divided by the uids the
  service answers: 64 each for the owner and the SuperNode's user), and the whole at most 128;
  records being read likewise (256 MiB a process, a uid's share of 2 GiB). So one user's
  processes holding half frames (each given up on after 30 s) never keep another allowed user
  waiting; past a limit a connection is refused at once, with the reason.
- **The warm worker** (node config `worker=auto`, the default, with the data named in the
  SuperNode's own node config): started by the node's first message, from the app's code, as
  the SuperNode's user. Flower runs every message in a fresh `flwr-clientapp` process that
  exits once it has replied; the worker pays torch's import, the data's loading and the
  trainer's set-up once, as a simulation's Ray actor does. It lives in `state-dir`/worker
  (0700), exits after `worker-idle-seconds` without a message and within a second of the
  process that started it (the SuperNode's SuperExec). One worker per node and version of the
  app's code: its socket is named by a hash of that code.

On the wire, both speak the same frames over a Unix socket: a length, then a JSON header or
Flower's own protobuf serialisation of a RecordDict. Nothing is unpickled, so a peer can send
data, never code. A message is either taken by the service, which says so before it starts
(and then answers, or fails as the ClientApp would), or not taken at all, in which case the
ClientApp starts a fresh worker and asks it once more: a round is never run twice. The
Context's state stays in the service (keyed by run and node): the privacy state, its secret
seed included, never travels back to the ClientApp.
"""  # noqa: E501
from __future__ import annotations

import sys

if __name__ == "__main__":  # before any other import: `python -m` put the working directory first on sys.path
    from os import getcwd

    if not sys.flags.safe_path:
        sys.exit(f"python -m fedsd.app.client.owner_service: refused, as the working directory ({getcwd()}) is first "
                 f"on the import path and a package planted there would run as this user; the owner's service starts "
                 f"with `fedsd data-service` (clients/README.md), and a warm worker is started by its ClientApp with "
                 f"`python -P` (3.11+)")
    if any(a.startswith(("--node-config", "--allow-uid")) for a in sys.argv[1:]):
        sys.exit("python -m fedsd.app.client.owner_service: the owner's data service starts with `fedsd data-service` "
                 "only (clients/README.md); this module's entry point is the warm worker's")

import argparse
import faulthandler
import fcntl
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

from flwr.app import Context, RecordDict

from fedsd.app.client.node_config import (NodeConfig, NodeConfigError, identity_config, owner_pairs, parse,
                                          private_folder)
from fedsd.errors import BudgetRefused
from fedsd.files.state_folder import StateFolderError
from fedsd.app import secure_sum
from fedsd.app.client.forward import (SUN_PATH_MAX, TAKEN, ServiceError, ServiceUnavailable,  # noqa: F401
                                      answer as _answer, connect as _connect, offer as _offer,
                                      reachable as _reachable)
from fedsd.app.client import forward
from fedsd.app.client.service_wire import (FRAME_SECONDS, Refused, Slots, peer_credentials, recv_json,
                                           recv_records, send_frame, send_json)

APP_ROOT = Path(__file__).resolve().parents[3]  # the installed code's folder, the one holding fedsd/
CODE = ("fedsd",)  # the code that answers a node's rounds
START_SECONDS = 120.0  # how long a new worker may take to import torch and listen
MAX_CONTEXTS = 16  # (run, node) states kept in memory; the privacy state is on disk in any case
SERVICE_LOCK = "service.lock"  # in the state folder: held by the owner's service for its life
KINDS = ("train", "evaluate")
# Secure aggregation's stages (fedsd/app/client/secure_stages.py): the owner's service only, whose
# memory alone holds a round's keys.
SECAGG_KINDS = tuple(secure_sum.KINDS.values())
# What the owner's service says when answering failed: the details (a path, a count of the data)
# go to the owner's log only.
FAILED = "the owner's data service could not answer this message; its owner's log has the details"
log = logging.getLogger("fedsd.data_service")


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
    """A cheap name for the code a worker would run (every .py file's path, size and time)."""
    h = hashlib.sha256(str(APP_ROOT).encode())
    for path in _code_files():
        st = path.stat()
        h.update(f"{path.relative_to(APP_ROOT)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def code_hash() -> str:
    """What the owner's service reports in each reply: the SHA-256 of the code that answers
    (every .py file's path and content), comparable with `fedsd data-service --code-hash` run
    over an installation one trusts."""
    h = hashlib.sha256()
    for path in _code_files():
        h.update(f"{path.relative_to(APP_ROOT)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _code_files() -> list[Path]:
    return sorted(p for package in CODE for p in (APP_ROOT / package).rglob("*.py"))


# -- the ClientApp's side ------------------------------------------------------------------------
def ask_service(node: NodeConfig, kind: str, content: RecordDict, context: Context) -> RecordDict:
    """Forward a message to the owner's data service at `node.service` (fedsd.app.client.forward)."""
    return forward.ask_service(node.service, kind, content, context)


def ask_worker(node: NodeConfig, kind: str, content: RecordDict, context: Context) -> RecordDict:
    """The reply to a message from this node's warm worker (started if there is none)."""
    folder = worker_folder(node)
    address = folder / f"{code_id()}.sock"
    for _ in range(2):
        with start_lock(folder):
            sock = _connect(address) or _start_worker(folder, address, node)
            taken = _offer(sock, kind, content, context)
        if taken:
            break
        sock.close()  # an idle worker closing as the message came: not taken, so a new worker
    else:
        raise ServiceUnavailable(f"the warm worker at {address} did not take the message")
    with sock:
        return _answer(sock, kind, folder / "worker.log")


def worker_folder(node: NodeConfig) -> Path:
    """The warm worker's folder: its socket, its start lock and its log (the node's user only)."""
    return private_folder(private_folder(node.state_root) / "worker")


@contextmanager
def start_lock(folder: Path):
    """Held while a worker is started or reached, and while an idle worker closes."""
    fd = os.open(folder / "start.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def _start_worker(folder: Path, address: Path, node: NodeConfig) -> socket.socket:
    """A new warm worker for this node, listening at `address`, connected to."""
    log = folder / "worker.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(APP_ROOT), os.environ.get("PYTHONPATH")) if p)}
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "fedsd.app.client.owner_service", "--socket", str(address),
                                 "--watch-pid", str(os.getppid()), "--idle-seconds", str(node.worker_idle_seconds)],
                                cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return _listening(proc, address, log)


def _listening(proc: subprocess.Popen, address: Path, log: Path, seconds: float = START_SECONDS) -> socket.socket:
    """A connection to the worker `proc` once it listens at `address`. Its socket file exists from
    its bind, before it listens, and is left alone meanwhile: removed as stale (a connection refused
    in between, on a loaded machine), the worker listened at a file no longer there until the wait
    gave up."""
    deadline = time.monotonic() + seconds
    while (sock := _connect(address, remove_stale=False)) is None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise ServiceUnavailable(f"the warm worker exited on start ({log}): " + " | ".join(tail))
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGUSR1)  # its stacks into the log (faulthandler), then stop it
            time.sleep(0.5)
            proc.kill()
            raise ServiceUnavailable(f"the warm worker did not listen within {seconds:.0f} s ({log})")
        time.sleep(0.05)
    return sock


# -- the service's side ------------------------------------------------------------------------
class DataService:
    """Answers messages with fedsd/app/client/handler.py's handlers, one message at a time.

    Every connection is read in a thread of its own, under bounds (a frame's size, its JSON's
    depth, the time it may take to arrive): a connection that sends garbage, or half a frame
    and then nothing, is refused or given up on without holding up any other. A message that
    is taken is answered under one lock (the handlers share the trainer and the privacy state).
    Anything a message makes go wrong, BaseException included, is caught for that message:
    the service answers and goes on.

    `node`: the owner's node config (the owner's service); None for a warm worker, which takes
    the node config its ClientApp (the same user, the same code) sends. `allowed_uids`: who may
    connect besides this process's own user (the owner's service: the SuperNode's user)."""

    def __init__(self, address: Path, node: NodeConfig | None = None, allowed_uids: tuple[int, ...] = (),
                 watch_pid: int | None = None, idle_seconds: float | None = None):
        self.address, self.node = address, node
        self.allowed = {os.geteuid(), *allowed_uids}
        self.watch_pid, self.idle_seconds = watch_pid, idle_seconds
        self.contexts: dict[tuple[int, int], RecordDict] = {}  # (run, node) → the Context's state
        self.identity = None
        self.handlers = None
        self.last = time.monotonic()
        self.busy = 0  # messages taken and not yet answered
        self.closing = False
        self.state_lock = threading.Lock()  # busy / closing: a message is taken, or the worker closes
        self.answer_lock = threading.Lock()  # one message answered at a time
        self.slots = Slots(len(self.allowed))  # each allowed uid has its share of the connections
        self.held = None  # the owner's service: its lock on its state folder, held for its life

    def serve(self) -> None:
        from fedsd.runtime import tune_process

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck service's stacks, on request
        tune_process()
        from fedsd.app.client import handler  # torch, Opacus, fedsd: once, for every round to come

        self.handlers = dict(handler.HANDLERS)
        if self.node is not None:
            from fedsd.app.client import run_stages, secure_stages

            self.handlers.update(secure_stages.HANDLERS)
            self.handlers.update(run_stages.HANDLERS)
        if self.node is not None:
            from fedsd import __version__

            self.identity = {"version": __version__, "code": code_hash()}
        listener = self._listen()
        if self.node is not None:  # the owner's word that it may start its SuperNode now
            print(self.ready_line(), file=sys.stderr, flush=True)
        if self.watch_pid is not None or self.idle_seconds is not None:
            threading.Thread(target=self._watch, daemon=True).start()
        while True:  # never waits on a peer: each connection is read in a thread of its own, or refused
            conn, _ = listener.accept()
            pid, uid = peer_credentials(conn)
            if uid not in self.allowed:
                log.warning("refused a connection from uid %d, which this service does not answer", uid)
                conn.close()  # a user this service does not answer: closed without a word
                continue
            why = self.slots.open((pid, uid))
            if why is not None:
                log.warning("refused a connection from pid %d (uid %d): %s", pid, uid, why)
                conn.setblocking(False)  # a new connection's buffer holds the refusal; never waited on
                _try_send(conn, {"status": "refused", "error": why})
                conn.close()
                continue
            threading.Thread(target=self._connection, args=(conn, (pid, uid)), daemon=True).start()

    def ready_line(self) -> str:
        """What the owner's service says once it listens: where, for which partition, on which
        state folder and data, and for whom."""
        node = self.node
        others = sorted(self.allowed - {os.geteuid()})
        return (f"fedsd data-service: ready: listening at {self.address} (the SuperNode's service='{self.address}') "
                f"for partition-id={node.partition_id}, state folder {node.state_root}, data "
                f"{node.data or 'none (a shard of a built-in data set)'}; answering uid {os.geteuid()}"
                + (f" and {', '.join(map(str, others))}" if others
                   else " only (--allow-uid adds the SuperNode's user)"))

    def _connection(self, conn: socket.socket, peer: tuple[int, int]) -> None:
        """One connection: read and check its message, then take and answer it, or refuse it."""
        def reserve(size: int):  # held until the connection ends: a message read waits in memory
            held.enter_context(self.slots.reserve(peer, size))
            return nullcontext()

        try:
            with conn, ExitStack() as held:
                try:
                    header = recv_json(conn, FRAME_SECONDS)
                    content = recv_records(conn, FRAME_SECONDS, reserve)
                    if header.get("kind") not in KINDS + (SECAGG_KINDS if self.node is not None else ()):
                        raise Refused(f"a message of kind {str(header.get('kind'))[:40]!r}; the kinds are train "
                                      f"and evaluate" + (", and secure aggregation's stages in an owner's data "
                                                         "service" if self.node is None else ""))
                except Refused as e:
                    log.warning("refused a message: %s", e)
                    _try_send(conn, {"status": "refused", "error": str(e)})
                    return
                except (EOFError, OSError):
                    return  # the peer went away
                with self.answer_lock:
                    with self.state_lock:
                        if self.closing:
                            return  # not taken: the caller starts a new worker
                        self.busy += 1
                    try:
                        send_json(conn, TAKEN)
                        log.info("took a %s message", header.get("kind"))  # its time: fedsd.deployment.stage_links
                        reply = self._reply(header, content)
                    except (EOFError, OSError):
                        return  # the ClientApp went away (its SuperNode stopping)
                    finally:
                        with self.state_lock:
                            self.busy, self.last = self.busy - 1, time.monotonic()
                # Sent outside the lock, and given up on if the peer does not read it in time: a
                # peer that never reads its reply holds no one else up.
                conn.settimeout(FRAME_SECONDS)
                try:
                    for frame in reply:
                        send_frame(conn, frame)
                    log.info("answered a %s message", header.get("kind"))
                except OSError as e:
                    log.warning("gave up sending a reply: %s", e)
        except BaseException:  # noqa: BLE001  (nothing a message does ends the service)
            log.exception("a connection failed")
        finally:
            self.slots.close(peer)

    def _listen(self) -> socket.socket:
        if self.address.is_socket():  # left by a service that stopped; refused if one still listens
            other = _connect(self.address)
            if other is not None:
                other.close()
                raise ServiceUnavailable(f"another data service listens at {self.address}")
            self.address.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The owner's service: who may talk to it is decided by its peer's uid (above), so its
        # socket is made 0666 by the bind itself. A chmod by path after it would follow a link
        # put at the address in between (a socket folder another user can write), and make the
        # file it leads to, that user's choice of the owner's files, writable by everyone.
        mask = os.umask(0o111) if self.node is not None else None
        try:
            with _reachable(self.address) as where:
                listener.bind(where)
        finally:
            if mask is not None:
                os.umask(mask)
        listener.listen(64)
        return listener

    def _reply(self, header: dict, content: RecordDict) -> list[bytes]:
        """The frames that answer a taken message: its status, then its records."""
        from flwr.common.serde import recorddict_to_proto

        try:
            context = self._context(header)
            reply = self.handlers[header["kind"]](content, context)
            if self.identity is not None:  # the owner's service says what code answered
                from flwr.app import ConfigRecord

                reply["service"] = ConfigRecord(dict(self.identity))
        except BaseException as e:  # noqa: BLE001  (SystemExit too: the ClientApp raises it, the service goes on)
            from fedsd.app.client.secure_owner import StageRefused

            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            # The owner's service says only that it failed: an error's text can hold a path, or a
            # count of the data. A warm worker is the ClientApp's own process, in effect.
            said = str(e) if isinstance(e, (Refused, StageRefused)) else FAILED if self.node is not None \
                else f"{type(e).__name__}: {e}"
            log.warning("answered a %s message with an error: %s: %s", header.get("kind"), type(e).__name__, e)
            return [json.dumps({"status": "error", "error": said}).encode()]
        return [json.dumps({"status": "ok"}).encode(), recorddict_to_proto(reply).SerializeToString()]

    def _context(self, header: dict) -> Context:
        """The Context a handler sees: the owner's node config (never the one a message brings),
        the run and node the message names, and this service's own state for them."""
        run_id, node_id = int(header["run_id"]), int(header["node_id"])
        node_config = header.get("node_config") or {}
        if not isinstance(node_config, dict):
            raise Refused("a node_config that is not an object")
        if self.node is not None:
            theirs = node_config.get("partition-id")
            if theirs is not None and theirs != self.node.partition_id:
                raise Refused(f"node-config partition-id={str(theirs)[:20]} of the SuperNode, but its data service is "
                              f"partition-id={self.node.partition_id}")
            node_config = self.node.as_node_config()
        state = self.contexts.pop((run_id, node_id), None) or RecordDict()
        self.contexts[(run_id, node_id)] = state  # the most recent last; the oldest dropped past MAX_CONTEXTS
        while len(self.contexts) > MAX_CONTEXTS:
            self.contexts.pop(next(iter(self.contexts)))
        return Context(run_id=run_id, node_id=node_id, node_config=node_config, state=state, run_config={})

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            if self.watch_pid is not None and not _alive(self.watch_pid):
                os._exit(0)  # the SuperNode that asked is gone: so is anyone to answer
            with self.state_lock:
                idle = (self.idle_seconds is not None and not self.busy
                        and time.monotonic() - self.last > self.idle_seconds)
            if idle:
                with start_lock(self.address.parent), self.state_lock:
                    if not self.busy:
                        self.closing = True
                        self.address.unlink(missing_ok=True)
                        os._exit(0)


def _try_send(conn: socket.socket, obj: dict) -> None:
    try:
        send_json(conn, obj)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=None, help="the Unix socket to listen on (required, but with --identity)")
    p.add_argument("--identity", action="store_true",
                   help="print this owner's public identity key, one line for the federation's roster (made in the "
                        "node config's state-dir on first use, mode 0600; its secagg-roster is not read, so the "
                        "identity can be made before the roster lists it), and exit")
    p.add_argument("--node-config", default=None, metavar="'K=V ...'",
                   help="the owner's service: this node's config, as a SuperNode's --node-config (data, max-epsilon, "
                        "state-dir, …; fedsd/app/client/node_config.py), TOML values, though a path may go unquoted "
                        "here (state-dir=/srv/owner/state); without it, a warm worker started by its ClientApp")
    p.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                   help="a user who may send messages besides the service's own (the SuperNode's user)")
    p.add_argument("--watch-pid", type=int, default=None, help="a warm worker: exit when this process does")
    p.add_argument("--idle-seconds", type=float, default=None, help="a warm worker: exit after this long idle")
    p.add_argument("--accept-restored-state", action="store_true",
                   help="the owner's service: accept a state folder older than the owner's record outside it (a "
                        "restored copy, refused at start without this flag, saying by how much): its ledgers are "
                        "raised to the record, the charges they lack added back, so nothing is spent twice")


def print_identity(node_config: str | None) -> int:
    """`--identity`: the owner's public line for the roster, from the key in its state folder
    (made on first use). Only the state folder is read: no partition-id, data or budget is
    needed, and the roster that will list the identity is not read (node_config.identity_config)."""
    from fedsd.secure.identity import load_identity

    if node_config is None:
        raise NodeConfigError("--identity: needs --node-config with this owner's state-dir (--node-config "
                              "\"state-dir='/srv/owner/state'\")")
    print(load_identity(identity_config(owner_pairs(node_config)).state()).line())
    return 0


def identity_main(argv: list[str]) -> int:
    """`fedsd data-service --identity --node-config CONFIG` without the command line's imports (torch),
    `python -P -c` calls it with [CONFIG] (a harness making a hundred owners' identities): the same
    mask, the same identity, the same line."""
    os.umask(0o077)
    try:
        return print_identity(argv[0] if argv else None)
    except NodeConfigError as e:
        print(f"fedsd data-service --identity: error: {e}", file=sys.stderr)
        return 2


def run_service(args: argparse.Namespace) -> int:
    """`fedsd data-service` (the owner's service: its node config, then its state folder resolved,
    held open and locked for its life) and `python -P -m fedsd.app.client.owner_service` (a warm worker):
    the checks first, then serve until stopped."""
    os.umask(0o077)  # everything it writes is the owner's alone
    # The owner's log (standard error): every refusal and failure in full, with the time.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fedsd data-service %(levelname)s: %(message)s")
    if args.identity:
        return print_identity(args.node_config)
    node = None
    if args.node_config is not None:
        node = parse(owner_pairs(args.node_config))
        node.require_budget()
        if node.service:
            raise NodeConfigError("--node-config service=...: that key is the SuperNode's; the service's names data")
    if args.socket is None:
        raise NodeConfigError("--socket: required (the Unix socket the SuperNode's ClientApp forwards to)")
    service = DataService(Path(args.socket).absolute(), node, tuple(args.allow_uid), args.watch_pid, args.idle_seconds)
    if node is not None:
        # The state folder, resolved once and held open for the service's life (fedsd.files.state_folder),
        # and locked: a second service on it is refused here, with the reason.
        state = node.state(pin=True)
        try:
            service.held = state.hold(SERVICE_LOCK, "another data service")
        except StateFolderError as e:
            raise NodeConfigError(f"node-config {e}") from None
        from fedsd.app.client.restored_state import check_on_start

        check_on_start(node, state, accept=args.accept_restored_state)  # a restored, older folder: refused here
    elif args.accept_restored_state:
        raise NodeConfigError("--accept-restored-state: the owner's service's flag (with --node-config)")
    service.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedsd.app.client.owner_service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_service_arguments(p)
    return run_service(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
