"""A SuperNode whose ClientApps start warm: `python -P -m fedsd.deployment.warm_supernode ARGS`
runs `flower-supernode ARGS --isolation process` and, beside it, Flower's own SuperExec loop
(`run_superexec`) with one change: each `flwr-clientapp` task is forked from a process that has
imported Flower once (`ZYGOTE`), not started as a new interpreter.

Why: Flower starts a fresh `flwr-clientapp` process for every message a node receives, and its
start (the interpreter, Flower's import) costs about 1.3 s of CPU before the app runs. A round
of secure aggregation is six messages to each node; on a machine where ten nodes share two
cores that start was most of each stage (results/deploy-distributed.md). Forked from the warm
process, a task pays only what it does: pull its message, load the app, answer.

What a task gets is what `flwr-clientapp` would have: a process of its own, run by the node's
user, running Flower's `run_clientapp` unchanged, with the program name and the log line of
Flower's command. The warm process is a fresh interpreter (`python -P -c ZYGOTE`) that imported
Flower and nothing of fedsd (so the app bundle's own `fedsd` modules load in the task, as in
Flower's start; where the node's tasks train, with no owner's service, it also imports the training
libraries the tasks import, torch, torchvision and opacus: `preloads`), holds no task's state, key or
data, and takes its launch requests on a pipe
from this process alone: a task cannot reach it (its end of the pipe is closed in the task, and
the warm process, like this one, is not dumpable: no process of the node's uid opens its files
under /proc or traces it, as Flower's own SuperExec guards itself).
Written here rather than with multiprocessing's forkserver, whose listening socket any task of
the node could use, and whose children import the parent's main module (this one, and with it
the installed fedsd).

Flower's SuperNode sleeps a fixed 3 s after each pull that found no message
(flwr/supernode/start_client_internal.py; no option sets it), so every stage of a round waits up to
3 s for its slowest node. `--pull-interval S` (0.1 to 3; first, before Flower's options) runs the
same `flower-supernode` with that module's wait after an empty pull (a request to the SuperLink)
capped at S, and its 0.5 s waits for its own task's reply (a look into its own state, in memory)
at 0.05 s. It also rings a bell (a pipe to this process) once a pulled message is stored, before
its objects are pulled, and the SuperExec's wait between asks for a task ends at the ring: its own
poll (a request to the node) becomes a fallback of at least 2 s. Each of the node, its tasks and
the ServerApp's Grid waits 0.05 s, not Flower's 1 s, before asking again for an object not there
yet. Left out, the node is Flower's command as it is.

Each task also pays less than Flower's start of it would: the warm process has imported what
every task imported on its own (httpx's transport, the standard modules the app's forwarder
uses), and a bundle Flower unzipped, checked and installed once (named by its full SHA-256) is
not unzipped and checked again at every task: Flower keeps the installed folder either way.
A task builds no telemetry event that is not sent (FLWR_TELEMETRY_ENABLED=0, which the local
deployments set: Flower builds each event whole, a `file` subprocess among it, and waits for it at
the task's exit, sent or not), and the warm process's heap is frozen before it forks (Python's
`gc.freeze` recipe), so a task's collections neither walk nor copy it. With these, ten owners'
tasks took about 1 CPU-second a round, not 2.4 (results/deploy-distributed.md).

Both processes are in this process's group: stopping the group stops the node, its SuperExec
and its tasks; this process exits when the SuperNode does, with its status. Options of
Flower's SuperExec this launcher does not pass on (the Runtime API's TLS, SuperExec
authentication, installing an app's dependencies at run time) are refused.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

PR_SET_PDEATHSIG = 1  # prctl(2)

# Flower's pull of objects (`pull_objects` and what calls it) with its first wait for an object not
# there yet shortened: both the warm process and the node take it, each an interpreter of its own.
FIRST_WAIT = r'''
import functools, inspect


def first_wait(function, seconds):
    # Flower's function with its first wait for an object not there yet at `seconds` (Flower's is
    # 1 s, doubling to 10 s; the doubling, cap and tries stay Flower's); as it is where a Flower
    # takes no such keyword.
    if "initial_backoff" not in inspect.signature(function).parameters:
        return function
    return functools.partial(function, initial_backoff=seconds)
'''

# The warm process: imports Flower once, then forks one task a line read from its stdin (the
# launcher's pipe) and ends when the pipe does. Ended tasks are reaped by the kernel (SIGCHLD
# ignored; a task gets the default back, for its own children).
ZYGOTE_PRELUDE = FIRST_WAIT + r'''
import gc
gc.disable()  # Python's recipe for a process that forks without exec (the gc module's freeze): see the loop
import json, os, signal, sys, traceback
from logging import INFO
import ctypes
from flwr.supercore import log
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supercore.utils import disable_process_dumping
from flwr.supernode.runtime.run_clientapp import run_clientapp
import flwr.supernode.runtime.run_clientapp as task_module
import hashlib, pathlib
# What every task imported on its own, a third of its CPU: httpx's transport (httpcore, h11, imported
# at a client's first use) and the standard modules the app's forwarder imports.
import httpcore, h11, getpass, tomllib, termios, faulthandler  # noqa: F401
from flwr.supercore.utils import get_flwr_home
# A node whose tasks train (no owner's service): the libraries each task imported on its own
# (preloads), about 5 s of CPU a task; fedsd itself still loads from the app bundle in the task.
import importlib, logging
handlers = logging.root.handlers[:]
for name in sys.argv[1:]:
    importlib.import_module(name)
logging.root.handlers[:] = handlers  # opacus' import adds a handler to the root logger: every line twice

disable_process_dumping(strict=False)  # no task of this uid reopens its pipe or traces it (/proc, ptrace)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
program = os.path.join(os.path.dirname(sys.executable), "flwr-clientapp")
flower_install = task_module.install_from_fab


def install_once(fab_file, *args, **kwargs):
    # Flower's install_from_fab unzips and checks the whole bundle at every task, then keeps the
    # folder already installed for it (another third of a task). Here a bundle Flower installed
    # and checked once, named by its full SHA-256, is not unzipped again: its folder is the one
    # Flower returned (anything of the node's uid can change that folder, with or without this).
    if not isinstance(fab_file, bytes) or args or set(kwargs) != {"skip_prompt"} or kwargs["skip_prompt"] is not True:
        return flower_install(fab_file, *args, **kwargs)
    apps = get_flwr_home() / "apps"
    seen = apps / ".installed" / hashlib.sha256(fab_file).hexdigest()
    try:
        path = pathlib.Path(seen.read_text())
        if path.is_absolute() and path.parent == apps and path.is_dir():
            return path
    except (OSError, ValueError):
        pass
    path = flower_install(fab_file, *args, **kwargs)
    try:
        seen.parent.mkdir(parents=True, exist_ok=True)
        seen.with_suffix(f".{os.getpid()}").write_text(str(path))
        os.replace(seen.with_suffix(f".{os.getpid()}"), seen)
    except OSError:
        pass
    return path


task_module.install_from_fab = install_once

# Flower builds each telemetry event whole (its platform's details: a `file` subprocess for the
# architecture) on a thread of its own, and a task waits for it before it exits, even where
# FLWR_TELEMETRY_ENABLED=0 says it is not sent. A task neither builds nor waits for an event that is
# not sent; with telemetry on, Flower's event as it is.
from concurrent.futures import Future
from flwr.supercore import telemetry
import flwr.supercore.exit.exit as exit_module


def unsent(event_type, event_details=None):
    done = Future()
    done.set_result("disabled")  # what Flower's event resolves to when telemetry is off
    return done


if telemetry.FLWR_TELEMETRY_ENABLED != "1":
    for module in (task_module, exit_module):
        if getattr(module, "event", None) is telemetry.event:
            module.event = unsent
# A task its SuperExec took while the node was still pulling the message's objects waits for them.
task_module.pull_and_inflate_object_from_tree = first_wait(task_module.pull_and_inflate_object_from_tree, 0.05)
'''
ZYGOTE_LOOP = r'''
# What this process imported is frozen: a task's collections never walk it (each object of it
# written in a task is a page copied), and this process collects nothing (gc's documentation:
# disable early in the parent, freeze before fork, enable in the child).
gc.freeze()
for line in iter(sys.stdin.buffer.raw.readline, b""):  # unbuffered: a task holds no later request
    try:
        task = json.loads(line)
        if os.fork() != 0:
            continue
    except Exception:
        traceback.print_exc()
        continue
    gc.enable()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    ctypes.CDLL(None).prctl(4, 1)  # 4: PR_SET_DUMPABLE, as a task Flower starts is (its pipe is closed now)
    sys.argv = [program]
    code = 1
    try:
        log(INFO, "Start `flwr-clientapp` process")
        run_clientapp(runtime_api_address=task["address"], token=task["token"], insecure=task["insecure"],
                      certificates=validate_and_resolve_root_certificates(task["certificates"], task["insecure"]),
                      parent_pid=task["parent_pid"], runtime_dependency_install=False)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
'''

# flower-supernode with its pull loop's sleeps capped (--pull-interval): Flower's own entry point,
# started after one change to the module that runs the loop (no other sleep, timer or module).
NODE_PATCH = FIRST_WAIT + r'''
import os, sys, time, types
import flwr.supernode.start_client_internal as loop
from flwr.supernode.cli import flower_supernode
interval, bell = float(sys.argv.pop(1)), int(sys.argv.pop(1))
if getattr(loop, "time", None) is not time or not all(
        callable(getattr(loop, name, None)) for name in ("_pull_and_store_message", "pull_objects")) or \
        "pull_objects" not in loop._pull_and_store_message.__code__.co_names or \
        "initial_backoff" not in inspect.signature(loop.pull_objects).parameters:
    sys.exit("warm_supernode: this Flower's SuperNode loop is not the one --pull-interval knows; leave it out")
sleep = time.sleep


def capped(seconds):
    # Flower's 3 s follows a pull that found nothing (a request to the SuperLink): capped at the
    # interval. Its 0.5 s waits are for this node's own task's reply, a look into its own state
    # in memory: 0.05 s.
    sleep(min(seconds, interval) if seconds >= 1 else min(seconds, 0.05))


names = {k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
loop.time = types.SimpleNamespace(**{**names, "sleep": capped})
rang = []


def ring():
    # A message is in the node's state: its SuperExec need not wait out its poll to take it.
    try:
        os.write(bell, b".")
    except BlockingIOError:  # the launcher's end is full: it reads at once, so a ring is pending
        pass
    except OSError as e:  # its end gone (the launcher is ending) or never given: said once
        if not rang:
            print(f"warm_supernode: the node's bell does not ring ({e}): its SuperExec polls", file=sys.stderr)
        rang.append(e)


flower_pull_objects = first_wait(loop.pull_objects, 0.05)


def pull_objects(*args, **kwargs):
    # Called once a pulled message is stored and its task created: the task starts while the node
    # pulls the objects (it waits for them as the node does). A message is seen once its sender's
    # PushMessages is in, before its objects are: Flower's first wait for an object not there yet
    # is 1 s (doubling to 10 s); 0.05 s here, the doubling, its cap and the tries Flower's.
    ring()
    return flower_pull_objects(*args, **kwargs)


loop.pull_objects = pull_objects
'''
NODE_START = r'''
sys.argv[0] = "flower-supernode"
flower_supernode()
'''
ZYGOTE, NODE = ZYGOTE_PRELUDE + ZYGOTE_LOOP, NODE_PATCH + NODE_START
PULL_INTERVALS = (0.1, 3.0)  # seconds: from a tenth of a second to Flower's own
# With the node's bell, the SuperExec's own poll is only a fallback: at least this many seconds.
BELL_FALLBACK = 2.0


def seconds(text: str) -> float:
    """A pull interval read from text: seconds within PULL_INTERVALS, else ValueError (argparse's type)."""
    value = float(text)  # "nan" is refused below: no comparison holds for it
    if not PULL_INTERVALS[0] <= value <= PULL_INTERVALS[1]:
        raise ValueError(text)
    return value


seconds.__name__ = f"seconds from {PULL_INTERVALS[0]:g} to {PULL_INTERVALS[1]:g}"  # argparse's message


def pull_interval(args: list[str]) -> float | None:
    """Takes `--pull-interval S` (or `--pull-interval=S`) off the front of args, checked."""
    if not args or not args[0].startswith("--pull-interval"):
        return None
    head = args.pop(0)
    value = head.partition("=")[2] if "=" in head else (args.pop(0) if args else "")
    try:
        return seconds(value)
    except ValueError:
        raise SystemExit(f"warm_supernode: --pull-interval {value!r}: {seconds.__name__} (Flower's own)") from None


def supernode_options(args: list[str]) -> dict:
    """args as `flower-supernode` reads them (its own parser, abbreviations included); --isolation
    None where not given."""
    from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode  # Flower's parser: its reading

    parser = _parse_args_run_supernode()
    parser.set_defaults(isolation=None)  # given at all, it is refused: this launcher's is `process`
    return vars(parser.parse_args(args))


def runtime_address(args: list[str]) -> str:
    """The SuperNode's Runtime API, where its SuperExec asks for tasks: its --host at its --port,
    as `flower-supernode` reads them (its own parser, abbreviations included). An option this
    launcher would not pass on to the SuperExec (the Runtime API's TLS, SuperExec authentication,
    run-time dependency installation, another isolation) is refused, naming it."""
    given = supernode_options(args)
    unsupported = {"ssl_certfile": "--ssl-certfile", "ssl_keyfile": "--ssl-keyfile",
                   "ssl_ca_certfile": "--ssl-ca-certfile", "superexec_auth_secret_file": "--superexec-auth-secret-file",
                   "runtime_dependency_install": "--allow-runtime-dependency-installation"}
    for key, option in unsupported.items():
        if given.get(key):
            raise SystemExit(f"warm_supernode: {option} is not taken here (its ClientApps are forked without it); "
                             f"run flower-supernode itself for it")
    if given.get("isolation") is not None:
        raise SystemExit("warm_supernode: --isolation is its own (process, beside its SuperExec); leave it out")
    host = given["host"]
    return f"[{host}]:{given['port']}" if ":" in host else f"{host}:{given['port']}"


# What a task that trains imports of the environment's libraries (the app bundle brings fedsd alone)
TRAINING_LIBRARIES = ("torch", "torchvision", "opacus")


def preloads(args: list[str]) -> tuple[str, ...]:
    """The libraries the warm process imports for its tasks: those a training task imports where
    the node's tasks train (its node config names no owner's service); none where each task only
    forwards to the owner's service (under --isolate), whose warm process stays Flower's alone."""
    from flwr.common.config import parse_config_args

    config = supernode_options(args)["node_config"]
    return () if "service" in parse_config_args([config] if config else None) else TRAINING_LIBRARIES


class ForkExecutor:
    """Flower's SubprocessExecutor for every task type but the ClientApp, which is forked warm;
    if the warm process cannot take a task (it died, and a new one failed too), that task is
    started as Flower starts it."""

    def __init__(self, preload: tuple[str, ...] = ()):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.cold = SubprocessExecutor()
        self.zygote: subprocess.Popen | None = None
        self.preload = preload  # modules the warm process imports before it forks (preloads)
        self._warm()  # it imports Flower while the SuperNode connects

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.cold.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:
        self.cold.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP or spec.runtime_dependency_install:
            return self.cold.launch(spec)
        line = json.dumps(dict(address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                               certificates=spec.root_certificates_path, parent_pid=spec.parent_pid)) + "\n"
        for _ in range(2):
            try:
                self._warm().stdin.write(line.encode())
                self.zygote.stdin.flush()
                return LaunchResult.accepted()
            except OSError:  # it died: one new one
                self._drop()
        return self.cold.launch(spec)

    def _warm(self) -> subprocess.Popen:
        if self.zygote is None or self.zygote.poll() is not None:
            self.zygote = subprocess.Popen([sys.executable, "-P", "-c", ZYGOTE, *self.preload], stdin=subprocess.PIPE)
        return self.zygote

    def reconcile(self) -> None:
        pass

    def _drop(self) -> None:
        if self.zygote is not None:
            try:
                self.zygote.stdin.close()  # it ends with its pipe
            except OSError:
                pass
            self.zygote = None

    def close(self) -> None:
        self._drop()
        self.cold.close()


def listen(bell: int, rung: threading.Event) -> None:
    """Sets rung at every ring on the bell's pipe, until the node closes its end."""
    while os.read(bell, 4096):
        rung.set()


def wait_for(rung: threading.Event, seconds: float) -> None:
    """The SuperExec's wait between asks for a task: until the node rings, at most
    max(seconds, BELL_FALLBACK). A ring during an ask is kept: the next wait ends at once."""
    rung.wait(max(seconds, BELL_FALLBACK))
    rung.clear()


def vars_of(module) -> dict:
    return {k: getattr(module, k) for k in dir(module) if not k.startswith("_")}


def main(args: list[str] | None = None) -> None:
    from flwr.supercore.utils import disable_process_dumping

    disable_process_dumping(strict=False)  # as Flower's own SuperExec: no task of this uid traces it
    args = list(sys.argv[1:] if args is None else args)
    interval = pull_interval(args)
    address = runtime_address(args)
    bell, rung = None, threading.Event()
    if interval is None:
        command = ["flower-supernode"]
    else:  # the node rings when a message is in its state; the SuperExec's wait ends at the ring
        bell, ringer = os.pipe()
        os.set_blocking(ringer, False)
        command = [sys.executable, "-P", "-c", NODE, repr(interval), str(ringer)]
    # The node ends with this process (killed alone, it would leave the node connected, running no task).
    node = subprocess.Popen([*command, *args, "--isolation", "process"], pass_fds=() if bell is None else (ringer,),
                            preexec_fn=lambda: ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM))
    if bell is not None:
        os.close(ringer)
        threading.Thread(target=listen, args=(bell, rung), daemon=True).start()

    def end_with_node():
        # This process ends with its SuperNode, with its exit status (a node refused by the
        # SuperLink exits, and so does this). Flower's parent-pid monitor cannot tell: a child
        # that exited stays a process until its parent reaps it. Tasks in flight watch this pid.
        code = node.wait()
        os._exit(code if code >= 0 else 128 - code)

    threading.Thread(target=end_with_node, daemon=True).start()

    def stop(signum, _frame):
        node.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    from flwr.supercore.superexec import run_superexec as flower

    # The changes to Flower's SuperExec: its executor (Flower picks it by name from two kinds), and,
    # with the node's bell, its wait between asking for a task: until the bell, its poll a fallback.
    flower.get_executor = lambda *_args, **_kwargs: ForkExecutor(preloads(args))
    if bell is not None:
        flower.time = types.SimpleNamespace(**{**vars_of(time), "sleep": lambda s: wait_for(rung, s)})
    try:
        flower.run_superexec(runtime_api_address=address, insecure=True)
    finally:
        if node.poll() is None:
            node.terminate()


if __name__ == "__main__":
    main()
