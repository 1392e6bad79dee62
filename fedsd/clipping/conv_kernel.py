"""A CPU kernel for the per-sample weight gradients of a Conv2d on channels-last tensors, the
work book-keeping clipping (fedsd.clipping.bookkeeping) adds to a step.

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
number of threads. The threads are torch's own: built with -fopenmp, the library shares the
libgomp torch has loaded (the same soname), and its parts run on the calling thread's OpenMP
team. On a pool of other threads the pass lost a core to torch's workers, which spin after
each parallel op: mnist-cnn's pass took 6.1 ms alone and 12.3 right after a torch op under
libgomp's default spin, 7.2 under fedsd's shorter one (fedsd.runtime); on the team, 6.9, and
the DP step 41.1–41.3 ms against 43.1–44.2 on the pool (2 threads). Without OpenMP the parts
run on a pool of Python threads.

Book-keeping's step calls `clipped_sums`, not `per_sample_grads`: one pass over the samples
makes each sample's gradients of every such layer, its norm, its clipping factor, and adds the
clipped gradients into a block's partial sum while they are still in cache. Written out, the
per-sample gradients are 52 MB for mnist-cnn's second conv at B = 1600, written once and read
back for the clipped sum: the one pass took mnist-cnn's two convs from 8.9 to 6.4 ms, 2 threads
(results/perf.md).

What the pass waits on, measured on the AVX-512 CPU with scripts/conv-kernel-harness.sh
(mnist-cnn's two convs, 1 thread; results/perf.md): the samples come from memory, 47 MB of
inputs and output gradients at B = 1600, read in strides the hardware's prefetcher does not
follow ahead. The pass took 10.7–11.1 ms there against 8.4 on 32 samples kept in cache. The next
sample's lines are now fetched four at a time as each row of positions starts (6.7–6.8 ms, 6.6 in
cache, about 3/4 of the core's FMA peak): spread so, not in one burst, which filled the load queue. A block whose rows lie side by side in the input
reads each run of them through one pointer (conv1's 16 rows spilled their offsets to the stack,
at half the FMA rate), and its first block sums the bias's gradient from the output gradients it
loads anyway.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
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
from pathlib import Path

import torch
from torch import nn

from fedsd.files.cache import cache_root

# One block of ∇_i (DB rows of d × NV vectors of output channels) lives in vector registers for
# a whole sum over the positions, so the block is sized for the target's registers. AVX-512 has
# 32 registers of 16 floats: blocks of 8 × 2 or 16 × 1 vectors (16 accumulators), as measured
# on an AVX-512 CPU. AVX2 has 16 registers: 6 × 2 (12 accumulators, two registers for the output
# gradients, one for the input's broadcast), the fastest of 14 × 1, 12 × 1, 8 × 1 and 6 × 2
# built for x86-64-v3 on the AVX-512 CPU (mnist-cnn's two convs, 1 thread: 14.4 ms against
# 19.3, 17.9, 16.7; results/perf.md); SSE keeps 14 × 1. The compiler's target picks the block
# (-march); -D WIDE_NV=… WIDE_DB=… NARROW_DB=… overrides it for measurement (-D NO_RUNS leaves
# BLOCK's runs out, for tests). The output channels go in vectors, so p must be a multiple of
# 16 (every conv of the papers' CNNs); other layers take the PyTorch route.
# fedsd.clipping.routes' rule (RULES, by the kernel's instruction set) takes the kernel on
# AVX-512 and AVX2, where it was measured the fastest on every conv of the papers' CNNs.
SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#  include <omp.h>
#endif
#if defined(__AVX512F__)
#  define VW 16
#  define REGS_WIDE_NV 2
#  define REGS_WIDE_DB 8
#  define REGS_NARROW_DB 16
#elif defined(__AVX__)
#  define VW 8
#  define REGS_WIDE_NV 2
#  define REGS_WIDE_DB 6
#  define REGS_NARROW_DB 14
#else
#  define VW 4
#  define REGS_WIDE_NV 1
#  define REGS_WIDE_DB 14
#  define REGS_NARROW_DB 14
#endif
#ifndef WIDE_NV
#  define WIDE_NV REGS_WIDE_NV
#endif
#ifndef WIDE_DB
#  define WIDE_DB REGS_WIDE_DB
#endif
#ifndef NARROW_DB
#  define NARROW_DB REGS_NARROW_DB
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));
/* Unaligned loads and stores through a vector type that may alias floats (as the intrinsics'
   _mm256_loadu_ps). Not memcpy: GCC 12 built for AVX2 (x86-64-v3) copies 32 bytes in two
   16-byte pieces through the stack, and then kept the block's accumulators in memory too: the
   kernel ran at 17 GFLOP/s instead of 69 (mnist-cnn's two convs, 1 thread, results/perf.md). */
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
static inline vf ld(const float* p) { return *(const vfu*)p; }
static inline void st(float* p, vf v) { *(vfu*)p = v; }

/* The target's vector width in floats (the Python side reports it). */
int vector_floats(void) { return VW; }

/* The next sample's input and output gradient of every layer, fetched into the cache a few lines
   at a time while this sample is made: they come from memory (mnist-cnn's two convs read 47 MB
   at B = 1600), in a pattern of strides the hardware's prefetcher does not follow ahead, and a
   burst of prefetches at the sample's start fills the load queue (results/perf.md). Which
   lines, and when, depends on the shapes alone. */
#define PF_RANGES 32
#define PF_LINES 4
typedef struct { const char* start[PF_RANGES]; const char* end[PF_RANGES]; const char* at; int r, nr; } pf_t;
static inline void pf_step(pf_t* pf) {
  if (!pf) return;
  for (int j = 0; j < PF_LINES && pf->r < pf->nr; j++) {
    __builtin_prefetch(pf->at, 0, 3);
    pf->at += 64;
    if (pf->at >= pf->end[pf->r] && ++pf->r < pf->nr) pf->at = pf->start[pf->r];
  }
}

/* ∇_i[d][pc .. pc + VW·NV) for d in blocks of DB; off[d] is where patch entry d lies from the
   patch's corner (the rows past D read the corner and are not stored). RUNS: the block's rows
   are DB / RUN_L runs of RUN_L consecutive floats of the input (off[db + r·RUN_L + j] =
   off[db + r·RUN_L] + j: a kernel row's channels, or its columns where there is one channel and
   no dilation), so each run needs one pointer and its entries are constant displacements from
   it; else each row's offset is read from `off` (the compiler keeps them in registers, or
   spills them: mnist-cnn conv1's 16 rows spilled, at half the FMA rate). Each sum over the
   positions runs in the same order either way: the same bits. The first block also sums the
   output gradients it loads over the positions, in order: the bias's gradient (bacc). The
   squares go into the vector sq, summed across its lanes once a sample (one_sample). */
#ifndef RUN_L
#  define RUN_L 8
#endif
/* A block's rows past D read `off`'s padding (OFF_PADDING entries, Python side). */
_Static_assert(WIDE_DB <= 64 && NARROW_DB <= 64, "a block of more rows than off's padding");
/* Position t's output gradients of the block's channels (gt) into gv; the first block adds them
   to the bias's gradient. */
#define OUTPUT_GRADIENT(NV) \
  vf gv[NV]; \
  for (int v = 0; v < NV; v++) gv[v] = ld(gt + VW * v); \
  if (db == 0) for (int v = 0; v < NV; v++) bacc[v] += gv[v];
#define BLOCK(NV, DB, RUNS) \
  vf bacc[NV]; \
  for (int v = 0; v < NV; v++) bacc[v] = (vf){0}; \
  for (int64_t db = 0; db < D; db += DB) { \
    vf acc[DB][NV]; \
    for (int dd = 0; dd < DB; dd++) for (int v = 0; v < NV; v++) acc[dd][v] = (vf){0}; \
    const int64_t* od = off + db; \
    if ((DB) % RUN_L == 0 && (RUNS) && db + DB <= D) { \
      int64_t ro[DB / RUN_L ? DB / RUN_L : 1]; \
      for (int r = 0; r < DB / RUN_L; r++) ro[r] = od[r * RUN_L]; \
      for (int ty = 0; ty < TH; ty++) { \
        pf_step(pf); \
        const float* row = xp + (int64_t)ty * sh * Wp * C; \
        const float* gt = gi + (int64_t)ty * TW * P + pc; \
        for (int tx = 0; tx < TW; tx++, row += (int64_t)sw * C, gt += P) { \
          OUTPUT_GRADIENT(NV) \
          for (int r = 0; r < DB / RUN_L; r++) { \
            const float* run = row + ro[r]; \
            __asm__("" : "+r"(run)); /* one register a run: GCC would otherwise keep each row's offset */ \
            for (int j = 0; j < RUN_L; j++) \
              for (int v = 0; v < NV; v++) acc[r * RUN_L + j][v] += run[j] * gv[v]; \
          } \
        } \
      } \
    } else { \
      for (int ty = 0; ty < TH; ty++) for (int tx = 0; tx < TW; tx++) { \
        if (tx == 0) pf_step(pf); \
        const float* corner = xp + ((int64_t)ty * sh * Wp + (int64_t)tx * sw) * C; \
        const float* gt = gi + ((int64_t)ty * TW + tx) * P + pc; \
        OUTPUT_GRADIENT(NV) \
        for (int dd = 0; dd < DB; dd++) { \
          float a = corner[od[dd]]; \
          for (int v = 0; v < NV; v++) acc[dd][v] += a * gv[v]; \
        } \
      } \
    } \
    for (int dd = 0; dd < DB && db + dd < D; dd++) \
      for (int v = 0; v < NV; v++) { st(oi + (db + dd) * P + pc + VW * v, acc[dd][v]); sq += acc[dd][v] * acc[dd][v]; } \
  } \
  if (ob) for (int v = 0; v < NV; v++) { st(ob + pc + VW * v, bacc[v]); bsq += bacc[v] * bacc[v]; }

/* One conv layer's shape, and this thread's scratch: pad Hp·Wp·C floats, off D + 64 int64s.
   bias: the clipped sum also makes the bias's (clipped_conv_sums; per_sample_conv_grads never). */
typedef struct {
  const float* x; const float* g;  /* x (n, H, W, C), g (n, TH, TW, P) */
  float* pad; int64_t* off;
  int32_t H, W, C, KH, KW, sh, sw, ph, pw, dh, dw, TH, TW, P, bias;
  int32_t runs;  /* set by prepare: bit 0, the wide blocks' rows are runs (BLOCK); bit 1, the narrow ones' */
} layer_t;

/* A layer's share of a sample's row in clipped_conv_sums: ∇W (D × P), then ∇b (P) with a bias. */
static int64_t row_floats(const layer_t* L) {
  return (int64_t)L->KH * L->KW * L->C * L->P + (L->bias ? L->P : 0);
}

/* Whether every whole block of `db_size` rows is runs of RUN_L consecutive floats (BLOCK). */
static int blocks_are_runs(const int64_t* off, int64_t D, int db_size) {
  if (db_size % RUN_L || D < db_size) return 0;  /* no whole block: none read as runs */
  for (int64_t d = 0; d + 1 < D; d++)
    if ((d + 1) % RUN_L && off[d + 1] != off[d] + 1) return 0;
  return 1;
}

static void prepare(layer_t* L) {
  const int Wp = L->W + 2 * L->pw, C = L->C;
  const int64_t D = (int64_t)L->KH * L->KW * C;
  for (int64_t d = 0; d < D + 64; d++) {
    int64_t ky = d / ((int64_t)L->KW * C), kx = d / C % L->KW, c = d % C;
    L->off[d] = d < D ? (ky * L->dh * Wp + kx * L->dw) * C + c : 0;
  }
#ifdef NO_RUNS  /* every row's offset read from `off` (tests: the same bits either way) */
  L->runs = 0;
#else
  L->runs = blocks_are_runs(L->off, D, WIDE_DB) | blocks_are_runs(L->off, D, NARROW_DB) << 1;
#endif
  if (L->ph || L->pw) memset(L->pad, 0, sizeof(float) * (L->H + 2 * L->ph) * Wp * C);
}

static float lanes_sum(vf v) {
  float s = 0;
  for (int k = 0; k < VW; k++) s += v[k];
  return s;
}

/* Sample i's ∇_i (D × P, d = (ky, kx, c)) into oi; returns its squared norm. ob: also its bias's
   gradient, the output gradient summed over the positions (P floats), its squared norm added
   to the return value; NULL: none. pf: the lines to fetch meanwhile (pf_step), or NULL. */
static float one_sample(const layer_t* L, int64_t i, float* oi, float* ob, pf_t* pf) {
  const int H = L->H, W = L->W, C = L->C, sh = L->sh, sw = L->sw, TH = L->TH, TW = L->TW, P = L->P;
  const int Wp = W + 2 * L->pw;
  const int64_t D = (int64_t)L->KH * L->KW * C;
  const int64_t* off = L->off;
  const float* xp = L->x + i * H * W * C;
  if (L->ph || L->pw) {
    for (int r = 0; r < H; r++)
      memcpy(L->pad + ((int64_t)(r + L->ph) * Wp + L->pw) * C, xp + (int64_t)r * W * C, sizeof(float) * W * C);
    xp = L->pad;
  }
  const float* gi = L->g + i * TH * TW * P;
  vf sq = (vf){0}, bsq = (vf){0};
  int pc = 0;
  for (; pc + WIDE_NV * VW <= P; pc += WIDE_NV * VW) { BLOCK(WIDE_NV, WIDE_DB, L->runs & 1) }
  for (; pc + VW <= P; pc += VW) { BLOCK(1, NARROW_DB, L->runs & 2) }
  return lanes_sum(sq) + lanes_sum(bsq);
}

/* The lines of sample i's input and output gradient in every layer, for pf_step. */
static void pf_sample(pf_t* pf, const layer_t* layers, int nl, int64_t i) {
  pf->r = pf->nr = 0;
  for (int l = 0; l < nl && pf->nr + 2 <= PF_RANGES; l++) {
    const layer_t* L = &layers[l];
    const int64_t xs = (int64_t)L->H * L->W * L->C * 4, gs = (int64_t)L->TH * L->TW * L->P * 4;
    pf->start[pf->nr] = (const char*)L->x + i * xs; pf->end[pf->nr] = pf->start[pf->nr] + xs; pf->nr++;
    pf->start[pf->nr] = (const char*)L->g + i * gs; pf->end[pf->nr] = pf->start[pf->nr] + gs; pf->nr++;
  }
  pf->at = pf->nr ? pf->start[0] : NULL;
}

/* Part `part` of `parts` of the samples: out (n, D, P), and norms2 (n) their squared norms.
   pad, off: parts × (Hp·Wp·C floats), parts × (D + 64 int64s), each part's scratch its own. */
void per_sample_conv_grads(const float* x, const float* g, float* out, float* norms2, int64_t n, int part, int parts,
                           int H, int W, int C, int KH, int KW, int sh, int sw, int ph, int pw,
                           int dh, int dw, int TH, int TW, int P, float* pad, int64_t* off) {
  const int64_t D = (int64_t)KH * KW * C, i0 = n * part / parts, i1 = n * (part + 1) / parts;
  layer_t L = {x, g, pad + part * (int64_t)(H + 2 * ph) * (W + 2 * pw) * C, off + part * (D + 64),
               H, W, C, KH, KW, sh, sw, ph, pw, dh, dw, TH, TW, P, 0, 0};
  if (i1 <= i0) return;
  prepare(&L);
  for (int64_t i = i0; i < i1; i++) norms2[i] = one_sample(&L, i, out + i * D * P, NULL, NULL);
}

/* The clipped sum of `nl` conv layers, their per-sample gradients never leaving this thread's
   buffer (`buf`: parts × K floats, K = Σ row_floats; `layers`: parts × nl, each part's own
   scratch): for each sample i in the part's share of the blocks of `bs` samples, all its
   layers' ∇_i, its squared norm norms2[i] = base2[i] + Σ ‖∇_i‖² (base2: the model's other
   weights'), its factor coeff[i] = n·min(1, C / (n·‖·‖ + 1e-6)) (Opacus', for gradients of a
   mean over n samples), and coeff[i]·∇_i added, sample by sample in order, into the block's
   row of `partial` (blocks × K). zero_nonfinite: a sample whose norm is not finite gets
   coeff 0 and adds +0.0. The rows do not depend on how blocks are split into parts. */
void clipped_conv_sums(layer_t* layers, int nl, const float* base2, float* norms2, float* coeff,
                       int64_t n, int64_t bs, int part, int parts, float n_scale, float max_norm,
                       int zero_nonfinite, float* buf, float* partial) {
  const int64_t blocks = (n + bs - 1) / bs, b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
  if (b1 <= b0) return;
  int64_t K = 0;
  for (int l = 0; l < nl; l++) K += row_floats(&layers[l]);
  layers += (int64_t)part * nl;  /* the part's own layer_t (its scratch) and buffer */
  buf += part * K;
  for (int l = 0; l < nl; l++) prepare(&layers[l]);
  for (int64_t b = b0; b < b1; b++) {
    float* row = partial + b * K;
    memset(row, 0, sizeof(float) * K);
    for (int64_t i = b * bs; i < (b + 1) * bs && i < n; i++) {
      float norm2 = base2[i];
      float* o = buf;
      pf_t pf;
      pf_sample(&pf, layers, nl, i + 1 < n ? i + 1 : i);
      for (int l = 0; l < nl; l++) {
        const layer_t* L = &layers[l];
        norm2 += one_sample(L, i, o, L->bias ? o + (int64_t)L->KH * L->KW * L->C * L->P : NULL, &pf);
        o += row_floats(L);
      }
      float norm = sqrtf(norm2) * n_scale;
      /* No branch on the data (an owner's service: its timing must not tell which sample was
         clipped or left out): the clamp and the finite test are masks on the bits. The clamp
         keeps a NaN (min(1, NaN) is NaN, as torch's clamp). */
      float c = max_norm / (norm + 1e-6f), one = 1.0f;
      uint32_t cb, ob, nb;
      memcpy(&cb, &c, 4); memcpy(&ob, &one, 4); memcpy(&nb, &norm, 4);
      uint32_t over = 0u - (uint32_t)(c > 1.0f);
      cb = (ob & over) | (cb & ~over);
      memcpy(&c, &cb, 4);
      c *= n_scale;
      norms2[i] = norm2;
      /* A sample left out adds +0.0 (bits masked to zero: c·∇_i may be NaN), the same work as
         any other; a row that starts at +0.0 is unchanged by it. K is a multiple of VW (P of 16). */
      uint32_t bad = (uint32_t)(((nb >> 23) & 0xffu) == 0xffu) & (uint32_t)(zero_nonfinite != 0);
      uint32_t keepb = bad - 1u;  /* all ones: kept; zero: left out */
      memcpy(&cb, &c, 4); cb &= keepb; memcpy(&coeff[i], &cb, 4);
      vi keep = (vi){0} + (int32_t)keepb;
      for (int64_t k = 0; k < K; k += VW) st(row + k, ld(row + k) + (vf)((vi)(c * ld(buf + k)) & keep));
    }
  }
}

/* Which of the layer's blocks BLOCK reads as runs (the bits of layer_t.runs; tests). */
int layer_runs(layer_t* L) {
  prepare(L);
  return L->runs;
}

/* Part `part` of `parts` of the K columns of the blocks' partial rows (`partial`: blocks × K),
   summed in block order into out (K): each column's sum the same whatever the parts. */
void block_sum(const float* partial, int64_t blocks, int64_t K, float* out, int part, int parts) {
  const int64_t k0 = K * part / parts, k1 = K * (part + 1) / parts;
  if (k1 <= k0) return;
  memcpy(out + k0, partial + k0, sizeof(float) * (k1 - k0));
  for (int64_t b = 1; b < blocks; b++) {
    const float* row = partial + b * K;
    for (int64_t k = k0; k < k1; k++) out[k] += row[k];
  }
}

/* All `parts` parts on the OpenMP team of the calling thread: torch's own threads, as this
   library shares torch's libgomp (the same soname, loaded already), where it was built with
   -fopenmp. A pool of other threads loses a core to torch's workers, which spin after each
   parallel op (the module's docstring has the times). A part runs on one thread whatever the
   team's size; without OpenMP, parts run in turn (the Python side then runs them on its own
   threads instead). EACH_PART(t) runs the statement after it for every part t. */
#ifdef _OPENMP
#  define EACH_PART(t) _Pragma("omp parallel num_threads(parts)") \
     for (int t = omp_get_thread_num(); t < parts; t += omp_get_num_threads())
#else
#  define EACH_PART(t) for (int t = 0; t < parts; t++)
#endif
int openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

void per_sample_conv_grads_team(const float* x, const float* g, float* out, float* norms2, int64_t n, int parts,
                                int H, int W, int C, int KH, int KW, int sh, int sw, int ph, int pw,
                                int dh, int dw, int TH, int TW, int P, float* pad, int64_t* off) {
  EACH_PART(t)
    per_sample_conv_grads(x, g, out, norms2, n, t, parts, H, W, C, KH, KW, sh, sw, ph, pw, dh, dw, TH, TW, P, pad, off);
}

void block_sum_team(const float* partial, int64_t blocks, int64_t K, float* out, int parts) {
  EACH_PART(t)
    block_sum(partial, blocks, K, out, t, parts);
}

void clipped_conv_sums_team(layer_t* layers, int nl, const float* base2, float* norms2, float* coeff,
                            int64_t n, int64_t bs, int parts, float n_scale, float max_norm,
                            int zero_nonfinite, float* buf, float* partial) {
  EACH_PART(t)
    clipped_conv_sums(layers, nl, base2, norms2, coeff, n, bs, t, parts, n_scale, max_norm, zero_nonfinite, buf,
                      partial);
}
"""
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
            done = subprocess.run([*cc, "-O3", *arch, "-fno-math-errno", "-shared", "-fPIC", str(src), "-o", str(lib), "-lm"],
                                  capture_output=True)
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
             openmp: bool = True) -> Kernel | Path:
    """The kernel built for `march` (-D `defines` for measurement), cached under
    FEDSD_CACHE_DIR/kernels by source, compiler, target, OpenMP and CPU; loaded, or with
    load=False only its path (a target this CPU cannot run can still be built). openmp=False:
    built without it (its parts on Python's threads, as where the compiler has no OpenMP).
    Raises OSError when it cannot be built."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        raise OSError("no C compiler found (cc, gcc, clang or $CC)")
    cc = shlex.split(found)  # $CC may carry flags ("gcc -m64")
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    flags = [f"-march={march}", *(f"-D{d}" for d in defines)]
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
    shape = [ctypes.c_int] * 14 + [ctypes.c_void_p] * 2
    fn, fn_team = lib.per_sample_conv_grads, lib.per_sample_conv_grads_team
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int] + shape
    fn_team.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int] + shape
    sums, sums_team = lib.clipped_conv_sums, lib.clipped_conv_sums_team
    head, tail = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2, \
        [ctypes.c_float] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
    sums.argtypes = head + [ctypes.c_int] * 2 + tail
    sums_team.argtypes = head + [ctypes.c_int] + tail
    block_sum, block_sum_team = lib.block_sum, lib.block_sum_team
    block_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    block_sum_team.argtypes = block_sum.argtypes[:-1]
    for f in (fn, fn_team, sums, sums_team, block_sum, block_sum_team):
        f.restype = None
    lib.layer_runs.argtypes = [ctypes.c_void_p]
    lib.vector_floats.restype = lib.openmp.restype = lib.layer_runs.restype = ctypes.c_int
    return Kernel(fn, sums, fn_team, sums_team, block_sum, block_sum_team, lib.layer_runs, bool(lib.openmp()), march,
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
        if not (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous(memory_format=torch.channels_last)):
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
    pad, off = a.new_empty((parts, (h + 2 * ph) * (w + 2 * pw) * c)), torch.empty((parts, d + OFF_PADDING), dtype=torch.long)
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
               (float(batch_size), float(max_grad_norm), int(zero_nonfinite), buf.data_ptr(), partial.data_ptr()), parts)
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
