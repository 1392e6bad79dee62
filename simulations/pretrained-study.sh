#!/usr/bin/env bash
# The pretrained-network study (results/README.md, "Does a public pretrained network help?"):
# the public networks (no privacy), the settings chosen on validation, then three seeds on test.
# Resumable: every step skips what is finished. Run from the repository root.
set -euo pipefail
FEDSD=${FEDSD:-.venv/bin/fedsd}
PRE=results/pretrained
RUNS=results/runs/pretrained
mkdir -p "$PRE" "$RUNS"

# 1. the public networks: Fashion-MNIST's for MNIST, MNIST's for Fashion-MNIST
$FEDSD pretrain --dataset fmnist --model mnist-cnn --epochs 3 --threads 1 --out $PRE/fmnist-mnist-cnn.pt
$FEDSD pretrain --dataset mnist --model mnist-cnn --epochs 3 --threads 1 --out $PRE/mnist-mnist-cnn.pt

# 2. chosen on validation (10,000 training samples held out): the head alone and the last block
#    on the frozen blocks' cached output, the papers' lr and 5 and 25 times it and a fifth of it
$FEDSD sweep --dataset mnist --method dpsgd --epsilon 3 --grid train-layers=head,last:2 --grid lr=0.16,0.8,4,20 \
    --set init-weights=$PRE/fmnist-mnist-cnn.pt --set features=backbone --set threads=1 --validation 10000 \
    --out results/sweeps/mnist-dpsgd-pretrained-fmnist --quiet
$FEDSD sweep --dataset fmnist --method dpsgd --epsilon 3 --grid train-layers=head,last:2 --grid lr=0.6,3,15,75 \
    --set init-weights=$PRE/mnist-mnist-cnn.pt --set features=backbone --set threads=1 --validation 10000 \
    --out results/sweeps/fmnist-dpsgd-pretrained-mnist --quiet

# 3. three seeds on test, each with its validated lr
chosen() { .venv/bin/python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['runs'] if x['settings']['train_layers']==sys.argv[2]]; print(max(r, key=lambda x: x['validation_mean'] or -1)['settings']['lr'])" "$@"; }
for d in mnist fmnist; do
  if [ $d = mnist ]; then pub=fmnist; else pub=mnist; fi
  for layers in head last:2; do
    lr=$(chosen results/sweeps/$d-dpsgd-pretrained-$pub/sweep.json $layers)
    for seed in 0 1 2; do
      out=$RUNS/$d-from-$pub-${layers/:/}-lr$lr-seed$seed
      if [ -f $out/result.json ]; then continue; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; continue; fi
      $FEDSD train --dataset $d --method dpsgd --epsilon 3 --init-weights $PRE/$pub-mnist-cnn.pt \
          --features backbone --train-layers $layers --lr $lr --seed $seed --threads 1 --out $out --overwrite --quiet --log-dir off
    done
  done
done

# 4. every layer (pixels), the papers' lr, 10 epochs (shorter than the from-scratch default: the start is pretrained)
for d in mnist fmnist; do
  if [ $d = mnist ]; then pub=fmnist; else pub=mnist; fi
  for seed in 0 1 2; do
    out=$RUNS/$d-from-$pub-all-e10-seed$seed
    if [ -f $out/result.json ]; then continue; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; continue; fi
    $FEDSD train --dataset $d --method dpsgd --epsilon 3 --init-weights $PRE/$pub-mnist-cnn.pt \
        --train-layers all --epochs 10 --seed $seed --threads 1 --out $out --overwrite --quiet --log-dir off
  done
done

# 4b. every layer at its lr chosen on validation (a fifth of the papers', theirs, 5 and 25 times), three seeds on test
$FEDSD sweep --dataset mnist --method dpsgd --epsilon 3 --grid lr=0.16,0.8,4,20 --set init-weights=$PRE/fmnist-mnist-cnn.pt \
    --set train-layers=all --set epochs=10 --set threads=1 --validation 10000 --out results/sweeps/mnist-dpsgd-pretrained-fmnist-all --quiet
$FEDSD sweep --dataset fmnist --method dpsgd --epsilon 3 --grid lr=0.6,3,15,75 --set init-weights=$PRE/mnist-mnist-cnn.pt \
    --set train-layers=all --set epochs=10 --set threads=1 --validation 10000 --out results/sweeps/fmnist-dpsgd-pretrained-mnist-all --quiet
for d in mnist fmnist; do
  if [ $d = mnist ]; then pub=fmnist; else pub=mnist; fi
  lr=$(.venv/bin/python -c "import json,sys; r=json.load(open(sys.argv[1]))['runs']; print(max(r, key=lambda x: x['validation_mean'] or -1)['settings']['lr'])" results/sweeps/$d-dpsgd-pretrained-$pub-all/sweep.json)
  for seed in 0 1 2; do
    out=$RUNS/$d-from-$pub-all-lr$lr-e10-seed$seed
    if [ -f $out/result.json ]; then continue; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; continue; fi
    $FEDSD train --dataset $d --method dpsgd --epsilon 3 --init-weights $PRE/$pub-mnist-cnn.pt --train-layers all \
        --epochs 10 --lr $lr --seed $seed --threads 1 --out $out --overwrite --quiet --log-dir off
  done
done

# 5. the control of step 4: the same network from its random start, the same 10 epochs
for d in mnist fmnist; do
  for seed in 0 1 2; do
    out=$RUNS/$d-scratch-all-e10-seed$seed
    if [ -f $out/result.json ]; then continue; elif [ -f $out/checkpoint.pt ]; then $FEDSD train --resume $out --quiet; continue; fi
    $FEDSD train --dataset $d --method dpsgd --epsilon 3 --epochs 10 --seed $seed --threads 1 --out $out --overwrite --quiet --log-dir off
  done
done
