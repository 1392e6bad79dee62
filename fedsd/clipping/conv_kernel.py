"""A CPU kernel for the per-sample weight gradients of a Conv2d on channels-last tensors, the
work book-keeping clipping (fedsd.clipping.bookkeeping) adds to a step.

Sample i's gradient is ∇_i = G_iᵀA_i: its output gradient G_i (T positions × p channels) times
its im2col patches A_i (T × d). In PyTorch that is a patch copy and a batched product of small
matrices; this kernel reads each patch where it lies in the (padded) input and keeps a block of
∇_i in vector registers while it sums over the positions, so the patches are never written.
What it gains, layer by layer and on AVX-512, AVX2 and SSE, is measured in results/perf.md.

The C is `conv_kernel.c` beside this module (package data, and in the Flower app bundle),
compiled once per machine with the system's C compiler (`cc`, GCC vector extensions, so it
builds on any CPU the compiler targets) and loaded with ctypes, its functions typed by
SIGNATURES; the build is cached under FEDSD_CACHE_DIR (default ~/.cache/fedsd), keyed by the
source, the compiler and the CPU. Where no compiler is found, or FEDSD_CONV_KERNEL=0, bk uses
the PyTorch route, which gives the same gradients to float rounding (tests/clipping/test_conv_kernel.py).

Each sample's gradient is computed by one thread alone, so the result does not depend on the
number of threads. The threads are torch's own: built with -fopenmp, the library shares the
libgomp torch has loaded (the same soname), and its parts run on the calling thread's OpenMP
team (on a pool of other threads the pass lost a core to torch's spinning workers). Without
OpenMP the parts run on a pool of Python threads.

Book-keeping's step calls `clipped_sums`, not `per_sample_grads`: one pass over the samples
makes each sample's gradients of every such layer, its norm, its clipping factor, and adds the
clipped gradients into a block's partial sum while they are still in cache, instead of writing
the per-sample gradients out and reading them back. The pass waits on memory (the samples'
inputs and output gradients, read in strides the hardware's prefetcher does not follow), so the
next sample's lines are fetched a few at a time as each row of positions starts; a block whose
rows lie side by side in the input reads each run of them through one pointer; and its first
block sums the bias's gradient from the output gradients it loads anyway.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from torch import nn

from fedsd.files.cache import cache_root

KERNEL_C = "conv_kernel.c"


def _read_source() -> str:
    """conv_kernel.c: package data beside this module; or, where this module is a Flower app
    bundle's copy, the installed fedsd's. A bundle carries only .py, .toml, .md, .yaml and .json
    files (Flower's FAB_INCLUDE_PATTERNS, which fab-include cannot widen), and a ClientApp imports
    the bundle's fedsd before the environment's. An editable install is found through PEP 610's
    direct_url.json. "" where none has it: no kernel, the PyTorch route."""
    beside = resources.files(__package__).joinpath(KERNEL_C)
    if beside.is_file():
        return beside.read_text()
    try:
        dist = metadata.distribution("fedsd")
    except metadata.PackageNotFoundError:
        return ""
    found = [Path(dist.locate_file(f"fedsd/clipping/{KERNEL_C}"))]
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url.startswith("file://"):
        found.append(Path(unquote(urlparse(url).path)) / "fedsd" / "clipping" / KERNEL_C)
    return next((path.read_text() for path in found if path.is_file()), "")


SOURCE = _read_source()  # read once
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SHAPE = [_I] * 14 + [_P] * 2  # H, W, C, KH, KW, sh, sw, ph, pw, dh, dw, TH, TW, P; pad, off
# Each function conv_kernel.c exports: (its return type, its arguments' types), as the C declares
# them (a pointer of any kind is a c_void_p); tests/clipping/test_conv_kernel.py reads the C's prototypes
# and compares them with this table.
SIGNATURES = {
    "per_sample_conv_grads": (None, [_P] * 4 + [_I64, _I, _I] + _SHAPE),
    "per_sample_conv_grads_team": (None, [_P] * 4 + [_I64, _I] + _SHAPE),
    "clipped_conv_sums": (None, [_P, _I] + [_P] * 3 + [_I64] * 2 + [_I] * 2 + [_F] * 2 + [_I] + [_P] * 2),
    "clipped_conv_sums_team": (None, [_P, _I] + [_P] * 3 + [_I64] * 2 + [_I] + [_F] * 2 + [_I] + [_P] * 2),
    "block_sum": (None, [_P, _I64, _I64, _P, _I, _I]),
    "block_sum_team": (None, [_P, _I64, _I64, _P, _I]),
    "layer_runs": (_I, [_P]),
    "vector_floats": (_I, []),
    "openmp": (_I, []),
}
# Rows of `off` past D that a block may read: more than any block's DB.
OFF_PADDING = 64
ENABLED_ENV = "FEDSD_CONV_KERNEL"  # 0: always the PyTorch route
# The instruction set the kernel is built for: native (this CPU, the default), or a named target
# such as x86-64-v3 (AVX2, what most laptops and cloud VMs have) to measure another machine's
# code on this one (results/perf.md).
MARCH_ENV = "FEDSD_CONV_KERNEL_MARCH"
ISA_BY_VECTOR = {16: "avx512", 8: "avx2", 4: "sse"}


def _cpu_id() -> str:
    """What the build's -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _compile(cc: list[str], flags: list[str], target: Path, fallback: bool, openmp: bool) -> None:
    """Build into a private temporary file and rename it into place, so that processes that
    build at once (Ray workers) never load a half-written library. `openmp`: with -fopenmp
    where the compiler has it (the parts run on torch's OpenMP threads), else without (they
    run on a pool of Python's). `fallback`: without the -march flag where the compiler has none
    (not x86)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kernel.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        attempts = [flags, flags[1:]] if fallback else [flags]
        for arch in [["-fopenmp", *a] for a in attempts if openmp] + attempts:
            done = subprocess.run([*cc, "-O3", *arch, "-fno-math-errno", "-shared", "-fPIC", str(src), "-o", str(lib),
                                   "-lm"], capture_output=True)
            if done.returncode == 0:
                os.replace(lib, target)
                return
    raise OSError(f"{shlex.join(cc)} could not build the conv kernel: {done.stderr.decode(errors='replace')[-500:]}")


def check_loadable(path: Path) -> None:
    """Refuse (OSError) to load a cached library another user could have written: the file a
    regular one (not a link) owned by this user or root, and neither it nor any folder above it
    writable by another user (a sticky folder owned by root or this user excepted). Loading it
    runs its code as this user, the data owner's included."""
    me = os.geteuid()
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, me) or st.st_mode & 0o022:
        raise OSError(f"{path}: not loaded, as another user could have written it (owner uid {st.st_uid}, mode "
                      f"{stat.S_IMODE(st.st_mode):o}); delete it to rebuild")
    for folder in Path(os.path.realpath(path)).parents:
        st = os.stat(folder)
        if st.st_uid not in (0, me) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise OSError(f"{path}: not loaded, as {folder} can be written by another user (owner uid "
                          f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")


@dataclass(frozen=True)
class Kernel:
    fn: object  # per_sample_conv_grads (one part), through ctypes
    sums: object  # clipped_conv_sums (one part), through ctypes
    fn_team: object  # per_sample_conv_grads_team (every part, on the OpenMP team)
    sums_team: object  # clipped_conv_sums_team
    block_sum: object  # block_sum (one part of the columns)
    block_sum_team: object  # block_sum_team
    layer_runs: object  # layer_runs: which blocks of a layer_t are read as runs (tests)
    openmp: bool  # built with OpenMP: the _team functions run the parts at once
    march: str
    isa: str  # avx512, avx2, sse: the vector width it was built for


def compiled(march: str = "native", defines: tuple[str, ...] = (), load: bool = True,
             openmp: bool = True, flags: tuple[str, ...] = ()) -> Kernel | Path:
    """The kernel built for `march` (-D `defines` for measurement), cached under
    FEDSD_CACHE_DIR/kernels by source, compiler, target, OpenMP and CPU; loaded, or with
    load=False only its path (a target this CPU cannot run can still be built). openmp=False:
    built without it (its parts on Python's threads, as where the compiler has no OpenMP).
    `flags`: more of the compiler's (the sanitizers' build, tests/clipping/test_conv_kernel.py).
    Raises OSError when it cannot be built."""
    if not SOURCE:
        raise OSError(f"{KERNEL_C} is neither beside {__file__} nor in the installed fedsd")
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        raise OSError("no C compiler found (cc, gcc, clang or $CC)")
    cc = shlex.split(found)  # $CC may carry flags ("gcc -m64")
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    flags = [f"-march={march}", *(f"-D{d}" for d in defines), *flags]
    key = hashlib.sha256("\0".join([SOURCE, found, version, _cpu_id(), *flags, f"openmp={openmp}"]).encode())
    key = key.hexdigest()[:16]
    path = cache_root() / "kernels" / f"per_sample_conv-{key}.so"
    if not path.exists():
        _compile(cc, flags, path, fallback=march == "native", openmp=openmp)
    if not load:
        return path
    check_loadable(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        if not openmp:
            raise
        # The OpenMP build needs what the libgomp already loaded (torch's) may lack: built without.
        return compiled(march, defines, load, openmp=False)
    for name, (restype, argtypes) in SIGNATURES.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, argtypes
    return Kernel(lib.per_sample_conv_grads, lib.clipped_conv_sums, lib.per_sample_conv_grads_team,
                  lib.clipped_conv_sums_team, lib.block_sum, lib.block_sum_team, lib.layer_runs, bool(lib.openmp()),
                  march,
                  ISA_BY_VECTOR.get(lib.vector_floats(), f"{lib.vector_floats()}-float vectors"))


@functools.lru_cache(maxsize=1)
def _library() -> Kernel | None:
    """The loaded kernel for FEDSD_CONV_KERNEL_MARCH (default native), or None (no compiler, a
    failed build, or FEDSD_CONV_KERNEL=0)."""
    if os.environ.get(ENABLED_ENV, "1") == "0":
        return None
    try:
        return compiled(os.environ.get(MARCH_ENV, "native"))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"the per-sample conv kernel was not built ({e}): --grad-sample-mode bk takes PyTorch's "
                      "slower route (same results)", RuntimeWarning, stacklevel=2)
        return None


def available() -> bool:
    return _library() is not None


def isa() -> str | None:
    """The instruction set the loaded kernel was built for (avx512, avx2, …), None without one."""
    kernel = _library()
    return kernel.isa if kernel else None


def applies(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the kernel takes this layer: float32 CPU tensors in channels-last, p a multiple
    of 16, and the kernel built."""
    return (a.device.type == "cpu" and a.dtype == g.dtype == torch.float32 and g.shape[1] % 16 == 0
            and layer.groups == 1 and a.is_contiguous(memory_format=torch.channels_last)
            and g.is_contiguous(memory_format=torch.channels_last) and available())


_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (process id, workers, pool)
_pool_lock = threading.Lock()


def _run_split(calls: list) -> None:
    """Run the calls at once on as many threads (ctypes lets go of the GIL during each). A
    forked child gets a pool of its own: the parent's threads do not survive a fork."""
    global _pool
    if not calls:  # no samples
        return
    if len(calls) == 1:
        calls[0]()
        return
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < len(calls):
            _pool = (os.getpid(), len(calls), ThreadPoolExecutor(len(calls), thread_name_prefix="fedsd-conv-kernel"))
        pool = _pool[2]
    for future in [pool.submit(call) for call in calls]:
        future.result()


def _run_parts(kernel: Kernel, name: str, head: tuple, tail: tuple, parts: int) -> None:
    """Run the kernel's function `name` ("fn", "sums" or "block_sum") on every part, its arguments `head`,
    the part (with a one-part function) and the number of parts, then `tail`: all parts in one
    call on torch's OpenMP threads where the kernel has OpenMP, else each part on a thread of
    _run_split's pool."""
    if kernel.openmp:
        getattr(kernel, name + "_team")(*head, parts, *tail)
    else:
        _run_split([functools.partial(getattr(kernel, name), *head, part, parts, *tail) for part in range(parts)])


def check_shapes(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse (ValueError) a layer input and output gradient the kernel would read past: the
    kernel takes raw pointers, and reads each patch where the layer's geometry says it lies, so
    every shape must be the one that geometry gives (a Conv2d subclass with a forward of its own
    could give another)."""
    n, c, h, w = a.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    if (min(kh, kw, sh, sw, dh, dw, c) < 1 or min(ph, pw) < 0 or layer.groups != 1 or layer.padding_mode != "zeros"
            or tuple(layer.weight.shape) != (layer.out_channels, c, kh, kw)
            or max(h + 2 * ph, w + 2 * pw, kh * kw * c * layer.out_channels, (h + 2 * ph) * (w + 2 * pw) * c) >= 2**31):
        raise ValueError(f"conv kernel: the layer {layer} (weight {tuple(layer.weight.shape)}) is not one it takes")
    th, tw = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    expected = (n, layer.out_channels, th, tw)
    if c != layer.in_channels or tuple(g.shape) != expected or th < 1 or tw < 1:
        raise ValueError(f"conv kernel: input {tuple(a.shape)} and output gradient {tuple(g.shape)} do not fit the "
                         f"layer {layer} (its output would be {expected})")
    if layer.out_channels % 16:  # whole vectors of output channels: the kernel leaves a remainder unwritten
        raise ValueError(f"conv kernel: {layer.out_channels} output channels (a multiple of 16)")
    for t in (a, g):
        if not (t.dtype == torch.float32 and t.device.type == "cpu"
                and t.is_contiguous(memory_format=torch.channels_last)):
            raise ValueError("conv kernel: float32 CPU tensors in channels-last only")


def per_sample_grads(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor,
                     kernel: Kernel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, kh·kw·c, p): each sample's weight gradient GᵢᵀAᵢ, transposed (d before p), and (n)
    their squared norms, summed as they are made rather than read back (for mnist-cnn conv2 at
    B = 1600 that is 52 MB), for a layer `applies` accepts; a is the layer's input, g its output
    gradient, both (n, c, h, w). `kernel`: another build than this process's (tests, measurement)."""
    check_shapes(layer, a, g)
    kernel = kernel or _library()
    n, c, h, w = a.shape
    p, th, tw = g.shape[1:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    d = kh * kw * c
    out, norms2 = a.new_empty((n, d, p)), a.new_empty(n)
    parts = max(1, min(torch.get_num_threads(), n))
    pad, off = a.new_empty((parts, (h + 2 * ph) * (w + 2 * pw) * c)), torch.empty((parts, d + OFF_PADDING),
                                                                                   dtype=torch.long)
    shape = (h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, th, tw, p, pad.data_ptr(), off.data_ptr())
    _run_parts(kernel, "fn", (a.data_ptr(), g.data_ptr(), out.data_ptr(), norms2.data_ptr(), n), shape, parts)
    return out, norms2


class _Layer(ctypes.Structure):
    """The kernel's layer_t: one conv layer's tensors, shape and a thread's scratch."""
    _fields_ = [("x", ctypes.c_void_p), ("g", ctypes.c_void_p), ("pad", ctypes.c_void_p), ("off", ctypes.c_void_p),
                *((name, ctypes.c_int32) for name in ("H", "W", "C", "KH", "KW", "sh", "sw", "ph", "pw", "dh", "dw",
                                                      "TH", "TW", "P", "bias", "runs"))]


# Samples whose clipped gradients one thread adds up, in order, into a partial sum of their own;
# the partial sums are then added in block order. A constant, so that the sum's rounding is the
# same whatever the number of threads (or machine); 32 samples' rows of mnist-cnn's two convs
# (9216 floats) stay in cache.
SUM_BLOCK = 32


def clipped_sums(convs: list[tuple[nn.Conv2d, torch.Tensor, torch.Tensor]], base2: torch.Tensor, batch_size: int,
                 max_grad_norm: float, zero_nonfinite: bool = False, kernel: Kernel | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """The clipped sum Σ_i c_i ∇_i of each conv layer in `convs` ((layer, input a, output
    gradient g) as `per_sample_grads` takes them), with no per-sample gradient ever written out:
    each sample's are made, measured, scaled and added while they are in cache (per_sample_grads
    writes and reads back 52 MB for mnist-cnn's second conv at B = 1600). base2: each sample's
    squared gradient norm over the model's other weights (the layers' biases are these layers'
    own: the pass makes each sample's bias gradient, its output gradient summed over the
    positions, from the rows it reads anyway). Returns each sample's whole squared norm, its
    factor c_i (Opacus' min(1, C / (‖∇_i‖ + 1e-6)), ‖∇_i‖ the norm of the sample's own gradient,
    n times the batch mean's, times n; 0 for a sample whose norm is not finite under
    zero_nonfinite) and each layer's sums: its weight's as (kh·kw·c, p), its bias's (p) or None."""
    kernel = kernel or _library()
    n = base2.shape[0]
    for layer, a, g in convs:
        check_shapes(layer, a, g)
        if a.shape[0] != n:
            raise ValueError(f"conv kernel: {a.shape[0]} samples' inputs for {n} norms")
    if not (base2.dtype == torch.float32 and base2.is_contiguous()):
        raise ValueError("conv kernel: the other layers' squared norms as one contiguous float32 vector")
    sizes = [size for layer, a, g in convs  # as C counts: each layer's weight, then its bias
             for size in (layer.kernel_size[0] * layer.kernel_size[1] * a.shape[1] * g.shape[1],
                          g.shape[1] * (layer.bias is not None))]
    blocks = -(-n // SUM_BLOCK)
    norms2, coeff = base2.new_empty(n), base2.new_empty(n)
    partial = base2.new_empty((max(blocks, 1), sum(sizes)))
    parts = max(1, min(torch.get_num_threads(), blocks))
    layers, scratch = _layers(convs, parts)  # `scratch` keeps the tensors the layer_t point into alive
    buf = base2.new_empty((parts, sum(sizes)))
    _run_parts(kernel, "sums", (ctypes.addressof(layers), len(convs), base2.data_ptr(), norms2.data_ptr(),
                                coeff.data_ptr(), n, SUM_BLOCK),
               (float(batch_size), float(max_grad_norm), int(zero_nonfinite), buf.data_ptr(), partial.data_ptr()),
               parts)
    if blocks:  # in block order, whatever the threads; a thread for each 256 columns at least
        total = partial.new_empty(partial.shape[1])
        _run_parts(kernel, "block_sum", (partial.data_ptr(), blocks, partial.shape[1], total.data_ptr()), (),
                   max(1, min(torch.get_num_threads(), partial.shape[1] // 256)))
    else:
        total = partial[0].zero_()
    pieces = total.split(sizes)
    return norms2, coeff, [(w, b if layer.bias is not None else None)
                           for (layer, _, _), w, b in zip(convs, pieces[::2], pieces[1::2])]


def runs(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, kernel: Kernel | None = None) -> tuple[bool, bool]:
    """Whether the kernel reads this layer's (wide, narrow) blocks of rows as runs of consecutive
    floats (BLOCK in SOURCE), for a layer `applies` accepts."""
    check_shapes(layer, a, g)
    layers, scratch = _layers([(layer, a, g)], 1)
    found = (kernel or _library()).layer_runs(ctypes.addressof(layers))
    return bool(found & 1), bool(found & 2)


def _layers(convs: list[tuple[nn.Conv2d, torch.Tensor, torch.Tensor]],
            parts: int) -> tuple[ctypes.Array, list[torch.Tensor]]:
    """The layer_t array for `convs`, once for each of `parts` parts (part-major), and their
    scratch tensors (pad, off per layer and part: each part's its own)."""
    layers, scratch = (_Layer * (len(convs) * parts))(), []
    for entry, (layer, a, g) in zip(layers, convs * parts):
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
        _, c, h, w = a.shape
        pad = a.new_empty((h + 2 * ph) * (w + 2 * pw) * c)
        off = torch.empty(kh * kw * c + OFF_PADDING, dtype=torch.long)
        scratch += [pad, off]
        entry.x, entry.g, entry.pad, entry.off = a.data_ptr(), g.data_ptr(), pad.data_ptr(), off.data_ptr()
        for name, value in zip(("H", "W", "C", "KH", "KW", "sh", "sw", "ph", "pw", "dh", "dw", "TH", "TW", "P", "bias"),
                               (h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, *g.shape[2:], g.shape[1],
                                layer.bias is not None)):
            setattr(entry, name, value)
    return layers, scratch
