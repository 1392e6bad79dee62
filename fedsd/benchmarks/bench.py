"""`fedsd bench`: side-by-side timings in one run (seconds are noisy; ratios are the claim).

    fedsd bench federated   steady-state seconds per federated round vs seconds per central
                            epoch of the same DP training on the same data
    fedsd bench step        one DP-SGD step in every clipping mode vs the eager NCHW non-private
                            step a user would write and the fastest non-private step
    fedsd bench epoch       a central DP epoch with evaluation: the default path vs hooks on NCHW
    fedsd bench deploy      a simulated round, a deployed round (SuperLink, SuperNodes, TLS, own
                            data) and Flower's floor (a round that only sends a model back)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from fedsd.clipping import routes
from fedsd.data import datasets as data_lib
from fedsd.training.central import plan_run, prepare_run, train
from fedsd.data.client_data import input_stats
from fedsd.settings.run import GRAD_SAMPLE_MODES, TrainConfig
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig
from fedsd.methods import METHODS, released
from fedsd.privacy.accounting import plan
from fedsd.settings.declared import add_options, from_args
from fedsd.training.loop import evaluate, initial_model, planned_trainer
from fedsd.benchmarks.deploy_timing import bench_deploy
from fedsd.benchmarks.step_timing import BASELINE, bench_step, emit, every_epoch_distils, route_taken
from fedsd.benchmarks.distill_share import measure, summary
from fedsd.benchmarks.soak import plan_churn, plan_faults, soak
from fedsd.deployment.local_deployment import stop_on_sigterm
from fedsd import dry_run
from fedsd.simulation.engine import simulate


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side)")
    what = p.add_subparsers(dest="what", required=True)
    for add in (_add_federated, _add_step, _add_epoch, _add_deploy, _add_distill_share, _add_routes, _add_soak):
        add(what)


def _add_federated(what) -> None:
    fed = what.add_parser("federated", help="federated round vs central epoch, same data and DP training")
    fed.add_argument("--dataset", default="fmnist")
    fed.add_argument("--method", default="dp3sd")
    # The federation's settings as `fedsd simulate` declares them (one default each).
    add_options(fed, FedConfig, only=("num_clients", "fraction_train", "partition", "dirichlet_alpha", "client_cpus"))
    fed.add_argument("--rounds", type=int, default=4, help="the first round (warm-up) is not counted")
    fed.add_argument("--batch-size", type=int, default=256, help="per client")
    fed.add_argument("--subset", type=int, default=None)
    fed.add_argument("--epsilon", type=float, default=3.0)
    fed.add_argument("--ray-workers", type=int, default=2, help="Ray CPUs")
    fed.add_argument("--ray-address", default=None, help="a running Ray cluster (as fedsd simulate)")
    fed.add_argument("--json", action="store_true")
    fed.set_defaults(func=bench_federated)


def _add_step(what) -> None:
    step = what.add_parser("step", help="every DP mode vs the eager NCHW and the fastest non-private step")
    step.add_argument("--model", choices=["mnist-cnn", "cifar-cnn"], default="mnist-cnn")
    step.add_argument("--batch-size", type=int, default=None, help="default: the paper's (1600 / 1000)")
    step.add_argument("--method", default="dp3sd", help="dp3sd also times the teacher's forward pass")
    step.add_argument("--grad-sample-mode", nargs="+", default=list(GRAD_SAMPLE_MODES))
    step.add_argument("--no-compile", action="store_true",
                      help="leave torch.compile out: of the non-private candidates (it takes ~20 s to compile) and of "
                           "the DP steps (fedsd.training.compiled)")
    step.add_argument("--train-layers", nargs="+", default=["all"], metavar="SPEC",
                      help="what each DP step trains (all, head, last:N: the rest frozen, as fedsd train "
                           "--train-layers); several are timed side by side, each against all (default: all)")
    step.add_argument("--backbone-features", action="store_true",
                      help="also time each frozen --train-layers on the frozen blocks' cached output (--features "
                           "backbone): the trained blocks' step alone")
    step.add_argument("--layers", action="store_true",
                      help="the default route's DP step (auto: book-keeping) layer by layer: each trainable "
                           "layer's forward, backward, per-sample norms and clipped sum, beside the eager "
                           "channels-last non-private step's forward and backward (both eager: nothing compiled)")
    step.add_argument("--device", default="cpu")
    step.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    step.add_argument("--repeats", type=int, default=15)
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--json", action="store_true")
    step.set_defaults(func=bench_step)


def _add_epoch(what) -> None:
    epoch = what.add_parser("epoch", help="a central DP epoch with evaluation: the default path vs hooks on NCHW")
    epoch.add_argument("--dataset", default="fmnist")
    epoch.add_argument("--method", default="dp3sd")
    epoch.add_argument("--epochs", type=int, default=2, help="timed epochs of each path, interleaved")
    epoch.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    epoch.add_argument("--json", action="store_true")
    epoch.set_defaults(func=bench_epoch)


def _add_deploy(what) -> None:
    dep = what.add_parser("deploy", help="simulated round vs deployed round vs Flower's floor, same data and settings")
    add_options(dep, TrainConfig)  # every training setting, as fedsd simulate has them
    add_options(dep, FedConfig, required=("num_clients", "rounds"),
                only=("num_clients", "rounds", "local_epochs", "partition", "dirichlet_alpha", "classes_per_client"))
    dep.add_argument("--work", default=None, help="folder for the clients' data, Flower's state and the runs "
                                                  "(default: a temporary folder, removed afterwards)")
    dep.add_argument("--timeout", type=float, default=3600, help="seconds each deployed run may take")
    dep.add_argument("--json", action="store_true")
    dep.set_defaults(func=bench_deploy)


def _add_distill_share(what) -> None:
    share = what.add_parser("distill-share", help="a self-distilling method's clipped gradient: the distillation "
                                                   "term's share against the cross-entropy's, epoch by epoch")
    add_options(share, TrainConfig, required=("epsilon",))  # a reading is its settings (--teacher-every step …)
    share.add_argument("--probe-samples", type=int, default=256, help="training samples the shares are measured on")
    share.add_argument("--json", action="store_true")
    share.set_defaults(func=bench_distill_share)


def _add_routes(what) -> None:
    rts = what.add_parser("routes", help="the routes runs took on this machine (--grad-sample-mode auto: by rule), "
                                         "or --measure: every candidate timed against the rule's choice")
    rts.add_argument("--clear", action="store_true",
                     help="forget the list (no run reads it: a route is chosen by rule)")
    rts.add_argument("--measure", action="store_true",
                     help="time every clipper and every way of each conv layer on --model at --batch-size, and say "
                          "where the rule's choice (fedsd.clipping.routes.RULES) is not the fastest: how the rule "
                          "is calibrated")
    rts.add_argument("--model", choices=["mnist-cnn", "cifar-cnn"], default="mnist-cnn")
    rts.add_argument("--batch-size", type=int, default=None, help="default: the papers' for the model's data set")
    rts.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    rts.set_defaults(func=bench_routes)


def _add_soak(what) -> None:
    soak = what.add_parser("soak", help="a real deployment under seeded faults (SIGKILLs, restarts), then the "
                                        "independent privacy check and the accuracy against the run without faults")
    soak.add_argument("--clients", type=int, default=4)
    soak.add_argument("--rounds", type=int, default=30)
    soak.add_argument("--faults", type=int, default=20, help="at most one a round, none in the first or the last")
    soak.add_argument("--churn", type=int, default=0,
                      help="SuperNodes taken away for 1-3 whole rounds and brought back with their state, one at a "
                           "time (at most (rounds - 1) // 2)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--work", required=True, help="keeps every node's state, the server's result and the logs")
    soak.set_defaults(func=bench_soak)


def bench_federated(args: argparse.Namespace) -> int:
    """A federation's steady-state round against a central epoch over as many samples as the
    round's cohort holds, with the same DP training (B, ε, method), timed in one run; and the
    peak resident memory of each Ray worker, sampled from /proc while the federation runs."""
    cfg = TrainConfig(dataset=args.dataset, method=args.method, epsilon=args.epsilon, batch_size=args.batch_size,
                      subset=args.subset, **every_epoch_distils(args.method))
    fed = from_args(FedConfig, args, rounds=args.rounds)
    with WorkerMemory() as memory:
        fed_result, _ = simulate(cfg, fed, progress=False, ray_cpus=args.ray_workers, ray_address=args.ray_address)
    shards = fed_result["shard_sizes"]
    # The same samples: a central epoch over as many samples as a round's cohort trained on.
    cohorts = [sum(shards[int(k)] for k in r["trained"]) for r in fed_result["rounds"][1:]]
    cohort_samples = round(statistics.mean(cohorts))
    central, _ = train(TrainConfig(**{**cfg.__dict__, "epochs": args.rounds, "subset": cohort_samples}), progress=False)
    # Steady state: leave out the first round / epoch (process start, caches being filled).
    round_seconds = [r["train_seconds"] for r in fed_result["rounds"][1:]]
    epoch_seconds = [e["seconds"] for e in central["epochs"][1:]]
    report = dict(dataset=args.dataset, method=args.method, clients=fed.num_clients, partition=fed.partition,
                  client_cpus=fed.client_cpus, fraction_train=fed.fraction_train, cohort_samples=cohort_samples,
                  ray_workers=args.ray_workers, batch_size=args.batch_size,
                  central_epoch_seconds=statistics.median(epoch_seconds),
                  federated_round_seconds=statistics.median(round_seconds),
                  round_seconds_all=[r["train_seconds"] for r in fed_result["rounds"]],
                  epoch_seconds_all=[e["seconds"] for e in central["epochs"]],
                  worker_peak_rss_mb=memory.peak_mb(), test_accuracy=fed_result["test_accuracy"],
                  client_epsilon_max=max(fed_result["rounds"][-1]["client_epsilon"].values(), default=0.0))
    report["ratio"] = report["federated_round_seconds"] / report["central_epoch_seconds"]
    return emit(args, report, f"central epoch on {cohort_samples} samples: {report['central_epoch_seconds']:.2f} s   "
                               f"federated round ({fed.num_clients} clients, cohort {fed.fraction_train:g}, "
                               f"{args.ray_workers} Ray workers): {report['federated_round_seconds']:.2f} s   "
                               f"ratio {report['ratio']:.3f}   worker peak RSS {report['worker_peak_rss_mb']} MB")


class WorkerMemory:
    """Peak resident memory (VmHWM) of each Ray worker serving clients on this machine, read
    from /proc every half second while the block runs (Linux)."""
    def __init__(self):

        self.peaks: dict[int, int] = {}  # pid → kB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:

        while not self._stop.wait(0.5):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    if not (proc / "cmdline").read_bytes().startswith(b"ray::ClientAppActor"):
                        continue
                    status = (proc / "status").read_text()
                except OSError:  # gone meanwhile
                    continue
                kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
                self.peaks[int(proc.name)] = max(self.peaks.get(int(proc.name), 0), kb)

    def peak_mb(self) -> list[int]:
        return sorted(round(kb / 1024) for kb in self.peaks.values())


def bench_routes(args: argparse.Namespace) -> int:
    """List the routes this machine keeps (what each was measured for, and the choice), or forget them."""
    if args.clear:
        print(f"bench routes: forgot {routes.forget_all()} route(s) (a run's route is chosen by rule, not read here)")
        return 0
    if args.measure:
        import torch

        from fedsd.settings.run import TrainConfig

        if args.threads:
            torch.set_num_threads(args.threads)
        dataset, shape = ("fmnist", (1, 28, 28)) if args.model == "mnist-cnn" else ("cifar10", (3, 32, 32))
        cfg = TrainConfig(dataset=dataset, method="dpsgd", epsilon=3.0, batch_size=args.batch_size,
                          threads=args.threads).resolved()
        dry_run.stop_here(f"time every route of {args.model} at B = {cfg.batch_size}")
        measured = routes.measure(cfg, 10, shape, torch.device("cpu"))
        chosen = routes.rule(cfg, 10, shape, torch.device("cpu"))
        print(f"{args.model} B={cfg.batch_size} {torch.get_num_threads()} thread(s), measured: {measured.describe()}")
        print(f"the rule takes {chosen.describe()}" + ("" if chosen.spec() == measured.spec() else
                                                        f"; the fastest measured was {measured.spec()}"))
        return 0
    kept = routes.cached()
    for key, route in kept:
        print(f"{key['model']} B={key['batch_size']} {key['device']} {key['threads']} thread(s): {route.describe()}")
    print(f"bench routes: {len(kept)} route(s) kept in {routes.cache_root() / 'routes'}")
    return 0


def bench_epoch(args: argparse.Namespace) -> int:
    """A central DP epoch with its test-set evaluation, the default path against the baseline
    (hooks on NCHW), the same data, settings and privacy plan, epochs interleaved."""


    if args.threads:
        torch.set_num_threads(args.threads)
    paths = {"default": TrainConfig(dataset=args.dataset, method=args.method),
             "baseline": TrainConfig(dataset=args.dataset, method=args.method, **BASELINE)}
    runs = {}
    for name, cfg in paths.items():
        inputs = prepare_run(cfg)
        cfg = inputs.cfg
        n = len(inputs.train_indices)
        trainer = planned_trainer(cfg, data_lib.prepare(inputs.data, inputs.train_indices, inputs.device,
                                                        input_stats(cfg)),
                                  plan(cfg.epsilon, cfg.delta, n, cfg.batch_size, cfg.epochs, cfg.accountant))
        runs[name] = [cfg, trainer, initial_model(cfg, trainer.data.num_classes), None]
    dry_run.stop_here(f"time {args.epochs} epochs of each of {', '.join(runs)}, interleaved")
    seconds = {name: [] for name in runs}
    for epoch in range(1, args.epochs + 1):
        for name, r in runs.items():
            cfg, trainer, model, state = r
            started = time.perf_counter()
            model, state, _ = trainer.local_update(model, state, [epoch])
            trainer.model.load_state_dict(released(model))
            evaluate(trainer.model, trainer.data.x_test, trainer.data.y_test)
            seconds[name].append(time.perf_counter() - started)
            r[2], r[3] = model, state
    cfg = runs["default"][0]
    report = dict(dataset=args.dataset, method=args.method, batch_size=cfg.batch_size, threads=torch.get_num_threads(),
                  steps_per_epoch=runs["default"][1].steps_per_epoch,
                  grad_sample_mode=cfg.grad_sample_mode, memory_format=cfg.memory_format,
                  cpu_isa=torch.backends.cpu.get_cpu_capability().lower(), **route_taken(runs["default"][1]),
                  baseline=BASELINE, seconds_per_epoch=statistics.median(seconds["default"]),
                  baseline_seconds_per_epoch=statistics.median(seconds["baseline"]),
                  seconds_all=seconds["default"], baseline_seconds_all=seconds["baseline"])
    report["speedup"] = report["baseline_seconds_per_epoch"] / report["seconds_per_epoch"]
    return emit(args, report, f"{args.dataset} {args.method} central DP epoch + evaluation, {report['threads']} "
                               f"threads: default ({cfg.grad_sample_mode} → {report['route']}, {cfg.memory_format}) "
                               f"{report['seconds_per_epoch']:.2f} s, baseline (hooks, NCHW) "
                               f"{report['baseline_seconds_per_epoch']:.2f} s, speed-up {report['speedup']:.2f}x")


def bench_distill_share(args: argparse.Namespace) -> int:
    """Train a self-distilling method as `fedsd train` would (the validation split held out; no
    folder written) and say, each epoch after the warm-up, ‖S_kd‖ / ‖S_ce‖: the distillation
    term's share of the batch's clipped gradient against the cross-entropy term's
    (fedsd/benchmarks/distill_share.py)."""
    cfg = from_args(TrainConfig, args)
    if not METHODS[cfg.method].self_distilling and cfg.method != "dpkd":
        raise ConfigError(f"--method: {cfg.method} has no distillation term; use dp3sd, dpdsd or dpkd")
    if args.probe_samples < 1:
        raise ConfigError(f"--probe-samples: must be >= 1, got {args.probe_samples}")
    inputs, _ = plan_run(cfg)
    dry_run.stop_here(f"train {inputs.cfg.method} for {inputs.cfg.epochs} epochs and measure the distillation "
                      f"term's clipped-gradient share on {args.probe_samples} samples after each")
    echo = (lambda epoch, r: print(f"epoch {epoch}: " + (f"‖S_kd‖/‖S_ce‖ {r['clipped_share']:.3f}, cos "
                                                        f"{r['cosine']:+.2f}, median ‖g_kd‖/‖g_ce‖ "
                                                        f"{r['median_sample_ratio']:.3f}, clipped {r['clipped']:.0%}"
                                                        if r else "warm-up (cross-entropy only)"),
                                   file=sys.stderr, flush=True))
    records = measure(cfg, args.probe_samples, progress=None if args.json else echo)
    report = dict(config={k: v for k, v in inputs.cfg.to_dict().items() if k != "extra"}, epochs=records,
                  summary=summary(records))
    mean = report["summary"].get("mean", {})
    return emit(args, report, f"{inputs.cfg.method}: over {len(records)} distilling epochs, ‖S_kd‖/‖S_ce‖ "
                               f"{mean.get('clipped_share', float('nan')):.3f} on average, cosine "
                               f"{mean.get('cosine', float('nan')):+.2f}")


def bench_soak(args) -> int:
    """`fedsd bench soak`: prints the report as JSON; exit code 0 when the checks pass."""
    for name in ("clients", "rounds"):
        if getattr(args, name) < 2:
            raise ConfigError(f"--{name}: at least 2, got {getattr(args, name)}")
    # --faults and --churn refused before any process starts
    plan_faults(args.clients, args.rounds, args.faults, args.seed)
    plan_churn(args.clients, args.rounds, args.churn, args.seed)
    stop_on_sigterm()  # `kill -TERM` stops each deployment it started, as Ctrl-C does (else they run on)
    report = soak(args.clients, args.rounds, args.faults, args.seed, Path(args.work),
                  echo=lambda line: print(line, file=sys.stderr), churn=args.churn)
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
