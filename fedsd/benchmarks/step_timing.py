"""`fedsd bench step`: one DP-SGD step in every clipping mode against the eager NCHW non-private
step a user would write and the fastest non-private step (compiled where that changes no bit),
timed interleaved in one run; with --layers, layer by layer (fedsd.benchmarks.layer_times)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch import nn

from fedsd.clipping import conv_kernel, routes
from fedsd.runtime import resolve_device
from fedsd.settings.run import TrainConfig
from fedsd.data.datasets import TensorData
from fedsd.errors import ConfigError
from fedsd.methods import METHODS, method_of
from fedsd.models.networks import build_model, input_shape_of
from fedsd.models.pretrained import check_train_layers
from fedsd.privacy.accounting import plan
from fedsd.training.compiled import student_forward, teacher_forward
from fedsd.training.loop import planned_trainer
from fedsd.benchmarks import layer_times
from fedsd.runtime import inductor_cache_by_isa
from fedsd import dry_run




# The reference a user would write: eager PyTorch, NCHW, hooks for DP (Opacus' default).
def every_epoch_distils(method: str) -> dict:
    """No warm-up for a self-distilling method: every timed epoch pays for its teacher."""
    return {"distill_warmup_epochs": 0} if METHODS[method].self_distilling else {}


def emit(args: argparse.Namespace, report, text: str) -> int:
    """A bench's result: the JSON with --json, else the human-readable text."""
    print(json.dumps(report, indent=2) if args.json else text, file=sys.stdout)
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
    return emit(args, rows, "\n".join(step_lines(args, base.batch_size, device, rows)))


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
    return emit(args, report, "\n".join(layer_times.lines(report)))


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
    an AVX-512 CPU they crash or compute garbage, results/perf.md, tests/training/test_torch_inductor_maxpool.py.)"""
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

