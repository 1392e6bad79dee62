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
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from fedsd.clipping import conv_kernel, routes
from fedsd.data import datasets as data_lib
from fedsd.training.central import plan_run, prepare_run, resolve_device, train
from fedsd.data.client_data import input_stats
from fedsd.settings.run import GRAD_SAMPLE_MODES, TrainConfig
from fedsd.data.datasets import TensorData
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig, to_flat
from fedsd.methods import METHODS, method_of, released
from fedsd.models.networks import build_model, input_shape_of
from fedsd.models.pretrained import check_train_layers
from fedsd.privacy.accounting import plan
from fedsd.files.results import RunResult, check_out_dir
from fedsd.settings.declared import add_options, from_args
from fedsd.training.compiled import student_forward, teacher_forward
from fedsd.training.loop import evaluate, initial_model, planned_trainer
from fedsd.benchmarks import layer_times
from fedsd.runtime import inductor_cache_by_isa
from fedsd.benchmarks.distill_share import measure, summary
from fedsd.benchmarks.soak import plan_churn, plan_faults, soak
from fedsd import dry_run
from fedsd.simulation.engine import simulate
from fedsd.simulation.client_folders import write_client_folders
from fedsd.deployment.local_deployment import FLOOR_APP, LocalDeployment
from fedsd.app.simulated_shards import build_federation


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
                      help="leave torch.compile out: of the non-private candidates (it takes ~20 s to compile) and of the "
                           "DP steps (fedsd.training.compiled)")
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
    rts.add_argument("--clear", action="store_true", help="forget the list (no run reads it: a route is chosen by rule)")
    rts.add_argument("--measure", action="store_true",
                     help="time every clipper and every way of each conv layer on --model at --batch-size, and say "
                          "where the rule's choice (fedsd.clipping.routes.RULES) is not the fastest: how the rule is calibrated")
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


def every_epoch_distils(method: str) -> dict:
    """No warm-up for a self-distilling method: every timed epoch pays for its teacher."""
    return {"distill_warmup_epochs": 0} if METHODS[method].self_distilling else {}


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
    return _emit(args, report, f"central epoch on {cohort_samples} samples: {report['central_epoch_seconds']:.2f} s   "
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
                kb = next((int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM:")), 0)
                self.peaks[int(proc.name)] = max(self.peaks.get(int(proc.name), 0), kb)

    def peak_mb(self) -> list[int]:
        return sorted(round(kb / 1024) for kb in self.peaks.values())


def _emit(args: argparse.Namespace, report, text: str) -> int:
    """A bench's result: the JSON with --json, else the human-readable text."""
    print(json.dumps(report, indent=2) if args.json else text, file=sys.stdout)
    return 0


# The reference a user would write: eager PyTorch, NCHW, hooks for DP (Opacus' default).
BASELINE = dict(grad_sample_mode="hooks", memory_format="contiguous")


def bench_step(args: argparse.Namespace) -> int:
    """Every variant is timed once per round, round after round (interleaved), so all see the
    same machine state; medians after the warm-up rounds."""
    if args.threads:
        torch.set_num_threads(args.threads)
    inductor_cache_by_isa()
    device = resolve_device(args.device)
    dataset = "fmnist" if args.model == "mnist-cnn" else "cifar10"
    shape = (1, 28, 28) if args.model == "mnist-cnn" else (3, 32, 32)
    base = TrainConfig(dataset=dataset, method=args.method, epsilon=3.0, epochs=1, batch_size=args.batch_size,
                       model=args.model, **every_epoch_distils(args.method)).resolved()
    g = torch.Generator().manual_seed(0)
    # Timing only: the values do not matter, the shapes do (no accuracy is claimed here).
    x = torch.randn(base.batch_size, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (base.batch_size,), generator=g).to(device)
    objective = method_of(base).epoch_loss(base, 1)  # every step, private or not, times the same loss
    if args.layers:
        return bench_layers(args, base, x, y, objective, device)
    steps, trainers = private_steps(base, args.grad_sample_mode, x, y, objective, step_variants(args),
                                    compiled=not args.no_compile)
    dry_run.stop_here(f"time {len(steps) + 3 - args.no_compile} steps ({', '.join(steps)} and the non-private "
                      f"ones) {args.warmup} + {args.repeats} times, interleaved")
    nonprivate, left_out = nonprivate_steps(base, objective, x, y, device, args.no_compile)
    median = interleaved_medians({**steps, **nonprivate}, device, args.warmup, args.repeats)
    rows = [{**row, "left_out": left_out} for row in step_rows(args, base.batch_size, device, median, trainers)]
    return _emit(args, rows, "\n".join(step_lines(args, base.batch_size, device, rows)))


def bench_layers(args: argparse.Namespace, base: TrainConfig, x, y, objective, device) -> int:
    """`--layers`: the default route's DP step and the eager channels-last non-private step, each
    trainable layer's parts timed (fedsd/benchmarks/layer_times.py), interleaved, medians after
    the warm-up rounds."""
    mode = TrainConfig.grad_sample_mode
    steps, trainers = private_steps(base, [mode], x, y, objective, compiled=False)  # eager, as the other step
    clipper = trainers[mode].clipper
    engine = getattr(clipper, "engine", None)
    if engine is None:
        raise ConfigError(f"--layers: times book-keeping's parts; the default route here is "
                          f"{route_taken(trainers[mode])['route']}")
    nonprivate = NonPrivateStep(base, objective, x, y, device, torch.channels_last, False)
    dry_run.stop_here(f"time the default DP step and the eager channels-last non-private step layer by layer, "
                      f"{args.warmup} + {args.repeats} times, interleaved")
    clocks = {"dp": layer_times.LayerClock(clipper.model, device),
              "nonprivate": layer_times.LayerClock(nonprivate.student, device)}
    engine.observer = clocks["dp"].watch
    measured = layer_times.interleaved({"dp": steps["dp:" + mode], "nonprivate": nonprivate}, clocks, device,
                                       args.warmup, args.repeats)
    names = {m: name for name, m in clocks["dp"].layers.items()}
    ways = {names[layer]: engine.taken[i] for i, layer in enumerate(engine.layers) if i in engine.taken}
    taken = route_taken(trainers[mode])
    report = dict(model=args.model, batch_size=base.batch_size, method=args.method, device=str(device),
                  threads=torch.get_num_threads(), cpu_isa=torch.backends.cpu.get_cpu_capability().lower(),
                  repeats=args.repeats, warmup=args.warmup, route=taken["route"], chosen=taken["chosen"],
                  memory_format=trainers[mode].route.memory_format if trainers[mode].route else base.memory_format,
                  nonprivate="eager-channels-last", **layer_times.rows(measured, clocks["dp"].layers, ways))
    return _emit(args, report, "\n".join(layer_times.lines(report)))


def step_variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(train_layers, features) of each DP step timed: every --train-layers on pixels, and with
    --backbone-features every frozen one on the frozen blocks' output too."""
    for spec in args.train_layers:
        check_train_layers(spec)
    return [(spec, "none") for spec in args.train_layers] + \
        [(spec, "backbone") for spec in args.train_layers if args.backbone_features and spec != "all"]


def variant_name(mode: str, spec: str = "all", features: str = "none") -> str:
    """A DP step's key: its mode, and what it trains where that is not the whole network on pixels."""
    return mode if (spec, features) == ("all", "none") else f"{mode} {spec}" + (" on backbone features"
                                                                                 if features == "backbone" else "")


def private_steps(base: TrainConfig, modes: list[str], x, y, objective,
                  variants=(("all", "none"),), compiled: bool = True) -> tuple[dict, dict]:
    """A DP step in each clipping mode and variant ("dp:NAME", variant_name), and each one's
    trainer. A variant on backbone features steps on random features of the frozen blocks'
    output shape (timing only: no weights file is read). `compiled`: the step of a long run,
    whose parts that compile without changing a bit are compiled from the first step on
    (fedsd.training.compiled); else eager throughout."""
    steps, trainers = {}, {}
    batch = base.batch_size
    for spec, features in variants:
        for mode in modes:
            cfg = TrainConfig(**{**base.__dict__, "grad_sample_mode": mode, "train_layers": spec, "features": features})
            inputs = x if features == "none" else torch.randn(
                batch, *input_shape_of(cfg), generator=torch.Generator().manual_seed(0)).to(x.device)
            name = variant_name(mode, spec, features)
            trainer = trainers[name] = planned_trainer(cfg, TensorData(inputs, y, inputs[:1], y[:1], 10),
                                                       plan(3.0, 1e-5, 10 * batch, batch, 1))
            if compiled:
                trainer.compile_now()
            steps["dp:" + name] = lambda t=trainer: t.train_on_batch(t.data.x_train, y, objective)
    return steps, trainers


class NonPrivateStep:
    """A plain SGD step of the same model, loss, teacher and momentum, without privacy: called,
    it steps; `backward()` leaves the gradients in the student's p.grad and the weights as they are."""

    def __init__(self, base: TrainConfig, objective, x, y, device, layout, compiled: bool | str):
        """compiled: True, the whole student and teacher (torch.compile); "parts", only what the DP
        step compiles (fedsd.training.compiled: the teacher, the student's runs between its
        weighted layers), from the first step on; False, nothing."""
        self.student = build_model(base.model).to(device, memory_format=layout)
        self.teacher = build_model(base.model).to(device, memory_format=layout).eval().requires_grad_(False)
        self.forward, self.teacher_forward = self.student, self.teacher
        if compiled == "parts":
            self.forward = student_forward(self.student, after=0)[0]
            self.teacher_forward = teacher_forward(self.teacher, after=0)
        elif compiled:
            self.forward, self.teacher_forward = torch.compile(self.student), torch.compile(self.teacher)
        self.sgd = torch.optim.SGD(self.student.parameters(), lr=base.lr, momentum=base.momentum)
        self.objective, self.xs, self.y = objective, x.contiguous(memory_format=layout), y

    def backward(self) -> None:
        self.sgd.zero_grad(set_to_none=True)
        t = None
        if self.objective.reads_teacher:
            with torch.no_grad():
                t = self.teacher_forward(self.xs)
        self.objective.per_sample(self.forward(self.xs), t, self.y).mean().backward()

    def __call__(self) -> None:
        self.backward()
        self.sgd.step()


def compiled_differs(compiled: NonPrivateStep, eager: NonPrivateStep) -> str | None:
    """Why the compiled step cannot stand for the eager one, or None: run once on the eager step's
    weights and inputs, it raised, or a gradient is not the eager one's up to float32's sums in
    another order. (Inductor reuses its cached graphs across ATEN_CPU_CAPABILITY: under avx2 on
    an AVX-512 CPU they crash or compute garbage, results/perf.md, tests/test_torch_inductor_maxpool.py.)"""
    compiled.student.load_state_dict(eager.student.state_dict())
    compiled.teacher.load_state_dict(eager.teacher.state_dict())
    try:
        eager.backward()
        compiled.backward()
    except Exception as error:  # noqa: BLE001 -- any failure of the compiled code leaves it out
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    try:
        for (name, p), q in zip(eager.student.named_parameters(), compiled.student.parameters()):
            scale = float(p.grad.abs().max())
            if q.grad is None or not torch.allclose(q.grad, p.grad, rtol=1e-3, atol=1e-4 * scale + 1e-8):
                off = float("inf") if q.grad is None else float((q.grad - p.grad).abs().max())
                return f"its gradient of {name} differs from eager's by up to {off:.2e} (largest {scale:.2e})"
        return None
    finally:
        eager.sgd.zero_grad(set_to_none=True)
        compiled.sgd.zero_grad(set_to_none=True)


def nonprivate_steps(base: TrainConfig, objective, x, y, device, no_compile: bool) -> tuple[dict, dict]:
    """The non-private candidates ("nonprivate:NAME"), and those left out with why: the compiled
    one where it does not give the eager channels-last step's gradients. compiled-parts: compiled
    where the DP step is (fedsd.training.compiled), each part checked bit for bit as there."""
    steps, left_out = {}, {}
    for layout, compiled, name in ((torch.contiguous_format, False, "eager-nchw"),
                                   (torch.channels_last, False, "eager-channels-last"),
                                   (torch.channels_last, True, "compiled-channels-last"),
                                   (torch.channels_last, "parts", "compiled-parts-channels-last")):
        if compiled and no_compile:
            continue
        step = NonPrivateStep(base, objective, x, y, device, layout, compiled)
        reason = compiled_differs(step, steps["nonprivate:eager-channels-last"]) if compiled is True else None
        if reason is not None:
            left_out[name] = reason
            print(f"bench step: {name} left out: {reason}", file=sys.stderr, flush=True)
            continue
        steps["nonprivate:" + name] = step
    return steps, left_out


def interleaved_medians(steps: dict, device, warmup: int, repeats: int) -> dict[str, float]:
    """Each step's median seconds: every step once per round, `warmup` rounds left out."""
    timed = routes.timer(device)
    times = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, fn in steps.items():
            seconds = timed(fn)
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def step_rows(args: argparse.Namespace, batch: int, device, median: dict, trainers: dict) -> list[dict]:
    """One row a DP mode: its step against the eager NCHW and the fastest non-private step."""
    eager = median["nonprivate:eager-nchw"]
    fastest_name = min((n for n in median if n.startswith("nonprivate:")), key=median.get)
    fastest = median[fastest_name]
    variants = step_variants(args)
    return [dict(model=args.model, batch_size=batch, method=args.method, grad_sample_mode=mode,
                 default=mode == TrainConfig.grad_sample_mode, device=str(device), threads=torch.get_num_threads(),
                 cpu_isa=torch.backends.cpu.get_cpu_capability().lower(), kernel_isa=conv_kernel.isa(),
                 train_layers=spec, features=features, **route_taken(trainers[variant_name(mode, spec, features)]),
                 compiled=trainers[variant_name(mode, spec, features)].compiled_parts(),
                 dp_step_seconds=median["dp:" + variant_name(mode, spec, features)],
                 eager_nonprivate_step_seconds=eager,
                 fastest_nonprivate_step_seconds=fastest, fastest_nonprivate=fastest_name.split(":", 1)[1],
                 nonprivate_step_seconds={n.split(":", 1)[1]: v for n, v in median.items()
                                          if n.startswith("nonprivate:")},
                 ratio_to_eager=median["dp:" + variant_name(mode, spec, features)] / eager,
                 ratio_to_fastest=median["dp:" + variant_name(mode, spec, features)] / fastest,
                 **({"ratio_to_all": median["dp:" + variant_name(mode, spec, features)] / median["dp:" + mode]}
                    if "dp:" + mode in median and (spec, features) != ("all", "none") else {}))
            for spec, features in variants for mode in args.grad_sample_mode]


def step_lines(args: argparse.Namespace, batch: int, device, rows: list[dict]) -> list[str]:
    lines = [f"{args.model} B={batch} {args.method} on {device}, {torch.get_num_threads()} threads: non-private "
             + ", ".join(f"{n} {v * 1000:.1f} ms" for n, v in rows[0]["nonprivate_step_seconds"].items())]
    lines[0] += f"; CPU {rows[0]['cpu_isa']}, conv kernel {rows[0]['kernel_isa'] or 'not built'}"
    for r in rows:
        mark = " (default)" if r["default"] else ""
        trains = "" if (r["train_layers"], r["features"]) == ("all", "none") else \
            f" trains {variant_name('', r['train_layers'], r['features']).strip()}:"
        lines.append(f"  dp {r['grad_sample_mode']:>9}{mark:10}{trains} {r['dp_step_seconds'] * 1000:7.1f} ms   "
                     f"ratio to eager NCHW {r['ratio_to_eager']:.2f}   to fastest {r['ratio_to_fastest']:.2f}   "
                     + (f"to all layers {r['ratio_to_all']:.3f}   " if "ratio_to_all" in r else "")
                     + f"layers: {' '.join(r['layer_routes'].values())}")
        if r["chosen"]:
            lines.append(f"      auto chose {r['chosen']}")
        if r["default"]:
            lines.append("      " + "; ".join(f"{part}: {state}" for part, state in r["compiled"].items()))
    lines += [f"  {name} left out: {reason}" for name, reason in rows[0]["left_out"].items()]
    return lines


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


def route_taken(trainer) -> dict:
    """What a trainer's steps ran: the mode (auto's choice), each conv layer's way (bk) and,
    for auto, why (its measured times, in one line)."""
    mode = trainer.route.mode if trainer.route is not None else trainer.cfg.grad_sample_mode
    if mode == "bk":
        layers = {f"conv{i}": r for i, r in trainer.clipper.taken.items()}
    else:  # Opacus' modes treat every layer alike
        layers = {f"conv{i}": mode for i, m in enumerate(m for m in trainer.model.modules()
                                                         if isinstance(m, (nn.Conv2d, nn.Linear))
                                                         and m.weight.requires_grad)  # frozen: no route
                  if isinstance(m, nn.Conv2d)}
    return dict(route=mode, layer_routes=layers,
                chosen=trainer.route.describe() if trainer.route is not None else None,
                measured=trainer.route.to_dict() if trainer.route is not None else None)


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
        trainer = planned_trainer(cfg, data_lib.prepare(inputs.data, inputs.train_indices, inputs.device, input_stats(cfg)),
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
    return _emit(args, report, f"{args.dataset} {args.method} central DP epoch + evaluation, {report['threads']} "
                               f"threads: default ({cfg.grad_sample_mode} → {report['route']}, {cfg.memory_format}) "
                               f"{report['seconds_per_epoch']:.2f} s, baseline (hooks, NCHW) "
                               f"{report['baseline_seconds_per_epoch']:.2f} s, speed-up {report['speedup']:.2f}x")


def bench_deploy(args: argparse.Namespace) -> int:
    """The same federation three ways, one after the other on this machine: simulated (Ray),
    deployed (a SuperLink and a SuperNode per client, TLS, node authentication, each client on
    its own folder of the same shard under max-epsilon=inf), and Flower's floor on the same
    deployment (deploy/floor: a round that sends a model of the same shapes and gets it back).
    Each is the median of rounds 2…R (round 1 starts processes and fills caches)."""
    cfg, fed = from_args(TrainConfig, args), from_args(FedConfig, args)
    fed.validate()
    cfg.resolved()  # every setting checked before anything starts
    if fed.rounds < 2:
        raise ConfigError("--rounds: at least 2 (round 1 starts processes; rounds 2… are timed)")
    if args.work:
        check_out_dir(args.work)
    build_federation(cfg, fed).check_plans()  # the data found, every client's σ within its budget
    dry_run.stop_here(f"time {fed.rounds} rounds of {fed.num_clients} clients simulated, deployed and at Flower's "
                      f"floor in {args.work or 'a temporary folder'}")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fedsd-bench-deploy-"))
    try:
        runs = three_ways(cfg, fed, work, args.timeout)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    report = deploy_report(cfg, fed, runs)
    return _emit(args, report, f"{fed.num_clients} clients, {cfg.dataset} {cfg.method}, rounds 2–{fed.rounds} median: "
                               f"simulated {report['simulated_round_seconds']:.2f} s, deployed "
                               f"{report['deployed_round_seconds']:.2f} s, Flower's floor "
                               f"{report['floor_round_seconds']:.2f} s; (deployed − floor) / simulated = "
                               f"{report['fedsd_share']:.2f}; same model: max |Δw| = {report['max_weight_difference']:.1e}")


def _phase(text: str) -> None:
    print(f"bench deploy: {text}", file=sys.stderr, flush=True)


def three_ways(cfg: TrainConfig, fed: FedConfig, work: Path, timeout: float) -> dict:
    """The federation simulated, deployed on the clients' own folders, and Flower's floor on the
    same deployment: what each run left (results, weights, the deployment's poll and threads)."""
    _phase(f"{fed.num_clients} client folders")
    write_client_folders(cfg, fed, work / "client-data", "npz", echo=lambda line: None)
    _phase("simulated run (Ray)")
    simulated, simulated_weights = simulate(cfg, fed, progress=False)
    _phase("deployment: SuperLink, SuperNodes, TLS, node authentication")
    # Seeded noise, the owner's word given: this bench owns both sides and checks that the
    # deployed clients train the simulated model exactly (a real owner keeps the default,
    # secret noise, which no server can predict).
    with LocalDeployment(work / "deployment", fed.num_clients, client_data=work / "client-data",
                         node_config="max-epsilon=inf noise='seeded' trust-server-with-noise=true") as deployment:
        deployment.start()
        _phase("deployed run (clients on their own data)")
        deployment.run({**to_flat(cfg, fed), "client-data": "own", "num-clients": fed.num_clients,
                        "num-server-rounds": fed.rounds, "out-dir": str(work / "deployed")}, timeout=timeout)
        # The floor sends what fedsd's ServerApp sends: the model's arrays, as many floats.
        shapes = [list(v.shape) for v in simulated_weights.values()]
        _phase("Flower's floor (deploy/floor) on the same deployment")
        deployment.run({"num-server-rounds": fed.rounds, "num-clients": fed.num_clients,
                        "shapes": json.dumps(shapes, separators=(",", ":")),
                        "out-dir": str(work / "floor")}, timeout=timeout, app=FLOOR_APP)
        superexec_poll = float(deployment.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"])
        node_threads = deployment.node_threads
    return dict(simulated=simulated, simulated_weights=simulated_weights,
                deployed=RunResult.read(work / "deployed" / "result.json"),
                deployed_weights=torch.load(work / "deployed" / "model.pt", weights_only=True),
                floor=json.loads((work / "floor" / "floor.json").read_text())["round_seconds"],
                superexec_poll=superexec_poll, node_threads=node_threads)


def deploy_report(cfg: TrainConfig, fed: FedConfig, runs: dict) -> dict:
    """Rounds 2…R's medians of the three, and what fedsd adds to Flower's floor per second of a
    simulated round."""
    from fedsd.app.server.grid import default_poll_seconds  # Flower's

    simulated, deployed, floor = runs["simulated"], runs["deployed"], runs["floor"]
    sim_rounds = [r["seconds"] for r in simulated["rounds"]]
    dep_rounds = [r["seconds"] for r in deployed.rounds]
    report = dict(dataset=cfg.dataset, method=cfg.method, epsilon=cfg.epsilon, batch_size=deployed.config["batch_size"],
                  clients=fed.num_clients, rounds=fed.rounds, local_epochs=fed.local_epochs, partition=fed.partition,
                  threads=cfg.threads, deployed_threads_per_node=cfg.threads or runs["node_threads"],
                  simulated_threads_per_client=cfg.threads or max(1, int(fed.client_cpus)),
                  shard_sizes=deployed.shard_sizes, cpu_isa=torch.backends.cpu.get_cpu_capability().lower(),
                  grid_poll_seconds=default_poll_seconds(), superexec_poll_seconds=runs["superexec_poll"],
                  simulated_round_seconds=statistics.median(sim_rounds[1:]),
                  deployed_round_seconds=statistics.median(dep_rounds[1:]),
                  floor_round_seconds=statistics.median(floor[1:]),
                  simulated_rounds=sim_rounds, deployed_rounds=dep_rounds, floor_rounds=floor,
                  simulated_test_accuracy=simulated["test_accuracy"], deployed_test_accuracy=deployed.test_accuracy,
                  max_weight_difference=max(float((runs["simulated_weights"][k] - v).abs().max())
                                            for k, v in runs["deployed_weights"].items()))
    report["deployed_over_simulated"] = report["deployed_round_seconds"] / report["simulated_round_seconds"]
    # What fedsd adds to Flower's floor, per second of a simulated round (the target: ≤ 1.15).
    report["fedsd_share"] = (report["deployed_round_seconds"] - report["floor_round_seconds"]) / \
        report["simulated_round_seconds"]
    return report


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
    return _emit(args, report, f"{inputs.cfg.method}: over {len(records)} distilling epochs, ‖S_kd‖/‖S_ce‖ "
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
    report = soak(args.clients, args.rounds, args.faults, args.seed, Path(args.work),
                  echo=lambda line: print(line, file=sys.stderr), churn=args.churn)
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
