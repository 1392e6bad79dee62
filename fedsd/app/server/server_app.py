"""The ServerApp: runs the strategy, evaluates the global model on the test set every round,
checkpoints every completed round (checkpoint.pt, for --resume), and writes the same files as
`fedsd train` (result.json with a `rounds` list, model.pt, curve.png)."""
from __future__ import annotations

# An entry point: fedsd's process-wide speed settings, before torch loads (fedsd/runtime.py).
from fedsd.runtime import tune_process

tune_process()

import dataclasses
import shutil
import time
from dataclasses import dataclass
from types import SimpleNamespace
from datetime import datetime
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedsd.data import datasets as data_lib
from fedsd.training import tensorboard
from fedsd.runtime import resolve_device
from fedsd.data.client_data import input_stats, normalised, task_for
from fedsd.settings.run import CUSTOM, TrainConfig
from fedsd.errors import ConfigError
from fedsd.data.features import inputs
from fedsd.training.summary import run_summary
from fedsd.settings.federation import FedConfig, client_config, from_flat, to_flat
from fedsd.models.networks import feature_source, model_for, with_pinned_weights
from fedsd.files.results import RunResult, fresh_out_dir, write_run
from fedsd.settings.declared import flags_to_keys
from fedsd.training.loop import frozen_part, initial_model, torch_memory_format
from fedsd.methods import released
from fedsd.app.simulated_shards import build_federation
from fedsd.app.records import model_to_record, record_to_model

from fedsd.app.server import checkpoint
from fedsd.app.server.rounds import RoundBook
from fedsd.app.server.grid import PollingGrid, shorten_object_backoff
from fedsd.app.server.secure_rounds import SecureRounds
from fedsd.app.server.strategy import ClientsFailed, RecordingStrategy, base_strategy


def run_server(grid: Grid, cfg: TrainConfig, fed: FedConfig, out: str | Path | None = None,
               overwrite: bool = False, progress: bool = False, log_dir: str | None = None) -> tuple[dict, dict]:
    """Run the federation (or, with fed.resume_dir, go on with the one checkpointed there).
    Returns (result, the released global weights), as `fedsd.training.central.train`. `log_dir`: the
    TensorBoard log's folder as --log-dir takes it (fedsd.training.tensorboard.log_dir)."""
    started = time.perf_counter()
    launch = checkpoint.start(cfg, fed, out, overwrite)  # the settings, fresh or resumed: read only from here on
    board = tensorboard.log_dir(log_dir, launch.out)  # refused before any work when TensorBoard is missing
    if launch.resumed:
        log(INFO, "fedsd: resuming %s after round %d of %d", launch.out, launch.round, launch.fed.rounds)
    side = ServerSide.prepare(launch, grid, overwrite, progress)
    with tensorboard.opened(board) as side.book.log:
        initial = launch.model if launch.resumed else initial_model(side.cfg, side.num_classes)
        # Frozen blocks never change: kept as the initial model holds them after every aggregation,
        # so that a node with its own copy of the weights (node-config init-weights) finds them bit for bit.
        side.strategy.frozen = frozen_part(side.cfg, side.num_classes)
        # Every message carries the run's settings (the strategy adds them); this is what Flower logs at the start.
        train_config = ConfigRecord({"experiment-id": launch.experiment_id})
        secure = None  # the secure rounds, whose plan and clients' names the result keeps
        shorten_object_backoff()  # Flower's first wait of 1 s for a reply's objects: 0.05 s (grid.py)
        try:
            if launch.fed.secure_aggregation:  # identify and the five stages of SecAgg+ each round, in place of
                # the strategy's
                secure = SecureRounds(PollingGrid(grid), side, launch)
                outcome = SimpleNamespace(arrays=secure.run(model_to_record(initial)))
            else:
                outcome = side.strategy.start(grid=PollingGrid(grid), initial_arrays=model_to_record(initial),
                                              num_rounds=launch.fed.rounds - launch.round,
                                              timeout=launch.fed.round_timeout, train_config=train_config,
                                              evaluate_config=ConfigRecord(dict(train_config)),
                                              evaluate_fn=side.book.evaluate_global)
        except ClientsFailed:
            # Stopped before any round completed (no client could train): nothing to keep or resume.
            if launch.out is not None and not launch.resumed and not (launch.out / checkpoint.CHECKPOINT).exists():
                shutil.rmtree(launch.out, ignore_errors=True)
            raise
        finally:
            side.book.close()
        final = record_to_model(outcome.arrays) if len(outcome.arrays) else initial
        result = federation_result(launch, side, time.perf_counter() - started, secure)
        weights = {k: v.cpu() for k, v in released(final).items()}
        if launch.out is not None:
            write_run(launch.out, result, weights)  # result.json last: from here on the run is finished
            (launch.out / checkpoint.CHECKPOINT).unlink(missing_ok=True)
        if side.book.log is not None:
            side.book.log.finish(to_flat(side.cfg, launch.fed), {"test_accuracy": result.test_accuracy,
                                                                "epsilon": result.epsilon_spent})
    return result.to_dict(), weights


@dataclass
class ServerSide:
    """What the server runs a federation with: the resolved settings, the public test split
    (None for a custom task) and where it came from, the strategy and the round book."""
    cfg: TrainConfig
    num_classes: int
    device: torch.device
    test: tuple | None
    source: str
    strategy: RecordingStrategy
    book: RoundBook

    @classmethod
    def prepare(cls, launch, grid: Grid, overwrite: bool, progress: bool) -> "ServerSide":
        """Every check before anything is written (the settings resolved, the papers' values filled
        in), then the result folder, the evaluation model, the strategy and the round book (a
        resumed run's restored from its checkpoint)."""
        fed, out = launch.fed, launch.out
        launch.cfg, num_classes, test, source, validation = public_side(launch.cfg, fed)
        cfg = launch.cfg
        if not launch.resumed:  # a resumed run's SuperNodes reconnect at their own pace: it waits for them
            check_federation_size(grid, fed.num_clients)
            if out is not None:
                fresh_out_dir(out, overwrite)  # holds checkpoint.pt per round, then result.json
        device = resolve_device(cfg.device)
        net = model_for(cfg, num_classes)
        layout = torch_memory_format(cfg, device, net)  # as the clients train

        def on_device(split):
            return None if split is None else (split[0].to(device).contiguous(memory_format=layout),
                                               split[1].to(device))

        test, validation = on_device(test), on_device(validation)
        net = net.to(device, memory_format=layout)
        shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        # A custom task has no public test split at the server: its clients evaluate on their own.
        strategy = RecordingStrategy(base_strategy(fed, fed.federated_evaluation or test is None), fed, shapes,
                                     round_offset=launch.round, settings=to_flat(cfg, fed))
        book = RoundBook(strategy, net, test, validation=validation, rounds_total=fed.rounds, start_round=launch.round,
                         out=out, settings=launch.settings, experiment_id=launch.experiment_id, progress=progress,
                         description=f"{cfg.dataset} {cfg.method} {fed.num_clients} clients")
        if launch.resumed:
            strategy.load_state_dict(launch.strategy)
            book.load_state_dict(launch.book)
        return cls(cfg, num_classes, device, test, source, strategy, book)


def federation_result(launch, side: ServerSide, wall_seconds: float, secure=None) -> RunResult:
    """A federation's result.json: what the clients reported (shard size, σ, q, ε, steps), not
    what the server computed, and the rounds as the book recorded them; under secure aggregation
    (`secure`, its SecureRounds) also the noise plan and the clients' names
    (SecureRounds.result_facts)."""
    fed, strategy, rounds = launch.fed, side.strategy, side.book.rounds
    reported = client_facts(strategy.round_clients)
    return RunResult.of_run(
        side.cfg, epsilon_spent=max(strategy.client_epsilon.values(), default=0.0),
        test_accuracy=side.book.final_accuracy(), wall_seconds=wall_seconds, device=side.device,
        data_source=side.source,
        noise_multiplier={str(k): r.get("noise-multiplier") for k, r in reported.items()},
        sample_rate={str(k): r.get("sample-rate") for k, r in reported.items()},
        steps=sum(r.get("steps", 0) for reps in strategy.round_clients.values() for r in reps.values()),
        validation_accuracy=side.book.final_validation_accuracy(),
        evaluated_by="server" if side.test is not None else "clients", num_clients=fed.num_clients,
        shard_sizes=[reported.get(k, {}).get("num-examples") for k in range(fed.num_clients)],
        federation=fed.__dict__.copy(), experiment_id=launch.experiment_id, resumed_after_round=launch.round or None,
        missed={str(r["round"]): r["missed"] for r in rounds if r["missed"]}, rounds=rounds,
        extra=secure.result_facts() if secure is not None else {})


def public_side(cfg: TrainConfig, fed: FedConfig):
    """What the server holds: the resolved settings, the number of classes, the public test
    split (normalised; None for a custom task), where it came from, and in a simulation with
    --validation the held-out split (normalised; else None), on which it also evaluates every
    round to choose settings without the test split. With client-data=own it loads no training
    data at all: each client's data stays on its machine. --init-weights is pinned first (its
    path absolute, its sha256 filled in): the run config the clients get names the file's sha256,
    and the initial model carries its weights."""
    cfg = with_pinned_weights(cfg)
    if fed.client_data == "own":
        fed.validate()
        cfg = client_config(cfg, fed)
        task = task_for(cfg)
        if cfg.dataset == CUSTOM:
            return cfg, len(task.classes), None, "each client's own data", None
        images = data_lib.load(cfg.dataset, cfg.data_dir, cfg.download)  # the public test split only
        # Normalised with the task's constants, as the clients normalise theirs (mean/std settings included).
        test = inputs(normalised(images.x_test, task), feature_source(cfg), "test images")
        return cfg, len(task.classes), (test, images.y_test.clone()), images.source, None
    federation = build_federation(cfg, fed)
    log(INFO, "fedsd: %d clients, %s partition, shard sizes %s", fed.num_clients, fed.partition,
        federation.shard_sizes())
    images, cfg = federation.images, federation.cfg
    stats = input_stats(cfg)  # --mean / --std, as the clients normalise their shards
    validation = data_lib.validation_split(images, cfg.validation, stats, feature_source(cfg)) if cfg.validation \
        else None
    test = inputs(images.normalised_test(stats), feature_source(cfg), "test images")
    return cfg, images.num_classes, (test, images.y_test.clone()), images.source, validation


# A fresh run waits for its SuperNodes until their number has not changed for this long.
FEDERATION_SETTLE_SECONDS = 10.0


def connected_nodes(grid: Grid, settle: float = FEDERATION_SETTLE_SECONDS, until: int | None = None) -> int:
    """The number of SuperNodes connected, once it has not changed for `settle` seconds (or,
    sooner, once it reaches `until`); 0 when none has come."""
    count, changed = -1, time.monotonic()
    while True:
        connected = len(grid.get_node_ids())
        if connected != count:
            count, changed = connected, time.monotonic()
        if (until is not None and count >= until) or time.monotonic() - changed > settle:
            return count
        time.sleep(0.5)


def check_federation_size(grid: Grid, num_clients: int, settle: float = FEDERATION_SETTLE_SECONDS) -> None:
    """Wait for num-clients SuperNodes. Stop with a ConfigError naming both numbers, and how to
    fix either, when the federation has more, or has settled with fewer (without this, a run
    would wait for the missing ones forever)."""
    count = connected_nodes(grid, settle, until=num_clients)
    if count != num_clients:
        raise ConfigError(
            f"the federation has {count} SuperNode(s) connected but the run has num-clients={num_clients}: "
            f"run with --run-config \"num-clients={count}\" (or num-clients=0: one client per SuperNode), or give "
            f"the federation {num_clients} SuperNodes (local simulation: --federation-config "
            f"\"num-supernodes={num_clients}\"; a deployment: "
            + (f"start {num_clients - count} more SuperNode(s))" if count < num_clients
               else f"stop {count - num_clients} SuperNode(s))"))


def one_client_per_node(grid: Grid, fed: FedConfig) -> FedConfig:
    """num-clients=0 (the Flower app's default): as many clients as the federation has SuperNodes,
    counted once their number settles, so that a plain `flwr run .` fits whatever federation it
    is sent to (Flower's local simulation has 2 SuperNodes unless told otherwise)."""
    if fed.num_clients or fed.resume_dir:
        return fed
    count = connected_nodes(grid)
    if count == 0:
        raise ConfigError(f"num-clients=0 takes one client per SuperNode, and no SuperNode connected within "
                          f"{FEDERATION_SETTLE_SECONDS:g} s; start the federation's SuperNodes, or set num-clients")
    log(INFO, "fedsd: %d clients, one per SuperNode of the federation (num-clients=0)", count)
    return dataclasses.replace(fed, num_clients=count)


def client_facts(round_clients: dict) -> dict[int, dict]:
    """Each client's last reported metrics (shard size, σ, q, ε), over every round."""
    facts: dict[int, dict] = {}
    for server_round in sorted(round_clients):
        for pid, metrics in round_clients[server_round].items():
            facts.setdefault(int(pid), {}).update(metrics)
    return dict(sorted(facts.items()))


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point for `flwr run .`: every setting comes from the run config. A bad setting
    stops the run with an error that names it as the run config's key (what the user typed).
    The run ends with fedsd's summary in the run's log (`flwr log RUN_ID`), the result
    folder's absolute path included."""
    try:
        cfg, fed = from_flat(dict(context.run_config))
        if fed.secure_sum == "plain":  # the clients' vectors in the clear: only one process's simulation
            raise ConfigError("--secure-sum plain: adds the clients' vectors in the clear, fedsd simulate's "
                              "in-process shortcut; a Flower run runs the protocol (protocol or multi-round)")
        fed = one_client_per_node(grid, fed)
        if fed.resume_dir:  # the checkpoint's settings and folder; the run config's others are not used
            out = Path(fed.resume_dir).absolute()
            result, _ = run_server(grid, cfg, fed)
        else:
            out = Path(fed.out_dir
                       or f"fedsd-runs/{cfg.dataset}-{cfg.method}-{datetime.now():%Y%m%d-%H%M%S}").absolute()
            result, _ = run_server(grid, cfg, fed, out=out)
    except ConfigError as e:
        raise ConfigError(flags_to_keys(str(e), TrainConfig, FedConfig)) from None
    for line in run_summary(result, out).splitlines():
        log(INFO, "%s", line)
