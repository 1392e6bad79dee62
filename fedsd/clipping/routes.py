"""The run's route: which clipper, in which layout, and book-keeping's way per conv layer.

The clippers (fedsd.clipping) and book-keeping's ways to a conv layer's norms and clipped sum
(fedsd.clipping.bookkeeping: ghost norms, fedsd.clipping.conv_kernel's per-sample gradients, PyTorch's patches)
compute the same clipped sums, but each sums in its own order: two of them give weights that
differ in the last bits, and the difference grows over a run. So what decides among them must
not be a clock. Which choices change the bits, and who makes them:

  - the mode (the clipper), its layout (channels-last or contiguous) and each conv layer's way:
    every one changes the bits. `--grad-sample-mode auto` (the default) takes them by `rule`,
    which reads the shapes and the instruction set of the conv kernel's build, never a clock (a
    cost model calibrated per instruction set, RULES below), and the run records the route it
    took (result.json's and the checkpoint's `route`). `--route` (or `fedsd train
    --route-from RUN`) gives a recorded route back: the same weights on any machine with the
    same thread count and instruction set.
  - how the conv kernel splits a batch over threads (one sample to one thread) and the size of
    the chunks PyTorch's patches are made in: neither changes the bits; both are fixed, not timed.

No clock decides anything a run computes. `measure` still times every candidate, on a batch of
the real shape, for `fedsd bench routes --measure` (how the rule's choice stands against the
others on this machine: how a new instruction set's RULES entry is calibrated).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from fedsd.clipping import conv_kernel
from fedsd.files.cache import cache_root
from fedsd.clipping.bookkeeping import CONV_WAYS, GHOST_FLOPS_LIMIT, GHOST_FLOPS_LIMIT_WITH_KERNEL, BookKeepingEngine
from fedsd.clipping import CHANNELS_LAST_EXACT, CLIPPERS
from fedsd.errors import ConfigError, ModelNotPrivateError
from fedsd.models.networks import convolutional, model_for, traced_for_hooks
from fedsd.training.physical_batches import measured_batch_size

AUTO = "auto"
LAYOUTS = {"channels-last": torch.channels_last, "contiguous": torch.contiguous_format}
# 4: chosen by the rule (chosen_by, made_for); 3: conv_ways, measured; 2: conv_routes. All read.
FORMAT_VERSION = 4
WARMUP, REPEATS, MAX_REPEATS = 1, 3, 9
# The rule's name, recorded with each route it makes: a later change of RULES takes a new one
# (isa-flops-1: the kernel on avx512 only, ghost norms below 0.5× the flops; a route recorded by
# it is given back as it was).
# isa-flops-2: under --memory-format auto, channels-last for every network; isa-flops-3: NCHW for a
# network without a convolution.
RULE = "isa-flops-3"
# Book-keeping's way per conv layer, by the instruction set of fedsd.clipping.conv_kernel's build (None:
# no kernel; "cuda": a GPU): where per-sample gradients come from ("kernel" where it applies,
# else PyTorch's patches), and below what share of their flops ghost norms are taken instead.
# Ghost norms cost 2T²(d+p) flops a sample, per-sample gradients 2T·d·p (T output positions,
# d = c·k·k inputs, p output channels). Calibrated by `fedsd bench routes --measure` at the
# papers' batch sizes, 1 and 2 threads (results/perf.md):
#   - avx512 and avx2 (the kernel built for x86-64-v3 on the AVX-512 CPU, under the AVX2
#     emulation): the kernel is the fastest on every conv of both CNNs, at 2.7–3.3× the patches'
#     speed on mnist-cnn's (AVX2, 1 thread: 6.4 and 7.6 ms against 19.5 and 17.6), and against
#     ghost norms down to 0.15× the flops (cifar-cnn conv4: 14.6 ms against 19.4 on AVX-512,
#     25.1 against 36.8 on AVX2, 1 thread; 8.1 against 12.4 and 13.1 against 19.3 at 2): ghost,
#     about 1.4× the kernel's time there, takes over below about 0.1×. (isa-flops-1 kept the
#     AVX2 kernel out: built with memcpy loads, it ran at a sixth of its speed, conv_kernel.)
#     The AVX2 figures are of the x86-64-v3 build on the AVX-512 CPU; no AVX2-only CPU was at
#     hand to measure since;
#   - sse: the kernel and the patches within 15 % of each other (mnist-cnn, 1 thread: 18.8 against
#     18.9 ms and 20.8 against 17.8): the patches, PyTorch's own code;
#   - a GPU: bk's flops rule without the kernel (GHOST_FLOPS_LIMIT), not measured beyond it.
RULES = {
    "avx512": dict(per_sample="kernel", ghost_below=GHOST_FLOPS_LIMIT_WITH_KERNEL),  # 0.1, bk's own with the kernel
    "avx2": dict(per_sample="kernel", ghost_below=GHOST_FLOPS_LIMIT_WITH_KERNEL),
    "sse": dict(per_sample="patches", ghost_below=0.5),
    None: dict(per_sample="patches", ghost_below=0.5),
    "cuda": dict(per_sample="patches", ghost_below=GHOST_FLOPS_LIMIT),  # 2.0
}
# Where book-keeping cannot take a network (a layer it has no rule for): the first of these
# that trains it, in the layout it runs in under auto (each clipper's auto_layouts). Ghost
# clipping was the fastest of Opacus' modes on scatter-linear (GroupNorm), the one such network
# among the papers'; the others follow by how often they were the fastest measured.
FALLBACK_ORDER = ("ghost", "ew", "functorch", "hooks")


def step_candidates() -> dict[str, str]:
    """Every mode --grad-sample-mode auto may take, with the layout it runs in then."""
    return {mode: layout for cls in dict.fromkeys(CLIPPERS.values()) for mode, layout in cls.auto_layouts.items()}


@dataclass(frozen=True)
class Route:
    """A run's route: the mode, the layout it runs in, bk's way per conv layer (its index among
    the Conv2d and Linear layers), how it was chosen (`chosen_by`: "rule", "given" back from a
    recorded route, or "measured" by fedsd before routes were chosen by rule) and what it was
    made for (`made_for`: model, classes, input, threads, the instruction sets). A measured
    route also holds why (the milliseconds each candidate took: the median, and the spread of
    its repeats)."""
    mode: str
    memory_format: str  # channels-last or contiguous: the layout the run takes with this mode
    conv_ways: dict[int, str] = field(default_factory=dict)
    cpu_isa: str | None = None  # the conv kernel's instruction set where it is built (avx512, avx2, ...)
    step_ms: dict[str, float] = field(default_factory=dict)
    layer_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    step_spread_ms: dict[str, list[float]] = field(default_factory=dict)  # [fastest, slowest] repeat
    settled: bool = True  # measured: whether the fastest's repeats were all faster than the runner-up's
    chosen_by: str = "measured"
    made_for: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Route":
        if d.get("format") not in (2, 3, FORMAT_VERSION):
            raise ValueError(f"route file format {d.get('format')!r}, expected {FORMAT_VERSION}")
        ways = d.get("conv_ways", d.get("conv_routes", {}))
        return cls(d["mode"], d["memory_format"], {int(k): v for k, v in ways.items()}, d.get("cpu_isa"),
                   d.get("step_ms", {}), {int(k): v for k, v in d.get("layer_ms", {}).items()},
                   d.get("step_spread_ms", {}), d.get("settled", True), d.get("chosen_by", "measured"),
                   d.get("made_for", {}))

    def spec(self) -> str:
        """The route as --route takes it: MODE:LAYOUT[:INDEX=WAY,...] (bk: a way per conv layer)."""
        ways = ",".join(f"{i}={w}" for i, w in sorted(self.conv_ways.items()))
        return f"{self.mode}:{self.memory_format}" + (f":{ways}" if ways else "")

    @classmethod
    def from_spec(cls, spec: str) -> "Route":
        """A route as --route gives it (spec); ConfigError naming --route for anything else."""
        allowed = ("MODE:LAYOUT or bk:LAYOUT:INDEX=WAY,... (e.g. bk:channels-last:0=kernel,1=ghost), "
                   f"a mode of {', '.join(step_candidates())}, a layout of {', '.join(LAYOUTS)}, a way of "
                   f"{', '.join(CONV_WAYS)}")
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in step_candidates() or parts[1] not in LAYOUTS:
            raise ConfigError(f"--route: {spec!r} is no route; give {allowed}")
        ways = {}
        for item in parts[2].split(",") if len(parts) == 3 and parts[2] else []:
            index, _, way = item.partition("=")
            if not index.isdigit() or way not in CONV_WAYS or parts[0] != "bk":
                raise ConfigError(f"--route: {spec!r}: {item!r} is no conv layer's way; give {allowed}")
            ways[int(index)] = way
        return cls(parts[0], parts[1], ways, chosen_by="given")

    def describe(self) -> str:
        """One line: the choice, and how it was made (measured: the times it was chosen on)."""
        if self.layer_ms:
            layers = ", ".join(f"conv{i}: {r} ({self.layer_ms[i][r]:.1f} ms; "
                               + " ".join(f"{k} {v:.1f}" for k, v in self.layer_ms[i].items() if k != r) + ")"
                               for i, r in self.conv_ways.items() if r in self.layer_ms.get(i, {}))
        else:
            layers = ", ".join(f"conv{i}: {r}" for i, r in self.conv_ways.items())
        steps = ", ".join(f"{k} {v:.1f} ms" for k, v in self.step_ms.items())
        how = {"rule": f" by rule {RULE} ({self.made_for.get('kernel_isa') or 'no conv kernel'}, "
                       f"{self.made_for.get('threads')} thread(s))",
               "given": " (given back)"}.get(self.chosen_by, "")
        return (f"{self.mode}, {self.memory_format}" + (f" (steps: {steps})" if steps else "") + how
                + (f"; bk per layer: {layers}" if layers else "")
                + ("" if self.settled else "; not settled"))


def for_run(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device,
            guarded: bool = False) -> "Route | None":
    """The route a run of `cfg` takes, chosen while the run is planned: None unless
    --grad-sample-mode auto (a forced mode is its own route); --route's where given, else the
    rule's. guarded: only a clipper that can keep a sample whose gradient is not finite out of
    the sum (Clipper.guards_nonfinite: what secret draws need, an own-data client)."""
    return choose(cfg, num_classes, input_shape, device, guarded) if cfg.grad_sample_mode == AUTO else None


def choose(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device, guarded: bool = False) -> Route:
    """The route for a run of `cfg` (a resolved TrainConfig) on `device`: --route's (checked
    against the network, `given`), else the rule's. Either is kept in FEDSD_CACHE_DIR/routes/,
    for `fedsd bench routes` to list what runs on this machine took; nothing reads it back."""
    threads = cfg.threads or torch.get_num_threads()
    route = given(cfg, num_classes, input_shape, device) if getattr(cfg, "route", "") else \
        rule(cfg, num_classes, input_shape, device, guarded)
    from fedsd.files.results import write_json

    key = _key(dataclasses.replace(cfg, batch_size=measured_batch_size(cfg, num_classes, input_shape, device)),
               num_classes, input_shape, device, threads)
    try:
        write_json(_route_file(key), {"key": key, "route": route.to_dict(), "chosen_at": time.time()})
    except OSError:
        pass  # a read-only cache: the list is only for people
    return route


def _made_for(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> dict:
    """What a route was made for, recorded with it: the network and its input, the thread count
    and the instruction sets (torch's kernels' and the conv kernel's build)."""
    return dict(model=cfg.model, activation=cfg.activation, classes=num_classes, input=list(input_shape),
                device=device.type, threads=cfg.threads or torch.get_num_threads(),
                torch_isa=torch.backends.cpu.get_cpu_capability().lower(),
                kernel_isa=conv_kernel.isa() if device.type == "cpu" else None)


def _network(cfg, num_classes: int) -> nn.Module:
    """The run's network as the rule reads it (its weights do not matter: seed 0)."""
    return model_for(cfg, num_classes, seed=0)


def _captured(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device, layout: str,
              network: nn.Module | None = None):
    """Book-keeping's (layer, a, g) of each layer on two samples of the real shape in `layout`
    (the rule reads their shapes and layouts, not their values), or None where book-keeping
    cannot take the network (`network`: the run's, where the caller built it already)."""
    model = (network if network is not None else _network(cfg, num_classes)).to(device, memory_format=LAYOUTS[layout])
    try:
        clipper = BookKeepingEngine(model, cfg.clip)
    except ConfigError:
        return None
    x = torch.zeros(2, *input_shape, device=device).contiguous(memory_format=LAYOUTS[layout])
    y = torch.zeros(2, dtype=torch.long, device=device)
    return clipper.captured(nn.functional.cross_entropy(model(x), y))


def conv_way(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, kernel_isa: str | None,
             device: torch.device) -> str:
    """The rule's way for one conv layer (RULES): by its shapes and the kernel's instruction set
    (the thread count does not change it: see RULES)."""
    chosen = RULES["cuda" if device.type == "cuda" else kernel_isa if kernel_isa in RULES else None]
    T, p, d = g.shape[2] * g.shape[3], g.shape[1], layer.weight[0].numel()
    if T * T * (d + p) < chosen["ghost_below"] * T * d * p:
        return "ghost"
    return "kernel" if chosen["per_sample"] == "kernel" and conv_kernel.applies(layer, a, g) else "patches"


def rule(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device, guarded: bool = False) -> Route:
    """The route --grad-sample-mode auto takes, by a rule that reads no clock: book-keeping
    wherever it takes the network, in its auto layout (or the one --memory-format asks for),
    each conv layer's way by `conv_way`; else the first of FALLBACK_ORDER that trains it."""
    made_for = dict(_made_for(cfg, num_classes, input_shape, device), rule=RULE)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        layout = layout_for("bk", cfg.memory_format)
        network = _network(cfg, num_classes)
        if cfg.memory_format == AUTO and not convolutional(network):
            layout = "contiguous"  # channels-last is for convolutions; without one it only slowed GroupNorm (~4x)
        captured = _captured(cfg, num_classes, input_shape, device, layout, network)
        if captured is not None:
            ways = {i: conv_way(layer, a, g, made_for["kernel_isa"], device)
                    for i, (layer, a, g) in enumerate(captured) if isinstance(layer, nn.Conv2d)}
            return Route("bk", layout, ways, conv_kernel.isa(), chosen_by="rule", made_for=made_for)
        failed = {}
        for mode in FALLBACK_ORDER:
            if mode not in step_candidates() or (cfg.memory_format != AUTO
                                                 and mode not in _exact_in(cfg.memory_format)):
                continue
            if guarded and not CLIPPERS[mode].guards_nonfinite:
                continue
            try:  # whether this clipper can train the network at all: a deterministic failure, not a time
                x = torch.randn(4, *input_shape, generator=torch.Generator().manual_seed(0)).to(device)
                _step(mode, dataclasses.replace(cfg, batch_size=4), x, torch.arange(4, device=device) % num_classes,
                      num_classes, {})()
            except Exception as e:  # noqa: BLE001  (this clipper cannot take this network: the next one)
                failed[mode] = e
                continue
            return Route(mode, layout_for(mode, cfg.memory_format), {}, conv_kernel.isa(), chosen_by="rule",
                         made_for=made_for)
    raise ModelNotPrivateError(f"--model {cfg.model}: no per-sample clipping route can train it; "
                               + "; ".join(f"{mode}: {str(e).splitlines()[0][:200]}" for mode, e in failed.items()))


def given(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
    """--route's route, checked against this run before any work: a mode auto may take, a layout
    it is exact in (and --memory-format's where set), and for bk one way for each conv layer of
    the network, the kernel only where it is built and applies. ConfigError naming --route."""
    route = Route.from_spec(cfg.route)
    if cfg.grad_sample_mode != AUTO:
        raise ConfigError(f"--route: takes the place of --grad-sample-mode (here {cfg.grad_sample_mode}); leave that "
                          "auto")
    if cfg.memory_format not in (AUTO, route.memory_format):
        raise ConfigError(f"--route: runs in {route.memory_format}, and --memory-format asks for {cfg.memory_format}; "
                          "leave --memory-format auto")
    if route.memory_format == "channels-last" and route.mode not in CHANNELS_LAST_EXACT:
        raise ConfigError(f"--route: {route.mode} gives wrong per-sample gradients on channels-last; give "
                          f"contiguous, or a mode of {', '.join(CHANNELS_LAST_EXACT)}")
    made_for = _made_for(cfg, num_classes, input_shape, device)
    if route.mode == "bk":
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            captured = _captured(cfg, num_classes, input_shape, device, route.memory_format)
        if captured is None:
            raise ConfigError(f"--route: bk cannot take --model {cfg.model} (a layer book-keeping has no rule for)")
        convs = {i: (layer, a, g) for i, (layer, a, g) in enumerate(captured) if isinstance(layer, nn.Conv2d)}
        if set(route.conv_ways) != set(convs):
            raise ConfigError(f"--route: {cfg.route!r} names the conv layers {sorted(route.conv_ways)}; --model "
                              f"{cfg.model}'s are {sorted(convs)} (a route of another network?)")
        for i, way in route.conv_ways.items():
            if way == "kernel" and not conv_kernel.applies(*convs[i]):
                raise ConfigError(f"--route: conv layer {i} takes fedsd's conv kernel, which "
                                  + ("is not built here (a C compiler; FEDSD_CONV_KERNEL)"
                                     if not conv_kernel.available() else "does not take that layer here")
                                  + "; its weights cannot be repeated here")
    return dataclasses.replace(route, cpu_isa=conv_kernel.isa(), chosen_by="given", made_for=made_for)


def recorded(folder) -> tuple[Route, dict]:
    """The route a run in `folder` recorded (its result.json, else its checkpoint), and the
    settings it ran with; ConfigError naming --route-from where there is none."""
    from pathlib import Path

    folder = Path(folder)
    result, checkpoint = folder / "result.json", folder / "checkpoint.pt"
    try:
        if result.is_file():
            saved = json.loads(result.read_text())
        elif checkpoint.is_file():
            saved = torch.load(checkpoint, weights_only=True)
        else:
            raise ConfigError(f"--route-from: {folder} holds no run (no result.json, no checkpoint.pt)")
        route, config = saved.get("route"), saved.get("config")
        if not route:
            raise ConfigError(f"--route-from: the run in {folder} recorded no route (it forced --grad-sample-mode "
                              f"{(config or {}).get('grad_sample_mode')!s}, or was made before routes were recorded)")
        return Route.from_dict(route), dict(config or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"--route-from: cannot read the route recorded in {folder} "
                          f"({type(e).__name__}: {e})") from None


def route_from(folder, cfg) -> str:
    """--route-from FOLDER: the route the run there recorded, as --route takes it, for a run of
    `cfg` (resolved); refused, naming --route-from, where it was made for another network,
    activation, input or thread count (--route then checks each conv layer's way)."""
    from fedsd.models.networks import input_shape_of

    route, config = recorded(folder)
    theirs = {**{k: config.get(k) for k in ("model", "activation", "threads")}, **route.made_for}
    ours = dict(model=cfg.model, activation=cfg.activation, threads=cfg.threads or torch.get_num_threads(),
                input=list(input_shape_of(cfg)))
    for what, value in ours.items():
        if theirs.get(what) not in (None, 0) and theirs[what] != value:
            raise ConfigError(f"--route-from: the route in {folder} was made for {what} {theirs[what]}, this run's is "
                              f"{value}" + (f" (give --threads {theirs[what]})" if what == "threads" else ""))
    return route.spec()


def _route_file(key: dict):
    """Where the route measured for `key` (_key) is kept."""
    folder = cache_root() / "routes"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"


def cached() -> list[tuple[dict, Route]]:
    """Every route kept on this machine: (what it was chosen or measured for, the route)."""
    found = []
    for path in sorted((cache_root() / "routes").glob("*.json")):
        try:
            saved = json.loads(path.read_text())
            found.append((saved["key"], Route.from_dict(saved["route"])))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def forget_all() -> int:
    """Forget every kept route (the list `fedsd bench routes` shows); how many there were. No run
    reads them: a run's route is its --route's or the rule's."""
    paths = list((cache_root() / "routes").glob("*.json"))
    for path in paths:
        path.unlink(missing_ok=True)
    return len(paths)


def _key(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device, threads: int) -> dict:
    """What a kept route was chosen for (`fedsd bench routes` lists them by it): the work (model,
    activation, classes, input, batch size, layout), where it runs (device, CPU, threads) and the
    code that does it (torch, the kernel's source and build)."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else conv_kernel._cpu_id()
    kernel = hashlib.sha256(conv_kernel.SOURCE.encode()).hexdigest()[:16] if conv_kernel.available() else None
    return dict(model=cfg.model, activation=cfg.activation, classes=num_classes, input=list(input_shape),
                batch_size=cfg.batch_size, memory_format=cfg.memory_format, device=device.type, where=where,
                threads=threads, torch=torch.__version__, kernel=kernel,
                kernel_march=os.environ.get(conv_kernel.MARCH_ENV, "native"), cc=os.environ.get("CC", ""),
                format=FORMAT_VERSION,
                # Named only where the network is traced (Opacus' hook modes run on the traced
                # network): every key of a network that is not traced is what it was.
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
    do): per conv layer, book-keeping's three ways on the layer's real (a, g); then whole DP steps
    of every clipper auto may take (bk with the fastest way per layer), interleaved, so that a
    load on the machine falls on all of them alike. For `fedsd bench routes --measure` only (how
    RULES is calibrated): no run takes a measured route. A candidate that fails is left out.
    The caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _measure(cfg, num_classes, input_shape, device)


def _measure(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> Route:
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
                 step_ms, layer_ms, spread, settled, "measured",
                 _made_for(cfg, num_classes, input_shape, device))


def _exact_in(memory_format: str) -> tuple[str, ...]:
    from fedsd.clipping import CHANNELS_LAST_EXACT

    return CHANNELS_LAST_EXACT if memory_format == "channels-last" else tuple(CLIPPERS)


def _measure_conv_ways(cfg, x, y, num_classes: int, device) -> tuple[dict[int, str], dict[int, dict[str, float]]]:
    """Each conv layer's fastest way to its norms and clipped sum, on its real input and output gradient."""
    from fedsd.models.networks import model_for

    timed = timer(device)
    layout = LAYOUTS[layout_for("bk", cfg.memory_format)]
    model = model_for(cfg, num_classes).to(device, memory_format=layout)
    try:
        clipper = BookKeepingEngine(model, cfg.clip)
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
            if w == "kernel":  # as a step takes it: the one pass (conv_kernel.clipped_sums), this layer alone
                conv_kernel.clipped_sums([(layer, a, g)], norms2, len(y), cfg.clip)
                return
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
    from fedsd.models.networks import model_for

    run = dataclasses.replace(cfg, grad_sample_mode=mode, memory_format=layout_for(mode, cfg.memory_format))
    layout = LAYOUTS[run.memory_format]
    model = model_for(cfg, num_classes).to(x.device, memory_format=layout)
    clipper = CLIPPERS[mode](model, run, mode)
    clipper.take(Route(mode, run.memory_format, dict(conv_ways)))
    trained = [p for p in model.parameters() if p.requires_grad]  # frozen blocks (--train-layers): no step
    optimizer = clipper.make_optimizer(torch.optim.SGD(trained, lr=cfg.lr, momentum=cfg.momentum),
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
