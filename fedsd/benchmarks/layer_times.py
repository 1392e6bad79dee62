"""`fedsd bench step --layers`: where the default route's DP step spends its time, layer by layer,
beside the non-private step's.

For each trainable layer (Conv2d, Linear), in ms, the median over the timed steps of:
  - its forward: from its forward pre-hook to its forward hook;
  - its backward: from its output's gradient arriving to the last of its input's gradient and
    its parameters' accumulated gradients. Book-keeping computes no weight gradient in autograd,
    so there a layer whose input needs no gradient (the first) has no backward at all;
  - in the DP step, book-keeping's per-sample norms and its part of the clipped sum
    (fedsd.clipping.bookkeeping.BookKeepingEngine.observer). The conv layers that take the
    kernel make both in one pass (fedsd.clipping.conv_kernel.clipped_sums), one row of its own.
Between the layers (activations, pooling, flattening): the model's whole forward (hooks on the
model itself) and its backward span (the first layer gradient's arrival to the last event)
less the layers' own. The rest of the whole step is the loss, the teacher's forward, the clip
factors, the noise and the update. The hooks read the clock and return nothing: a step computes the
same bits with them as without (tests/benchmarks/test_bench_layers.py).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial

import torch
from torch import nn

from fedsd.clipping.routes import timer

DP_PARTS = ("forward", "backward", "norms", "clip-sum")
NONPRIVATE_PARTS = ("forward", "backward")
BETWEEN = "(between layers)"  # step_done()'s key for what runs between the layers
# step_done()'s key for the kernel's conv layers' one pass: their per-sample norms and clipped
# sums at once (fedsd.clipping.conv_kernel.clipped_sums), which cannot be told apart.
TOGETHER = "(kernel layers together)"


def trainable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's Conv2d and Linear layers with a trainable weight, by their names in the model."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
            and any(p.requires_grad for p in m.parameters(recurse=False))}


class LayerClock:
    """Each trainable layer's seconds in one step, by part, from hooks on the model; `watch` is
    a book-keeping engine's observer. `step_done()` hands the step's times over and starts afresh."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.layers = trainable_layers(model)
        self._names = {m: name for name, m in self.layers.items()}
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._seconds: dict[tuple[str, str], float] = {}
        self._started: dict[nn.Module, float] = {}
        self._ended: dict[nn.Module, float] = {}
        self._model_started = 0.0
        self.handles = [model.register_forward_pre_hook(self._model_starts),
                        model.register_forward_hook(self._model_ends)]
        for m in self.layers.values():
            self.handles += [m.register_forward_pre_hook(self._forward_starts),
                             m.register_forward_hook(self._forward_ends)]
            self.handles += [p.register_post_accumulate_grad_hook(partial(self._backward_ends, m))
                             for p in m.parameters(recurse=False) if p.requires_grad]

    def _now(self) -> float:
        self._sync()
        return time.perf_counter()

    def _add(self, module: nn.Module | tuple, part: str, seconds: float) -> None:
        key = (TOGETHER if isinstance(module, tuple) else self._names[module], part)
        self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def _model_starts(self, module, args) -> None:
        self._model_started = self._now()

    def _model_ends(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self._seconds[(BETWEEN, "forward")] = self._now() - self._model_started

    def _forward_starts(self, module, args) -> None:
        if torch.is_grad_enabled():  # a training forward, not an evaluation
            self._started[module] = self._now()

    def _forward_ends(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        self._add(module, "forward", self._now() - self._started.pop(module))
        output.register_hook(partial(self._backward_starts, module))
        if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(partial(self._backward_ends, module))

    def _backward_starts(self, module, grad) -> None:
        self._started[module] = self._now()

    def _backward_ends(self, module, *_) -> None:
        self._ended[module] = self._now()

    @contextlib.contextmanager
    def watch(self, layer: nn.Module, part: str):
        """Times `part` of `layer` (BookKeepingEngine.observer)."""
        start = self._now()
        yield
        self._add(layer, part, self._now() - start)

    def step_done(self) -> dict[str, dict[str, float]]:
        """This step's seconds: layer name (and BETWEEN) → part → seconds (0 where the part did not run)."""
        for module, start in self._started.items():
            self._add(module, "backward", max(0.0, self._ended.get(module, start) - start))
        events = [*self._started.values(), *self._ended.values()]
        span = max(events) - min(self._started.values()) if self._started else 0.0
        times = {name: {part: self._seconds.get((name, part), 0.0) for part in DP_PARTS} for name in self.layers}
        times[BETWEEN] = {part: 0.0 for part in DP_PARTS}
        times[TOGETHER] = {part: self._seconds.get((TOGETHER, part), 0.0) for part in DP_PARTS}
        times[BETWEEN]["forward"] = max(0.0, self._seconds.get((BETWEEN, "forward"), 0.0)
                                        - sum(t["forward"] for t in times.values()))
        times[BETWEEN]["backward"] = max(0.0, span - sum(t["backward"] for t in times.values()))
        self._seconds, self._started, self._ended = {}, {}, {}
        return times

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def interleaved(steps: dict, clocks: dict, device: torch.device, warmup: int, repeats: int) -> dict:
    """Each step ("dp", "nonprivate") once a round, `warmup` rounds left out: its whole step's and
    each layer's parts' median seconds."""
    timed = timer(device)
    seen = {name: [] for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            seconds = timed(step)
            parts = clocks[name].step_done()
            if i >= warmup:
                seen[name].append((seconds, parts))
    return {name: dict(step=statistics.median(s for s, _ in runs),
                       layers={layer: {part: statistics.median(p[layer][part] for _, p in runs) for part in DP_PARTS}
                               for layer in runs[0][1]})
            for name, runs in seen.items()}


def describe(layer: nn.Module) -> str:
    """A layer in a few characters: Conv2d 1→16 k8 s2, Linear 512→32."""
    if isinstance(layer, nn.Conv2d):
        stride = f" s{layer.stride[0]}" if layer.stride[0] != 1 else ""
        return f"Conv2d {layer.in_channels}→{layer.out_channels} k{layer.kernel_size[0]}{stride}"
    return f"Linear {layer.in_features}→{layer.out_features}"


def rows(measured: dict, layers: dict[str, nn.Module], ways: dict[str, str]) -> dict:
    """The report's per-layer rows (ms) and each step's whole and rest (what no layer's part holds)."""
    ms = lambda seconds: round(seconds * 1000, 3)  # noqa: E731
    dp, nonprivate = measured["dp"], measured["nonprivate"]
    found = [dict(name=name, layer=describe(layer), way=ways.get(name, "linear"),
                  dp_ms={part: ms(dp["layers"][name][part]) for part in DP_PARTS},
                  nonprivate_ms={part: ms(nonprivate["layers"][name][part]) for part in NONPRIVATE_PARTS})
             for name, layer in layers.items()]
    between = dict(dp_ms={part: ms(dp["layers"][BETWEEN][part]) for part in NONPRIVATE_PARTS},
                   nonprivate_ms={part: ms(nonprivate["layers"][BETWEEN][part]) for part in NONPRIVATE_PARTS})
    together = dict(layers=[name for name in layers if ways.get(name) == "kernel"],
                    dp_ms=ms(dp["layers"][TOGETHER]["norms"]))
    return dict(layers=found, kernel_layers_together=together, between_layers=between, dp_step_ms=ms(dp["step"]),
                nonprivate_step_ms=ms(nonprivate["step"]),
                dp_layers_ms=round(sum(sum(r["dp_ms"].values()) for r in found) + together["dp_ms"], 3),
                nonprivate_layers_ms=round(sum(sum(r["nonprivate_ms"].values()) for r in found), 3))


def lines(report: dict) -> list[str]:
    """The per-layer table a reader reads."""
    head = (f"{report['model']} B={report['batch_size']} {report['method']} on {report['device']}, "
            f"{report['threads']} threads, median of {report['repeats']} (ms): DP step ({report['route']}, "
            f"{report['memory_format']}) {report['dp_step_ms']:.1f}, non-private ({report['nonprivate']}) "
            f"{report['nonprivate_step_ms']:.1f}")
    out = [head, f"{'layer':<28}{'way':<9}| DP: {'forward':>8}{'backward':>9}{'norms':>8}{'clip-sum':>9}{'sum':>8} "
                 f"| non-private: {'forward':>8}{'backward':>9}{'sum':>8}"]
    for r in report["layers"]:
        d, n = r["dp_ms"], r["nonprivate_ms"]
        out.append(f"{r['name'] + ' ' + r['layer']:<28}{r['way']:<9}|     "
                   + "".join(f"{d[p]:{w}.1f}" for p, w in zip(DP_PARTS, (8, 9, 8, 9)))
                   + f"{sum(d.values()):8.1f} |              {n['forward']:8.1f}{n['backward']:9.1f}"
                   f"{sum(n.values()):8.1f}")
    together = report["kernel_layers_together"]
    if together["layers"]:
        out.append(f"{'kernel layers ' + ', '.join(together['layers']) + ': norms and clip-sum in one pass':<60}"
                   f"{together['dp_ms']:17.1f} |")
    d, n = report["between_layers"]["dp_ms"], report["between_layers"]["nonprivate_ms"]
    out.append(f"{'between layers (activations, pooling)':<37}|     {d['forward']:8.1f}{d['backward']:9.1f}{'':>17}"
               f"{sum(d.values()):8.1f} |              {n['forward']:8.1f}{n['backward']:9.1f}{sum(n.values()):8.1f}")
    dp_rest = report["dp_step_ms"] - report["dp_layers_ms"] - sum(d.values())
    np_rest = report["nonprivate_step_ms"] - report["nonprivate_layers_ms"] - sum(n.values())
    out.append(f"{'rest (loss, teacher, clip factors, noise, update)':<77}{dp_rest:8.1f} |{'':>31}{np_rest:8.1f}")
    out.append(f"{'whole step':<77}{report['dp_step_ms']:8.1f} |{'':>31}{report['nonprivate_step_ms']:8.1f}")
    return out
