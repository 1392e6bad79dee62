"""The per-sample clipping route, chosen by measurement on the machine at hand.

Which exact route is fastest depends on the CPU, not only on the model: book-keeping's conv
kernel (fedsd.conv_kernel) wins on one CPU and loses to PyTorch's batched products or to
Opacus' expanded weights on another (results/perf.md). So, as cuDNN's benchmark mode picks a
convolution algorithm, `--grad-sample-mode auto` (the default) times the candidates the first
time a (model, batch size, layout, device, CPU, threads, torch and kernel version) is trained:

  1. per conv layer, book-keeping's three ways to its norms and clipped sum (ghost norms, the
     kernel's per-sample gradients, PyTorch's patches), on the layer's real (a, g);
  2. whole DP steps of book-keeping with the fastest way per layer against Opacus' `ew`.

The fastest is kept in FEDSD_CACHE_DIR/routes/ (beside the kernel build), under a file lock,
so one process measures and every later run and Ray worker on the machine reads the same
choice: a run, every client of a simulated federation and the single-client identity use one
route throughout. Every route gives the same weights to float rounding and the same ε
(tests/test_grad_sample_modes.py); `--grad-sample-mode` forces one. Measuring does not touch
any random state of the run.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import cache_root, conv_kernel
from .bookkeeping import CONV_ROUTES, BookKeepingClipper
from .methods import cross_entropy

AUTO = "auto"
# The candidates and the layout each runs in under --memory-format auto: book-keeping
# channels-last (about twice as fast here, results/perf.md), Opacus' expanded weights NCHW (its
# per-sample conv gradients view the output gradient as NCHW, and fail on channels-last ones at
# some shapes: mnist-cnn at B = 16).
STEP_CANDIDATES = {"bk": "channels-last", "ew": "contiguous"}
LAYOUTS = {"channels-last": torch.channels_last, "contiguous": torch.contiguous_format}
FORMAT_VERSION = 2
WARMUP, REPEATS = 1, 3


@dataclass(frozen=True)
class Route:
    """A measured choice: the mode, bk's route per conv layer (its index among the Conv2d and
    Linear layers), and why (the milliseconds each candidate took)."""
    mode: str
    memory_format: str  # channels-last or contiguous: the layout the run takes with this mode
    conv_routes: dict[int, str] = field(default_factory=dict)
    cpu_isa: str | None = None  # the conv kernel's instruction set where it is built (avx512, avx2, ...)
    step_ms: dict[str, float] = field(default_factory=dict)
    layer_ms: dict[int, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Route":
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"route file format {d.get('format')!r}, expected {FORMAT_VERSION}")
        return cls(d["mode"], d["memory_format"], {int(k): v for k, v in d["conv_routes"].items()}, d.get("cpu_isa"),
                   d["step_ms"], {int(k): v for k, v in d["layer_ms"].items()})

    def describe(self) -> str:
        """One line: the choice and the times it was chosen on."""
        layers = ", ".join(f"conv{i}: {r} ({self.layer_ms[i][r]:.1f} ms; "
                           + " ".join(f"{k} {v:.1f}" for k, v in self.layer_ms[i].items() if k != r) + ")"
                           for i, r in self.conv_routes.items())
        steps = ", ".join(f"{k} {v:.1f} ms" for k, v in self.step_ms.items())
        return f"{self.mode}, {self.memory_format} (steps: {steps})" + (f"; bk per layer: {layers}" if layers else "")


def choose(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
    """The measured route for a run of `cfg` (a resolved TrainConfig; its model, batch size,
    clip, layout and threads) on `device`: read from the cache, else measured once (under a
    lock, so concurrent processes on this machine agree) and cached."""
    threads = cfg.threads or torch.get_num_threads()
    key = _key(cfg, num_classes, input_shape, device, threads)
    folder = cache_root() / "routes"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            try:
                return Route.from_dict(json.loads(path.read_text())["route"])
            except (ValueError, KeyError, TypeError):
                pass  # unreadable or of an older format: measured again
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                route = measure(cfg, num_classes, input_shape, device)
        finally:
            torch.set_num_threads(before)
        from .results import write_json

        write_json(path, {"key": key, "route": route.to_dict()})
        return route


def _key(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device, threads: int) -> dict:
    """What the measured times depend on: the work (model, activation, classes, input, batch size,
    layout), where it runs (device, CPU, threads) and the code that does it (torch, the kernel's
    source and build)."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else conv_kernel._cpu_id()
    kernel = hashlib.sha256(conv_kernel.SOURCE.encode()).hexdigest()[:16] if conv_kernel.available() else None
    return dict(model=cfg.model, activation=cfg.activation, classes=num_classes, input=list(input_shape),
                batch_size=cfg.batch_size, memory_format=cfg.memory_format, device=device.type, where=where,
                threads=threads, torch=torch.__version__, kernel=kernel,
                kernel_march=os.environ.get(conv_kernel.MARCH_ENV, "native"), cc=os.environ.get("CC", ""),
                format=FORMAT_VERSION)


def timer(device: torch.device):
    """A function that runs fn() and returns its seconds (CUDA events on a GPU)."""
    if device.type == "cuda":
        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
    else:
        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return timed


def _median_ms(fn, timed) -> float:
    for _ in range(WARMUP):
        fn()
    return 1000 * statistics.median(timed(fn) for _ in range(REPEATS))


def layout_for(mode: str, memory_format: str) -> str:
    """The layout a candidate runs in: its own under --memory-format auto, else the one asked."""
    return STEP_CANDIDATES[mode] if memory_format == AUTO else memory_format


def measure(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
    """Time the candidates on a batch of the real shape (the values do not matter, the shapes
    do); see the module's docstring. A candidate that fails on it is left out."""
    from .models import build_model

    timed = timer(device)
    batch_size = cfg.batch_size
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, *input_shape, generator=generator).to(device)
    y = torch.randint(0, num_classes, (batch_size,), generator=generator).to(device)
    # 1. Each conv layer's ways to its norms and clipped sum, on its real input and output gradient.
    bk_layout = LAYOUTS[layout_for("bk", cfg.memory_format)]
    model = build_model(cfg.model, num_classes, activation=cfg.activation).to(device, memory_format=bk_layout)
    clipper = BookKeepingClipper(model, cfg.clip)
    captured = clipper.captured(nn.functional.cross_entropy(model(x.contiguous(memory_format=bk_layout)), y))
    coeff = torch.ones(batch_size, device=device)
    conv_routes, layer_ms = {}, {}
    for index, (layer, a, g) in enumerate(captured):
        if not isinstance(layer, nn.Conv2d):
            continue
        ways = [r for r in CONV_ROUTES if r != "kernel" or conv_kernel.applies(layer, a, g)]

        def way(route, layer=layer, a=a, g=g):
            norms2 = torch.zeros(batch_size, device=device)
            clipper.layer_clipped_sum(layer, a, g, clipper.add_layer_norms2(norms2, layer, a, g, route), coeff)
        layer_ms[index] = {r: _median_ms(lambda r=r: way(r), timed) for r in ways}
        conv_routes[index] = min(layer_ms[index], key=layer_ms[index].get)
    del captured
    # 2. Whole steps: book-keeping with those ways against Opacus' expanded weights, interleaved.
    steps = {mode: _step(mode, cfg, x, y, num_classes, conv_routes) for mode in STEP_CANDIDATES}
    times = {mode: [] for mode in steps}
    for i in range(WARMUP + REPEATS):
        for mode, step in list(steps.items()):
            try:
                seconds = timed(step)
            except RuntimeError:  # this route cannot take this configuration: not a candidate
                del steps[mode], times[mode]
                continue
            if i >= WARMUP:
                times[mode].append(seconds)
    step_ms = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
    mode = min(step_ms, key=step_ms.get)
    return Route(mode, layout_for(mode, cfg.memory_format), conv_routes if mode == "bk" else {}, conv_kernel.isa(),
                 step_ms, layer_ms)


def _step(mode: str, cfg, x: torch.Tensor, y: torch.Tensor, num_classes: int, conv_routes: dict[int, str]):
    """One DP-SGD step of `mode` on (x, y), as a run takes it (fedsd.training.DPTrainer:
    clipping, noise, the update), in the mode's layout."""
    import dataclasses

    from .data import TensorData
    from .privacy import PrivacyPlan
    from .training import DPTrainer

    plan = PrivacyPlan(1.0, 0.5, 1, 1.0, 1e-5, "rdp")  # timing only: σ and q do not change the work
    run = dataclasses.replace(cfg, grad_sample_mode=mode, memory_format=layout_for(mode, cfg.memory_format))
    trainer = DPTrainer(run, TensorData(x, y, x[:1], y[:1], num_classes), plan)
    if mode == "bk":
        trainer.clipper.conv_routes = dict(conv_routes)
    return lambda: trainer.train_on_batch(trainer.data.x_train, y, cross_entropy())
