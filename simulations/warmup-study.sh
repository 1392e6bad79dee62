#!/usr/bin/env bash
# DP3SD's warm-up loss (docs/algorithms.md, --dp3sd-warmup): plain cross-entropy (the papers'
# DP-SGD warm-up) against the sharpened CE_τs (this code's default), Fashion-MNIST, ε = 3, the
# papers' CNN, three seeds; results/table-warmup.md is rendered from the runs by
# `python -m simulations.warmup_table`.
# Usage: simulations/warmup-study.sh [WARMUP:SEED ...] (default: all six, plain first). Resumable:
# a finished run is skipped, a stopped one resumed. Run from the repository root.
set -euo pipefail
FEDSD=${FEDSD:-.venv/bin/fedsd}
RUNS=results/runs/warmup
mkdir -p "$RUNS"
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(plain:0 plain:1 plain:2 sharpened:0 sharpened:1 sharpened:2)
for job in "${jobs[@]}"; do
  warmup=${job%%:*} seed=${job##*:}
  out=$RUNS/fmnist-dp3sd-eps3-$warmup-seed$seed
  if [ -f $out/result.json ]; then continue; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; continue; fi
  $FEDSD train --dataset fmnist --method dp3sd --epsilon 3 --seed $seed --threads 1 --out $out --overwrite --quiet \
      --log-dir off --dp3sd-warmup $warmup
done
