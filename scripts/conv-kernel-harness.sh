#!/usr/bin/env bash
# Times fedsd's conv kernel alone (clipped_conv_sums, one thread, no Python) on mnist-cnn's two
# convs, as results/perf.md quotes it: each conv, then both in one pass, at B = 1600 (the samples
# come from memory, as in a step) and at B = 32 repeated (they stay in cache: the register
# block's own rate).
#   scripts/conv-kernel-harness.sh [MARCH] [-DNAME=VALUE ...]   (MARCH: native, x86-64-v3, ...)
set -euo pipefail
march=${1:-native}; shift || true
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
here=${FEDSD_SOURCE_TREE:-$(cd "$(dirname "$0")/.." && pwd)}  # another checkout's kernel: FEDSD_SOURCE_TREE=DIR
if [ -f "$here/fedsd/clipping/conv_kernel.c" ]; then cp "$here/fedsd/clipping/conv_kernel.c" "$dir/kernel.c"
else  # a checkout from before the C had a file of its own
    (cd "$dir" && PYTHONPATH=$here python3 -c "from fedsd.clipping.conv_kernel import SOURCE; open('kernel.c', 'w').write(SOURCE)")
fi
cat > "$dir/harness.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "kernel.c"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static float* filled(long count) {
  float* p = aligned_alloc(64, (sizeof(float) * count + 63) / 64 * 64);
  for (long i = 0; i < count; i++) p[i] = (float)(rand() % 1000) * 1e-3f;
  return p;
}
static void run(int which, int n, int reps) {  /* which: bit 0 conv1, bit 1 conv2 */
  static const int shapes[2][14] = {{28, 28, 1, 8, 8, 2, 2, 3, 3, 1, 1, 14, 14, 16},
                                    {13, 13, 16, 4, 4, 2, 2, 0, 0, 1, 1, 5, 5, 32}};
  layer_t L[2]; int nl = 0; double flops = 0;
  for (int l = 0; l < 2; l++) {
    if (!(which & (1 << l))) continue;
    const int* s = shapes[l];
    layer_t t = {.x = filled((long)n * s[0] * s[1] * s[2]), .g = filled((long)n * s[11] * s[12] * s[13]),
                 .pad = malloc(sizeof(float) * (s[0] + 2 * s[7]) * (s[1] + 2 * s[8]) * s[2]),
                 .off = malloc(sizeof(int64_t) * (s[3] * s[4] * s[2] + 64)),
                 .H = s[0], .W = s[1], .C = s[2], .KH = s[3], .KW = s[4], .sh = s[5], .sw = s[6], .ph = s[7],
                 .pw = s[8], .dh = s[9], .dw = s[10], .TH = s[11], .TW = s[12], .P = s[13], .bias = 1};
    L[nl++] = t;
    flops += 2.0 * n * s[3] * s[4] * s[2] * s[13] * s[11] * s[12];
  }
  long K = 0;
  for (int l = 0; l < nl; l++) K += row_floats(&L[l]);
  float *base = calloc(n, 4), *norms = malloc(4 * n), *coeff = malloc(4 * n), *buf = malloc(4 * K),
        *partial = malloc(4 * K * (n / 32 + 1));
  double best = 1e9;
  for (int r = 0; r < reps; r++) {
    double t = now();
    clipped_conv_sums(L, nl, base, norms, coeff, n, 32, 0, 1, (float)n, 1.0f, 1, buf, partial);
    t = now() - t;
    if (r >= 3 && t < best) best = t;
  }
  printf("%-12s B = %4d: %7.3f ms for 1600 samples, %4.0f GFLOP/s\n", which == 3 ? "both convs" : which == 1 ? "conv1" : "conv2",
         n, best * 1e3 * 1600 / n, flops / best / 1e9);
}
int main(void) {
  for (int which = 1; which <= 3; which++) run(which, 1600, 30);
  for (int which = 1; which <= 3; which++) run(which, 32, 1500);
  return 0;
}
C
cc -O3 -march="$march" "$@" -fno-math-errno -o "$dir/harness" "$dir/harness.c" -lm
echo "conv kernel built for -march=$march $*, one thread (best of the repeats):"
"$dir/harness"
