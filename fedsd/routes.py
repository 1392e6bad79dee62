"""The run's route: which clipper, in which layout, is fastest on the machine at hand, measured.

Which exact clipper is fastest depends on the CPU, not only on the model: book-keeping's conv
kernel (fedsd.conv_kernel) wins on one CPU and loses to PyTorch's batched products or to
Opacus' expanded weights on another (results/perf.md). So, as cuDNN's benchmark mode picks a
convolution algorithm, `--grad-sample-mode auto` (the default) times the candidates the first
time a (model, batch size, layout, device, CPU, threads, torch and kernel version) is trained:

  1. per conv layer, book-keeping's three ways to its norms and clipped sum (ghost norms, the
     kernel's per-sample gradients, PyTorch's patches), on the layer's real (a, g);
  2. whole DP steps of every clipper `auto` may pick (each clipper's `auto_layouts`: book-keeping
     with the fastest way per layer, Opacus' hooks, functorch, expanded weights and ghost
     clipping), interleaved, so that a load on the machine falls on all of them alike.

The fastest is kept in FEDSD_CACHE_DIR/routes/ (beside the kernel build), under a file lock,
so one process measures and every later run and Ray worker on the machine reads the same
choice: a run, every client of a simulated federation and the single-client identity use one
route throughout. A choice whose timings overlap the runner-up's (a busy machine) is kept for
an hour only, and a run whose steps come out well above what was measured (`check`) forgets
it: a later run measures again. `fedsd bench routes` lists the kept ones, `--clear` forgets them.
Every route gives the same weights to float rounding and the same ε
(tests/test_grad_sample_modes.py); `--grad-sample-mode` forces one. Measuring does not touch
any random state of the run, and is done while a run is planned (`for_run`), before its
trainer is built: the trainer is handed its route.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import cache_root, conv_kernel
from .bookkeeping import CONV_WAYS, BookKeepingClipper
from .clippers import CLIPPERS
from .errors import ConfigError, ModelNotPrivateError
from .models import traced_for_hooks
from .physical import measured_batch_size

AUTO = "auto"
LAYOUTS = {"channels-last": torch.channels_last, "contiguous": torch.contiguous_format}
# 3: conv_ways, every clipper auto may pick, and the timings' spread (2, read too: conv_routes).
FORMAT_VERSION = 3
WARMUP, REPEATS, MAX_REPEATS = 1, 3, 9
# A run whose steps take more than this times what its route's step was measured at forgets
# the route: the next run measures again (a method's loss and a run's data add some, not this).
SLOWER_THAN_MEASURED = 2.0
# An unsettled choice (its timings overlapped the runner-up's) is kept this long, so that the
# processes of one run (a simulation's Ray workers, central and single-client) agree on it,
# and measured again by a run after that.
UNSETTLED_SECONDS = 3600.0


def step_candidates() -> dict[str, str]:
    """Every mode --grad-sample-mode auto may pick, with the layout it runs in then."""
    return {mode: layout for cls in dict.fromkeys(CLIPPERS.values()) for mode, layout in cls.auto_layouts.items()}


@dataclass(frozen=True)
class Route:
    """A measured choice: the mode, the layout it runs in, bk's way per conv layer (its index
    among the Conv2d and Linear layers), and why (the milliseconds each candidate took: the
    median, and the spread of its repeats)."""
    mode: str
    memory_format: str  # channels-last or contiguous: the layout the run takes with this mode
    conv_ways: dict[int, str] = field(default_factory=dict)
    cpu_isa: str | None = None  # the conv kernel's instruction set where it is built (avx512, avx2, ...)
    step_ms: dict[str, float] = field(default_factory=dict)
    layer_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    step_spread_ms: dict[str, list[float]] = field(default_factory=dict)  # [fastest, slowest] repeat
    settled: bool = True  # whether the fastest's repeats were all faster than the runner-up's

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Route":
        if d.get("format") not in (2, FORMAT_VERSION):
            raise ValueError(f"route file format {d.get('format')!r}, expected {FORMAT_VERSION}")
        ways = d.get("conv_ways", d.get("conv_routes", {}))
        return cls(d["mode"], d["memory_format"], {int(k): v for k, v in ways.items()}, d.get("cpu_isa"),
                   d["step_ms"], {int(k): v for k, v in d["layer_ms"].items()}, d.get("step_spread_ms", {}),
                   d.get("settled", True))

    def describe(self) -> str:
        """One line: the choice and the times it was chosen on."""
        layers = ", ".join(f"conv{i}: {r} ({self.layer_ms[i][r]:.1f} ms; "
                           + " ".join(f"{k} {v:.1f}" for k, v in self.layer_ms[i].items() if k != r) + ")"
                           for i, r in self.conv_ways.items())
        steps = ", ".join(f"{k} {v:.1f} ms" for k, v in self.step_ms.items())
        return (f"{self.mode}, {self.memory_format} (steps: {steps})" + (f"; bk per layer: {layers}" if layers else "")
                + ("" if self.settled else "; not settled: measured again next time"))


def for_run(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> "Route | None":
    """The route a run of `cfg` takes, measured (or read) while the run is planned: None unless
    --grad-sample-mode auto (a forced mode needs no measuring)."""
    return choose(cfg, num_classes, input_shape, device) if cfg.grad_sample_mode == AUTO else None


def choose(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
    """The measured route for a run of `cfg` (a resolved TrainConfig; its model, batch size,
    clip, layout and threads) on `device`: read from the cache, else measured once (under a
    lock, so concurrent processes on this machine agree) and cached; a choice that was not
    settled is measured again once it is UNSETTLED_SECONDS old."""
    threads = cfg.threads or torch.get_num_threads()
    # measured on one pass's batch: a run in physical batches takes several such passes a step
    cfg = dataclasses.replace(cfg, batch_size=measured_batch_size(cfg, num_classes, input_shape, device))
    key = _key(cfg, num_classes, input_shape, device, threads)
    path = _route_file(key)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                route = Route.from_dict(saved["route"])
                if route.settled or time.time() - saved.get("measured_at", 0) < UNSETTLED_SECONDS:
                    return route
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

        write_json(path, {"key": key, "route": route.to_dict(), "measured_at": time.time()})
        return route


def check(route: Route | None, cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device,
          seconds_per_step: float) -> bool:
    """After a run's steps: whether they took what its route was measured at. Steps well above it
    (SLOWER_THAN_MEASURED: a choice measured while the machine was busy) make this machine forget
    the route, so the next run measures again; the run itself keeps its route. True when fine."""
    if route is None or route.mode not in route.step_ms:
        return True
    passes = math.ceil(cfg.batch_size / (measured := measured_batch_size(cfg, num_classes, input_shape, device)))
    if 1000 * seconds_per_step <= SLOWER_THAN_MEASURED * passes * route.step_ms[route.mode]:
        return True
    cfg = dataclasses.replace(cfg, batch_size=measured)
    threads = cfg.threads or torch.get_num_threads()
    _route_file(_key(cfg, num_classes, input_shape, device, threads)).unlink(missing_ok=True)
    return False


def _route_file(key: dict):
    """Where the route measured for `key` (_key) is kept."""
    folder = cache_root() / "routes"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"


def cached() -> list[tuple[dict, Route]]:
    """Every route kept on this machine: (what it was measured for, the route)."""
    found = []
    for path in sorted((cache_root() / "routes").glob("*.json")):
        try:
            saved = json.loads(path.read_text())
            found.append((saved["key"], Route.from_dict(saved["route"])))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def forget_all() -> int:
    """Forget every kept route (each is measured again when next needed); how many there were."""
    paths = list((cache_root() / "routes").glob("*.json"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


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
                format=FORMAT_VERSION,
                # Named only where the network is traced: a route measured before fedsd traced it
                # (expanded weights, the one mode that could run) is then measured again, and
                # every other kept route stays valid.
                **({"traced_for_hooks": True} if traced_for_hooks(cfg, num_classes) else {}))


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
    return step_candidates()[mode] if memory_format == AUTO else memory_format


def measure(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
    """Time the candidates on a batch of the real shape (the values do not matter, the shapes
    do); see the module's docstring. A candidate that fails on it is left out."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(cfg.batch_size, *input_shape, generator=generator).to(device)
    y = torch.randint(0, num_classes, (cfg.batch_size,), generator=generator).to(device)
    conv_ways, layer_ms = _measure_conv_ways(cfg, x, y, num_classes, device)
    steps, failed = {}, {}
    for mode in step_candidates():
        if cfg.memory_format == AUTO or mode in _exact_in(cfg.memory_format):
            try:
                steps[mode] = _step(mode, cfg, x, y, num_classes, conv_ways)
            except Exception as e:  # noqa: BLE001  (this clipper cannot take this model or layout: not a candidate)
                failed[mode] = e
    times = _interleaved(steps, timer(device), failed)
    if not times:  # no exact clipper can train this network: refused before any step
        raise ModelNotPrivateError(f"--model {cfg.model}: no per-sample clipping route can train it; "
                                   + "; ".join(f"{mode}: {str(e).splitlines()[0][:200]}" for mode, e in failed.items()))
    step_ms = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
    spread = {mode: [1000 * min(t), 1000 * max(t)] for mode, t in times.items()}
    ranked = sorted(step_ms, key=step_ms.get)
    mode = ranked[0]
    settled = len(ranked) == 1 or spread[mode][1] < spread[ranked[1]][0]
    return Route(mode, layout_for(mode, cfg.memory_format), conv_ways if mode == "bk" else {}, conv_kernel.isa(),
                 step_ms, layer_ms, spread, settled)


def _exact_in(memory_format: str) -> tuple[str, ...]:
    from .clippers import CHANNELS_LAST_EXACT

    return CHANNELS_LAST_EXACT if memory_format == "channels-last" else tuple(CLIPPERS)


def _measure_conv_ways(cfg, x, y, num_classes: int, device) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """Each conv layer's fastest way to its norms and clipped sum, on its real input and output gradient."""
    from .models import model_for

    timed = timer(device)
    layout = LAYOUTS[layout_for("bk", cfg.memory_format)]
    model = model_for(cfg, num_classes).to(device, memory_format=layout)
    try:
        clipper = BookKeepingClipper(model, cfg.clip)
        captured = clipper.captured(nn.functional.cross_entropy(model(x.contiguous(memory_format=layout)), y))
    except ConfigError:  # a layer book-keeping has no rule for: bk is no candidate (measure leaves it out)
        return {}, {}
    coeff = torch.ones(len(y), device=device)
    conv_ways, layer_ms = {}, {}
    for index, (layer, a, g) in enumerate(captured):
        if not isinstance(layer, nn.Conv2d):
            continue
        ways = [w for w in CONV_WAYS if w != "kernel" or conv_kernel.applies(layer, a, g)]

        def way(w, layer=layer, a=a, g=g):
            norms2 = torch.zeros(len(y), device=device)
            clipper.layer_clipped_sum(layer, a, g, clipper.add_layer_norms2(norms2, layer, a, g, w), coeff)
        layer_ms[index] = {w: _median_ms(lambda w=w: way(w), timed) for w in ways}
        conv_ways[index] = min(layer_ms[index], key=layer_ms[index].get)
    return conv_ways, layer_ms


def _interleaved(steps: dict, timed, failed: dict | None = None) -> dict[str, list[float]]:
    """Each candidate's step timed in turn, round after round (a load on the machine falls on all
    alike), until the fastest's repeats are all faster than the runner-up's or MAX_REPEATS; a
    candidate that fails is left out."""
    times = {mode: [] for mode in steps}
    for i in range(WARMUP + MAX_REPEATS):
        for mode, step in list(steps.items()):
            try:
                seconds = timed(step)
            except Exception as e:  # noqa: BLE001  (this clipper cannot take this configuration: not a candidate)
                del steps[mode], times[mode]
                if failed is not None:
                    failed[mode] = e
                continue
            if i >= WARMUP:
                times[mode].append(seconds)
        if i + 1 - WARMUP >= REPEATS and _apart(times):
            break
    return times


def _apart(times: dict[str, list[float]]) -> bool:
    ranked = sorted(times, key=lambda m: statistics.median(times[m]))
    return len(ranked) < 2 or max(times[ranked[0]]) < min(times[ranked[1]])


def _step(mode: str, cfg, x: torch.Tensor, y: torch.Tensor, num_classes: int, conv_ways: dict[int, str]):
    """One DP-SGD step of `mode` on (x, y) as a run takes it (the clipper's clipped sum, Opacus'
    noise, the update), in the mode's layout, built here without a trainer."""
    from .models import model_for

    run = dataclasses.replace(cfg, grad_sample_mode=mode, memory_format=layout_for(mode, cfg.memory_format))
    layout = LAYOUTS[run.memory_format]
    model = model_for(cfg, num_classes).to(x.device, memory_format=layout)
    clipper = CLIPPERS[mode](model, run, mode)
    clipper.take(Route(mode, run.memory_format, dict(conv_ways)))
    optimizer = clipper.make_optimizer(torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum),
                                       noise_multiplier=1.0, max_grad_norm=cfg.clip,
                                       expected_batch_size=cfg.batch_size, loss_reduction="mean",
                                       generator=torch.Generator(device=x.device).manual_seed(0))
    x = x.contiguous(memory_format=layout)

    def step():
        clipper.backward(nn.functional.cross_entropy(clipper.module(x), y, reduction="none"))
        optimizer.step()
        # The candidates take turns (_interleaved): each frees its per-sample gradients before the
        # next one's turn, so that the measuring holds one candidate's at a time, as a run does.
        optimizer.zero_grad(set_to_none=True)
    return step
