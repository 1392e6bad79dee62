#!/usr/bin/env bash
# CIFAR-10 with a public part (results/README.md, "Does a public pretrained network help?"): the
# first 5,000 training images are public (cifar-cnn pretrained on them without privacy), the
# other 45,000 private at ε = 2. As simulations/pretrained-study.sh does for MNIST and Fashion-MNIST:
# the head and the last block on the frozen blocks' cached output, their lr chosen on validation
# (5,000 of the private images held out); every layer from the pretrained start and the same
# network from its random start, the papers' lr, 10 epochs each (a paired control: the same
# length); three seeds each on test. Resumable: every step skips what is finished.
# Run from the repository root. ROWS picks rows (default: all of them, cheapest first).
set -euo pipefail
FEDSD=${FEDSD:-.venv/bin/fedsd}
PRE=results/pretrained/cifar10-first5000-cifar-cnn.pt
RUNS=results/runs/pretrained
ROWS=${ROWS:-"sweep head last2 all scratch"}
mkdir -p results/pretrained "$RUNS"
[ -f $PRE ] || $FEDSD pretrain --dataset cifar10 --model cifar-cnn --first 5000 --epochs 30 --threads 1 --out $PRE
SWEEP=results/sweeps/cifar10-dpsgd-pretrained-first5000
run() {  # name, then fedsd train's options
  local out=$RUNS/$1; shift
  if [ -f $out/result.json ]; then return; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; return; fi
  $FEDSD train --dataset cifar10 --method dpsgd --epsilon 2 --public-first 5000 --threads 1 --out $out --overwrite --quiet --log-dir off "$@"
}
chosen() { .venv/bin/python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['runs'] if x['settings']['train_layers']==sys.argv[2]]; print(max(r, key=lambda x: x['validation_mean'] or -1)['settings']['lr'])" "$@"; }
for row in $ROWS; do
  case $row in
    sweep)
      [ -f $SWEEP/sweep.json ] || $FEDSD sweep --dataset cifar10 --method dpsgd --epsilon 2 --grid train-layers=head,last:2 \
        --grid lr=0.6,3,15,75 --set public-first=5000 --set init-weights=$PRE --set features=backbone --set threads=1 \
        --validation 5000 --out $SWEEP --quiet ;;
    head|last2)
      layers=$row; [ $row = last2 ] && layers=last:2
      lr=$(chosen $SWEEP/sweep.json $layers)
      for seed in 0 1 2; do
        run cifar10-first5000-$row-lr$lr-seed$seed --init-weights $PRE --features backbone --train-layers $layers --lr $lr --seed $seed
      done ;;
    all) for seed in 0 1 2; do run cifar10-first5000-all-e10-seed$seed --init-weights $PRE --train-layers all --epochs 10 --seed $seed; done ;;
    scratch) for seed in 0 1 2; do run cifar10-scratch45000-all-e10-seed$seed --epochs 10 --seed $seed; done ;;
  esac
done
