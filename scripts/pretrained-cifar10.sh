#!/usr/bin/env bash
# CIFAR-10 with a public part (results/README.md, "Does a public pretrained network help?"): the
# first 5,000 training images are public (cifar-cnn pretrained on them without privacy), the
# other 45,000 private at ε = 2; head, last block and every layer, and the same network from
# scratch on the same 45,000, three seeds each. Not run here (about an hour a pixel run on this
# 2-core machine; minutes on a GPU). Resumable. Run from the repository root.
# The lr of each row is the papers' (3 at B = 1000) until a validation sweep as in
# scripts/pretrained-study.sh chooses one (add --validation 5000 and --grid lr=... to choose it).
set -euo pipefail
FEDSD=${FEDSD:-.venv/bin/fedsd}
PRE=results/pretrained/cifar10-first5000-cifar-cnn.pt
RUNS=results/runs/pretrained
mkdir -p results/pretrained "$RUNS"
[ -f $PRE ] || $FEDSD pretrain --dataset cifar10 --model cifar-cnn --first 5000 --epochs 30 --threads 1 --out $PRE
run() {  # name, then fedsd train's options
  local out=$RUNS/$1; shift
  if [ -f $out/result.json ]; then return; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; return; fi
  $FEDSD train --dataset cifar10 --method dpsgd --epsilon 2 --public-first 5000 --threads 1 --out $out --quiet --log-dir off "$@"
}
for seed in 0 1 2; do
  run cifar10-first5000-head-seed$seed --init-weights $PRE --features backbone --train-layers head --seed $seed
  run cifar10-first5000-last2-seed$seed --init-weights $PRE --features backbone --train-layers last:2 --seed $seed
  run cifar10-first5000-all-seed$seed --init-weights $PRE --train-layers all --seed $seed
  run cifar10-scratch45000-seed$seed --seed $seed
done
