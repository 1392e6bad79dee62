"""A federation of simulated clients: fedsd's ServerApp and ClientApp on Flower's simulation
engine (Ray backend), every check made before Ray starts; `fedsd simulate` parses and calls
`simulate` (with secure aggregation or distributed noise, fedsd.simulation.secure_federation)."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from fedsd.training import tensorboard
from fedsd.settings.run import TrainConfig
from fedsd.errors import ConfigError, UserError
from fedsd.settings.federation import FedConfig
from fedsd.files.results import check_out_dir
from fedsd.runtime import quiet_ray
from fedsd import dry_run
from fedsd.app.simulated_shards import build_federation


def ray_cluster_address(address: str) -> str:
    """The bootstrap HOST:PORT of the running Ray cluster `address` names (auto or HOST:PORT),
    checked to answer; ConfigError, before any work, when it does not."""
    import socket

    from ray._private.services import canonicalize_bootstrap_address

    if "://" in address:
        raise ConfigError(f"--ray-address: {address!r} is a Ray Client address; run fedsd on a node of the "
                          f"cluster and give auto or the head's HOST:PORT (default port 6379)")
    try:
        resolved = canonicalize_bootstrap_address(address)
    except Exception as e:  # Ray's own message: a malformed address, a host that does not resolve
        raise ConfigError(f"--ray-address: {address!r}: {e}; give auto or HOST:PORT") from None
    if resolved is None:
        raise ConfigError("--ray-address auto: no running Ray cluster found (RAY_ADDRESS is unset and none was "
                          "started on this machine); start one with `ray start --head`, or give HOST:PORT")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"--ray-address {address}: no Ray cluster answers at {resolved} ({e}); start one with "
                          f"`ray start --head --port {port}`") from None
    return resolved


# Flower's notices that say nothing to a user of `fedsd simulate`: fedsd calls the engine's
# Python API itself, and evaluates at the server unless asked for federated evaluation.
NOT_NEWS = ("DEPRECATED FEATURE: The `run_simulation`", "fraction_evaluate is set to 0.0")


class _AboveTheBar:
    """A stream that writes above tqdm's progress bar, so log lines never break it."""

    def write(self, text: str) -> None:
        from tqdm.auto import tqdm

        if text.strip():
            tqdm.write(text.rstrip("\n"))

    def flush(self) -> None:
        pass


@contextmanager
def flower_log(verbose: bool):
    """Flower's console log for the run: by default warnings and errors only, printed above
    the progress bar, without NOT_NEWS; with verbose, everything Flower logs, timestamped."""
    from flwr.common.logger import console_handler

    if getattr(console_handler.stream, "closed", False):
        # Flower made its handler on the sys.stderr of its import, since replaced and closed (a
        # test's captured stream): logging would fail on it, so it gets today's stderr.
        console_handler.stream = sys.stderr
    level, stream, timestamps = console_handler.level, console_handler.stream, console_handler.timestamps
    not_news = logging.Filter()
    not_news.filter = lambda record: verbose or not record.getMessage().lstrip().startswith(NOT_NEWS)
    console_handler.addFilter(not_news)
    if verbose:
        console_handler.setLevel(logging.DEBUG)
        console_handler.timestamps = True
    else:
        console_handler.setLevel(logging.WARNING)
        console_handler.setStream(_AboveTheBar())
    try:
        yield
    finally:
        console_handler.removeFilter(not_news)
        console_handler.setLevel(level)
        console_handler.setStream(stream)
        console_handler.timestamps = timestamps


def simulate(cfg: TrainConfig, fed: FedConfig, out: str | Path | None = None, overwrite: bool = False,
             progress: bool = True, ray_cpus: int | None = None, verbose: bool = False,
             ray_address: str | None = None, log_dir: str | None = None) -> tuple[dict, dict]:
    """Run a federation of `fed.num_clients` simulated clients; returns (the result, the
    released global weights) and writes `out` when given.

    Every check (settings, data, shards, privacy budgets, the Ray cluster) runs before Ray
    starts. With fed.resume_dir, the settings and folder are those of the checkpointed run.
    Without `ray_address` the simulation starts a private Ray instance on this machine
    (`ray_cpus` CPUs, default all), even when a cluster runs here; with it, the simulation is
    a job on that running cluster, whose scheduler places each client by --client-cpus and
    --client-gpus."""
    if fed.secure_aggregation or fed.noise == "distributed":  # in this process, without Ray
        from fedsd.simulation.secure_federation import simulate_secure

        if fed.resume_dir:
            return simulate_secure(None, fed, fed.resume_dir, progress=progress, resume=True)
        return simulate_secure(cfg, fed, out, overwrite, progress)
    if fed.resume_dir:
        from fedsd.app.server.checkpoint import resumed_settings  # Flower's side

        cfg, fed = resumed_settings(fed.resume_dir)
        out = None  # the run's own folder
    elif out is not None:
        check_out_dir(out, overwrite)
    if fed.client_data == "own":
        raise ConfigError("--client-data: own needs clients that hold data of their own, on their machines; a "
                          "simulation's clients have none. Deploy (scripts/deploy-local.sh --client-data DIR)")
    if ray_address is not None:
        ray_address = ray_cluster_address(ray_address)
    tensorboard.log_dir(log_dir, out)  # refused here, before Ray, when TensorBoard is missing
    federation = build_federation(cfg, fed)
    federation.check_plans()  # raises BudgetError for a client whose plan cannot fit
    if dry_run.requested():
        c, sigmas = federation.cfg, sorted({federation.client_plan(k).noise_multiplier for k in range(fed.num_clients)})
        sigma = f"{sigmas[0]:.3f}" + (f"–{sigmas[-1]:.3f}" if sigmas[-1] != sigmas[0] else "")
        dry_run.stop_here(f"simulate {fed.num_clients} clients ({fed.partition}) for {fed.rounds} rounds "
                          f"of {cfg.method} ({c.epochs} epochs a client) at B = {c.batch_size}, lr {c.lr:g}, "
                          f"momentum {c.momentum:g}, σ={sigma}, ε={cfg.epsilon:g} each"
                          + (f" into {out}" if out else ""))
    return run_on_ray(cfg, fed, out, overwrite, progress, ray_cpus, verbose, ray_address, log_dir)


def run_on_ray(cfg: TrainConfig, fed: FedConfig, out, overwrite: bool, progress: bool, ray_cpus: int | None,
               verbose: bool, ray_address: str | None, log_dir: str | None) -> tuple[dict, dict]:
    """The checked federation on Flower's simulation engine: fedsd's ServerApp and ClientApp."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fedsd.app.client.client_app import app as client_app
    from fedsd.app.server.server_app import run_server

    holder: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid, context):
        try:
            holder["result"] = run_server(grid, cfg, fed, out=out, overwrite=overwrite, progress=progress,
                                          log_dir=log_dir)
        except UserError as e:  # a run stopped for a reason the user can act on (TrainingDiverged)
            holder["error"] = e

    quiet_ray()
    # A running cluster has its own CPUs and GPUs (Ray refuses num_cpus when attaching); a
    # private instance is "local" even where a cluster runs on this machine.
    where = {"address": ray_address} if ray_address else {"address": "local", "num_cpus": ray_cpus or os.cpu_count()}
    backend_config = {"client_resources": {"num_cpus": fed.client_cpus, "num_gpus": fed.client_gpus},
                      "init_args": {**where, "include_dashboard": False,
                                    "logging_level": logging.ERROR, "log_to_driver": verbose}}
    client_state = None if ray_address else simulated_client_state(fed.resume_dir or out)
    with warnings.catch_warnings(), flower_log(verbose), environment(FEDSD_CLIENT_STATE_DIR=client_state):
        warnings.simplefilter("ignore", DeprecationWarning)  # run_simulation: the Python API of the engine
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=fed.num_clients,
                       backend_config=backend_config, verbose_logging=verbose)
    if "error" in holder:
        raise holder["error"]
    if "result" not in holder:
        raise RuntimeError("the simulation ended without a result; see the log above")
    if client_state is not None:  # the run is finished (never resumed): its clients' ε is in result.json
        shutil.rmtree(client_state, ignore_errors=True)
    return holder["result"]


# The simulated clients' disks, inside the run's folder.
SIMULATED_CLIENT_STATE = "client-state"


def simulated_client_state(run_dir: str | Path | None) -> str | None:
    """Where the simulated clients keep their privacy state (accountants, RNG, momentum, teacher,
    last reply): the run's own folder, so that `--resume DIR` finds it wherever the folder has
    gone (another machine, a fresh clone of committed results). In ~/.cache, a resume elsewhere
    started every client's accountant again and under-reported its ε (results/README.md, "The
    federated table"). None, to leave it to the clients' default, where the user names a folder
    (FEDSD_CLIENT_STATE_DIR) or the run keeps no folder. (On a Ray cluster, --ray-address, the
    workers keep their own environment: their machines' defaults.)"""
    if run_dir is None or os.environ.get("FEDSD_CLIENT_STATE_DIR"):
        return None
    return str(Path(run_dir).absolute() / SIMULATED_CLIENT_STATE)


@contextmanager
def environment(**values: str | None):
    """These environment variables set (a None one left as it is) for the block, for the
    processes it starts (a private Ray instance's workers inherit them), then put back."""
    saved = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


