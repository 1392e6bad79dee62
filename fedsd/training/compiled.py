"""Compiled forward passes that change no bit of a run: the self-distillation teacher's, and
the student's runs of weightless layers (activations, average pooling) between its Conv2d and
Linear layers.

Why: `torch.compile` (inductor) fuses what eager PyTorch runs op by op, each op a pass over a
batch's activations (cifar-cnn at B = 1000: 131 MB after its first conv). The non-private step
gains from it and the DP step did not, because book-keeping needs each Conv2d/Linear layer's
input and output gradient, which a whole compiled graph hides (results/perf.md). The teacher's
forward needs no gradient, and the layers between the weighted ones keep none, so those parts
compile and the book-keeping hooks stay where they are: cifar-cnn's DP step went from 1.12–1.17
to 0.97–1.02 times the compiled non-private step on an AVX-512 CPU, mnist-cnn's from 1.15–1.17
to 1.05–1.11 times the eager one (results/perf.md).

Four rules:
  - Nothing compiled is used unless it is bitwise the eager computation: its first call also
    runs eager on the same input (and, where a gradient flows, the same output gradient), and
    any difference in a value or a layout, or any error, keeps the eager code for the rest of the
    run, said once on stderr. The weights a run releases are the same either way.
  - Max pooling's backward stays eager: inductor's was twice as slow as eager here (mnist-cnn:
    107 against 50 ms a step), and crashed under the avx2 emulation. The teacher's
    forward, which has no backward, compiles with it; only models made of the layers below
    (the papers' CNNs and their like) compile at all: others (normalisation layers, torchvision's
    networks) would compile in other roundings and be left out, for nothing.
  - Never on an owner's data under secret draws (a deployment's service): nothing of what it does
    may depend on its data, a compiled part's check included, and a shared cache folder is
    another user's way into its process.
  - On CPU only (not measured on a GPU), and after COMPILE_AFTER calls: compiling costs 1–11 s,
    which a short run (a test, a client's few local steps) would never earn back.
FEDSD_COMPILE=0 keeps everything eager.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Callable

import torch
from torch import nn

# Calls before a forward is compiled: 1–11 s of compiling against 4–25 ms saved a step.
COMPILE_AFTER = 50
# Weightless layers whose compiled forward and backward were measured faster than eager here.
FUSED_LAYERS = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
                nn.Flatten, nn.Identity)
# What a teacher may be made of to compile (its forward alone: max pooling too).
TEACHER_LAYERS = (nn.Conv2d, nn.Linear, nn.MaxPool2d, *FUSED_LAYERS)


def teacher_forward(teacher: nn.Module, after: int = COMPILE_AFTER) -> "CompiledForward | nn.Module":
    """The teacher's forward, compiled (CompiledForward) where it is a plain nn.Sequential of
    TEACHER_LAYERS; else the teacher itself, eager."""
    if not _plain_sequential(teacher) or not all(isinstance(m, TEACHER_LAYERS) for m in teacher):
        return teacher
    return CompiledForward(teacher, "teacher's forward", after)


def _plain_sequential(model: nn.Module) -> bool:
    """Whether `model` is an nn.Sequential whose forward is Sequential's: its layers, in order."""
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


OPT_OUT_ENV = "FEDSD_COMPILE"


class CompiledForward:
    """`fn` called eagerly for its first `after` calls, then compiled (the batch dimension dynamic:
    one graph for every Poisson batch), where it gives eager's bits: checked on the first call of
    each kind of input (whether it needs a gradient, grad mode, dtype, layout), each of which
    dynamo compiles a graph of its own for."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], name: str, after: int = COMPILE_AFTER,
                 gradient: bool = False):
        self.fn, self.name, self.after, self.gradient = fn, name, after, gradient
        self.calls = 0
        self.compiled: Callable | None = None
        self.checked: set[tuple] = set()
        self.left_out: str | None = None if os.environ.get(OPT_OUT_ENV, "1") != "0" else f"{OPT_OUT_ENV}=0"

    @property
    def state(self) -> str:
        """compiled, eager (not yet), or why it was left out."""
        return "compiled" if self.compiled else f"left out: {self.left_out}" if self.left_out else "eager"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.left_out or self.calls <= self.after or x.device.type != "cpu" or x.shape[0] < 2:
            return self.fn(x)
        kind = (x.requires_grad, torch.is_grad_enabled(), x.dtype, _layout_of(x))
        if kind not in self.checked:
            return self._check(x, kind)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        return self.compiled(x)

    def _check(self, x: torch.Tensor, kind: tuple) -> torch.Tensor:
        compiled = self.compiled or torch.compile(_own_code(self.fn))
        torch._dynamo.maybe_mark_dynamic(x, 0)
        try:
            self.left_out = differs(self.fn, compiled, x, self.gradient)
        except Exception as error:  # noqa: BLE001 -- whatever fails in the compiled code, eager goes on
            self.left_out = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        if self.left_out:
            self.compiled = None
            print(f"fedsd: the compiled {self.name} is left out (eager from now on): {self.left_out}",
                  file=sys.stderr, flush=True)
            return self.fn(x)
        self.compiled = compiled
        self.checked.add(kind)
        return compiled(x)


def _call(x):
    return fn(x)  # noqa: F821 -- `fn` is each copy's own global (_own_code)


def _own_code(fn: Callable) -> Callable:
    """A function that calls `fn`, with a code object of its own. Dynamo keeps its graphs, and
    counts recompilations (8 at most, then it runs the code eagerly, silently), per code object,
    and every compiled module shares nn.Module's: the five parts of cifar-cnn's step and the
    benchmark's compiled non-private step overran the 8 (`fedsd bench step`, its stderr)."""
    _own_code.made += 1
    code = _call.__code__.replace(co_name=f"compiled_part_{_own_code.made}")
    return types.FunctionType(code, {"fn": fn, "__builtins__": __builtins__}, code.co_name)


_own_code.made = 0


def differs(eager: Callable, compiled: Callable, x: torch.Tensor, gradient: bool) -> str | None:
    """Why `compiled` is not bitwise `eager` on x (its output; with `gradient`, also x's gradient
    for one output gradient), or None."""
    probe = x.detach().requires_grad_(x.requires_grad)  # the graph checked is the one the call will use
    torch._dynamo.maybe_mark_dynamic(probe, 0)  # compiled as every later batch will come: any size
    e, c = eager(probe), compiled(probe)
    if (why := _not_same("output", e, c)) or not (gradient and e.requires_grad and c.requires_grad):
        return why
    g = torch.randn(e.shape, generator=torch.Generator().manual_seed(0), dtype=e.dtype).to(e.device)
    g = g.contiguous(memory_format=_layout_of(e))
    (ge,), (gc,) = torch.autograd.grad(e, probe, g), torch.autograd.grad(c, probe, g)
    return _not_same("input gradient", ge, gc)


def _not_same(what: str, e: torch.Tensor, c: torch.Tensor) -> str | None:
    if e.shape != c.shape or e.dtype != c.dtype:
        return f"its {what} has shape {tuple(c.shape)} {c.dtype}, eager's {tuple(e.shape)} {e.dtype}"
    if e.stride() != c.stride():
        return f"its {what} has strides {c.stride()}, eager's {e.stride()}"
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[e.element_size()]
    if not torch.equal(e.detach().view(bits), c.detach().view(bits)):  # bit for bit: -0.0 is not 0.0, NaN is NaN
        return f"its {what} differs from eager's"  # by how much is the data's to say, not a log's
    return None


def _layout_of(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) \
        and not t.is_contiguous() else torch.contiguous_format


def student_forward(model: nn.Module, after: int = COMPILE_AFTER) -> tuple[Callable, list[CompiledForward]]:
    """The student's forward with each run of FUSED_LAYERS between its weighted layers compiled
    (CompiledForward), and those runs; the model itself where it is not a plain nn.Sequential (its
    forward is Sequential's) or has no such run. The weighted layers are called as modules, so
    their hooks (book-keeping's) run as before; a model with hooks of its own is called whole, eager."""
    if not _plain_sequential(model):
        return model, []
    parts: list[Callable] = []
    runs: list[CompiledForward] = []
    run: list[tuple[str, nn.Module]] = []

    def close_run() -> None:  # one activation alone gains nothing: only runs of two or more are fused
        if sum(not isinstance(m, (nn.Flatten, nn.Identity)) for _, m in run) > 1:
            names = f"{run[0][0]}–{run[-1][0]} ({' → '.join(type(m).__name__ for _, m in run)})"
            runs.append(CompiledForward(nn.Sequential(*(m for _, m in run)), f"layers {names}", after, gradient=True))
            parts.append(runs[-1])
        else:
            parts.extend(m for _, m in run)
        run.clear()

    for name, layer in model.named_children():
        if isinstance(layer, FUSED_LAYERS) and not any(True for _ in layer.parameters()):
            run.append((name, layer))
            continue
        close_run()
        parts.append(layer)
    close_run()
    if not runs:
        return model, []

    def forward(x: torch.Tensor) -> torch.Tensor:
        if model._forward_hooks or model._forward_pre_hooks:  # someone watches the model (fedsd bench step --layers)
            return model(x)
        for part in parts:
            x = part(x)
        return x
    return forward, runs
