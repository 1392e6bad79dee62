"""A CPU kernel for the per-sample weight gradients of a Conv2d on channels-last tensors, the
work book-keeping clipping (fedsd.bookkeeping) adds to a step.

Sample i's gradient is ∇_i = G_iᵀA_i: its output gradient G_i (T positions × p channels) times
its im2col patches A_i (T × d). In PyTorch that is a patch copy and a batched product of small
matrices; this kernel reads each patch where it lies in the (padded) input and keeps a block of
∇_i in vector registers while it sums over the positions, so the patches are never written.
Measured on this project's CPU at the papers' batch sizes, 1 thread (results/perf.md):
mnist-cnn conv1 24 → 10 ms, cifar-cnn conv1 84 → 21 ms, conv2 134 → 106 ms, each with the
clipped sum.

It is C compiled once per machine with the system's C compiler (`cc`, GCC vector extensions,
so it builds on any CPU the compiler targets) and loaded with ctypes; the build is cached
under FEDSD_CACHE_DIR (default ~/.cache/fedsd), keyed by the source, the compiler and the CPU.
Where no compiler is found, or FEDSD_CONV_KERNEL=0, bk uses the PyTorch route, which gives the
same gradients to float rounding (tests/test_conv_kernel.py).

Each sample's gradient is computed by one thread alone, so the result does not depend on the
number of threads.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from . import cache_root

# One block of ∇_i (db rows of d × 16·nv channels) lives in vector registers for a whole sum
# over the positions: 8 × 32 or 16 × 16 floats, 16 of the 32 AVX-512 registers (or, where the
# compiler splits a 16-float vector, AVX2's). The output channels go in vectors of 16, so p must
# be a multiple of 16 (every conv of the papers' CNNs); other layers take the PyTorch route.
SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 ld(const float* p) { v16 v; memcpy(&v, p, 64); return v; }
static inline void st(float* p, v16 v) { memcpy(p, &v, 64); }

/* ∇_i[d][pc .. pc + 16·NV) for d in blocks of DB; off[d] is where patch entry d lies from the
   patch's corner (the rows past D read the corner and are not stored). */
#define BLOCK(NV, DB) \
  for (int64_t db = 0; db < D; db += DB) { \
    v16 acc[DB][NV]; \
    for (int dd = 0; dd < DB; dd++) for (int v = 0; v < NV; v++) acc[dd][v] = (v16){0}; \
    const int64_t* od = off + db; \
    for (int ty = 0; ty < TH; ty++) for (int tx = 0; tx < TW; tx++) { \
      const float* corner = xp + ((int64_t)ty * sh * Wp + (int64_t)tx * sw) * C; \
      const float* gt = gi + ((int64_t)ty * TW + tx) * P + pc; \
      v16 gv[NV]; \
      for (int v = 0; v < NV; v++) gv[v] = ld(gt + 16 * v); \
      for (int dd = 0; dd < DB; dd++) { \
        float a = corner[od[dd]]; \
        for (int v = 0; v < NV; v++) acc[dd][v] += a * gv[v]; \
      } \
    } \
    v16 sq = (v16){0}; \
    for (int dd = 0; dd < DB && db + dd < D; dd++) \
      for (int v = 0; v < NV; v++) { st(oi + (db + dd) * P + pc + 16 * v, acc[dd][v]); sq += acc[dd][v] * acc[dd][v]; } \
    for (int k = 0; k < 16; k++) norm2 += sq[k]; \
  }

/* Samples [i0, i1): x (n, H, W, C), g (n, TH, TW, P), out (n, D, P) with d = (ky, kx, c), and
   norms2 (n) their squared norms. pad: Hp·Wp·C floats, off: D rounded up to 16 int64s, both
   this call's own. */
void per_sample_conv_grads(const float* x, const float* g, float* out, float* norms2, int64_t i0, int64_t i1,
                           int H, int W, int C, int KH, int KW, int sh, int sw, int ph, int pw,
                           int dh, int dw, int TH, int TW, int P, float* pad, int64_t* off) {
  const int Hp = H + 2 * ph, Wp = W + 2 * pw;
  const int64_t D = (int64_t)KH * KW * C, Dr = (D + 15) / 16 * 16;
  for (int64_t d = 0; d < Dr; d++) {
    int64_t ky = d / ((int64_t)KW * C), kx = d / C % KW, c = d % C;
    off[d] = d < D ? (ky * dh * Wp + kx * dw) * C + c : 0;
  }
  if (ph || pw) memset(pad, 0, sizeof(float) * Hp * Wp * C);
  for (int64_t i = i0; i < i1; i++) {
    const float* xp = x + i * H * W * C;
    if (ph || pw) {
      for (int r = 0; r < H; r++)
        memcpy(pad + ((int64_t)(r + ph) * Wp + pw) * C, xp + (int64_t)r * W * C, sizeof(float) * W * C);
      xp = pad;
    }
    const float* gi = g + i * TH * TW * P;
    float* oi = out + i * D * P;
    float norm2 = 0;
    int pc = 0;
    for (; pc + 32 <= P; pc += 32) { BLOCK(2, 8) }
    for (; pc + 16 <= P; pc += 16) { BLOCK(1, 16) }
    norms2[i] = norm2;
  }
}
"""
ENABLED_ENV = "FEDSD_CONV_KERNEL"  # 0: always the PyTorch route


def _cpu_id() -> str:
    """What the build's -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _compile(cc: list[str], target: Path) -> None:
    """Build into a private temporary file and rename it into place, so that processes that
    build at once (Ray workers) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kernel.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        for arch in (["-march=native"], []):  # -march=native where the compiler has it
            done = subprocess.run([*cc, "-O3", *arch, "-shared", "-fPIC", str(src), "-o", str(lib)],
                                  capture_output=True)
            if done.returncode == 0:
                os.replace(lib, target)
                return
    raise OSError(f"{shlex.join(cc)} could not build the conv kernel: {done.stderr.decode(errors='replace')[-500:]}")


@functools.lru_cache(maxsize=1)
def _library():
    """The loaded kernel, or None (no compiler, a failed build, or FEDSD_CONV_KERNEL=0)."""
    if os.environ.get(ENABLED_ENV, "1") == "0":
        return None
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        warnings.warn("no C compiler found (cc, gcc, clang or $CC): --grad-sample-mode bk takes PyTorch's "
                      "slower route for per-sample conv gradients (same results)", RuntimeWarning, stacklevel=2)
        return None
    try:
        cc = shlex.split(found)  # $CC may carry flags ("gcc -m64")
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
        key = hashlib.sha256("\0".join([SOURCE, found, version, _cpu_id()]).encode()).hexdigest()[:16]
        path = cache_root() / "kernels" / f"per_sample_conv-{key}.so"
        if not path.exists():
            _compile(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"the per-sample conv kernel was not built ({e}): --grad-sample-mode bk takes PyTorch's "
                      "slower route (same results)", RuntimeWarning, stacklevel=2)
        return None
    fn = lib.per_sample_conv_grads
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 14 + [ctypes.c_void_p] * 2
    return fn


def available() -> bool:
    return _library() is not None


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
    if len(calls) == 1:
        calls[0]()
        return
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < len(calls):
            _pool = (os.getpid(), len(calls), ThreadPoolExecutor(len(calls), thread_name_prefix="fedsd-conv-kernel"))
        pool = _pool[2]
    for future in [pool.submit(call) for call in calls]:
        future.result()


def per_sample_grads(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, kh·kw·c, p): each sample's weight gradient GᵢᵀAᵢ, transposed (d before p), and (n)
    their squared norms, summed as they are made rather than read back (for mnist-cnn conv2 at
    B = 1600 that is 52 MB), for a layer `applies` accepts; a is the layer's input, g its output
    gradient, both (n, c, h, w)."""
    fn = _library()
    n, c, h, w = a.shape
    p, th, tw = g.shape[1:]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    d = kh * kw * c
    out, norms2 = a.new_empty((n, d, p)), a.new_empty(n)
    parts = max(1, min(torch.get_num_threads(), n))
    bounds = [n * k // parts for k in range(parts + 1)]
    scratch = [(a.new_empty((h + 2 * ph) * (w + 2 * pw) * c), torch.empty((d + 15) // 16 * 16, dtype=torch.long))
               for _ in range(parts)]
    calls = [functools.partial(fn, a.data_ptr(), g.data_ptr(), out.data_ptr(), norms2.data_ptr(), lo, hi, h, w, c, kh, kw, sh, sw,
                               ph, pw, dh, dw, th, tw, p, pad.data_ptr(), off.data_ptr())
             for (lo, hi), (pad, off) in zip(zip(bounds, bounds[1:]), scratch) if hi > lo]
    _run_split(calls)
    return out, norms2
