"""A SuperNode whose ClientApps start warm: `python -P -m fedsd.deployment.warm_supernode ARGS`
runs `flower-supernode ARGS --isolation process` and, beside it, Flower's own SuperExec loop
(`run_superexec`) with one change: each `flwr-clientapp` task is forked from a process that has
imported Flower once (multiprocessing's forkserver, its preload), not started as a new
interpreter.

Why: Flower starts a fresh `flwr-clientapp` process for every message a node receives, and its
start (the interpreter, Flower's import) costs about 1.3 s of CPU before the app runs. A round
of secure aggregation is six messages to each node; on a machine where ten nodes share two
cores that start was most of each stage (results/deploy-distributed.md). Forked from the warm
process, a task pays only what it does: pull its message, load the app, answer. Each task is
still a process of its own, started clean (the forkserver holds no task's state, no key, no
data: nothing of a task reaches the next), run by the node's user, as Flower's subprocess
isolation runs it; the task itself is Flower's `run_clientapp`, unchanged.

Both processes are in this process's group: stopping the group stops the node, its SuperExec
and its tasks; the SuperExec exits when the SuperNode does (Flower's parent-pid monitor).
"""
from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys

PRELOAD = ["flwr.supernode.runtime.run_clientapp", "flwr.supercore.tls"]


def runtime_address(args: list[str]) -> str:
    """The SuperNode's Runtime API, where its SuperExec asks for tasks: loopback at its --port
    (required here: the two processes must agree on it)."""
    for i, arg in enumerate(args):
        if arg == "--port" and i + 1 < len(args):
            return f"127.0.0.1:{args[i + 1]}"
        if arg.startswith("--port="):
            return f"127.0.0.1:{arg.split('=', 1)[1]}"
    raise SystemExit("warm_supernode: give the SuperNode's Runtime API --port (its SuperExec connects to it)")


def _clientapp(address: str, token: str, insecure: bool, certificates_path: str | None, parent_pid: int | None,
               install: bool) -> None:
    """One task, as `flwr-clientapp --runtime-api-address … --token …` runs it (flwr.supernode.cli.flwr_clientapp),
    its log line included."""
    from logging import INFO

    from flwr.supercore import log
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    log(INFO, "Start `flwr-clientapp` process")

    run_clientapp(runtime_api_address=address, token=token, insecure=insecure,
                  certificates=validate_and_resolve_root_certificates(certificates_path, insecure),
                  parent_pid=parent_pid, runtime_dependency_install=install)


class ForkExecutor:
    """Flower's SubprocessExecutor for every task type but the ClientApp, which is forked warm."""

    def __init__(self):
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self.cold = SubprocessExecutor()
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def get_eligible_capacity(self, supported_task_types, **kwargs):
        return self.cold.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type=None, **kwargs) -> None:
        self.cold.wait_for_capacity(task_type, **kwargs)

    def launch(self, spec):
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self.cold.launch(spec)
        self.context.Process(target=_clientapp, daemon=False,
                             args=(spec.runtime_api_address, spec.token, spec.insecure, spec.root_certificates_path,
                                   spec.parent_pid, spec.runtime_dependency_install)).start()
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        multiprocessing.active_children()  # reaps the tasks that ended

    def close(self) -> None:
        self.cold.close()


def main(args: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if args is None else args)
    address = runtime_address(args)
    node = subprocess.Popen(["flower-supernode", *args, "--isolation", "process"])

    def stop(signum, _frame):
        node.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    from flwr.supercore.superexec import run_superexec as flower

    # The one change to Flower's SuperExec: its executor (Flower picks it by name from two kinds).
    flower.get_executor = lambda *_args, **_kwargs: ForkExecutor()
    try:
        flower.run_superexec(runtime_api_address=address, insecure=True, parent_pid=node.pid)
    finally:
        if node.poll() is None:
            node.terminate()


if __name__ == "__main__":
    main()
