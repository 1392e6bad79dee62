/* fedsd's per-sample conv kernel (fedsd/clipping/conv_kernel.py builds it with the system's C
   compiler and loads it with ctypes; SIGNATURES there must match the exported
   functions below, tests/test_conv_kernel.py checks them). */

/* One block of ∇_i (DB rows of d × NV vectors of output channels) lives in vector registers for
   a whole sum over the positions, so the block is sized for the target's registers. AVX-512 has
   32 registers of 16 floats: blocks of 8 × 2 or 16 × 1 vectors (16 accumulators), as measured
   on an AVX-512 CPU. AVX2 has 16 registers: 6 × 2 (12 accumulators, two registers for the output
   gradients, one for the input's broadcast), the fastest of 14 × 1, 12 × 1, 8 × 1 and 6 × 2
   built for x86-64-v3 on the AVX-512 CPU (mnist-cnn's two convs, 1 thread: 14.4 ms against
   19.3, 17.9, 16.7; results/perf.md); SSE keeps 14 × 1. The compiler's target picks the block
   (-march); -D WIDE_NV=… WIDE_DB=… NARROW_DB=… overrides it for measurement (-D NO_RUNS leaves
   BLOCK's runs out, for tests). The output channels go in vectors, so p must be a multiple of
   16 (every conv of the papers' CNNs); other layers take the PyTorch route.
   fedsd.clipping.routes' rule (RULES, by the kernel's instruction set) takes the kernel on
   AVX-512 and AVX2, where it was measured the fastest on every conv of the papers' CNNs. */
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
