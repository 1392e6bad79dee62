#!/bin/bash
# `fedsd reproduce --table features --datasets cifar10` on the device, until $1 seconds
# from now: it runs what the table still needs (CIFAR-10's lr screen, then whatever stage it
# chooses next), skipping every run finished here. Carry .carry-cifar10.npz-{1,2,3}
# (cifar10.npz split in three pieces, carried by three calls back to back), .carry-whl (opacus,
# kymatio, appdirs wheels: the image has torch but not these) and .carry-runs/results.tgz (every
# finished run's result.json under results/runs/features and results/runs/readings: the readings'
# screen chooses each method's reading). $2: the sha256 of the whole file.
# Results: $OUT/runs.tgz, the runs made here (no checkpoints).
t_end=$(( $(date +%s) + $1 ))
cat .carry-cifar10.npz-*/cifar10.npz.part* > /tmp/cifar10.npz && echo "$2  /tmp/cifar10.npz" | sha256sum -c - || exit 1
mkdir -p /tmp/data/cifar10 && mv /tmp/cifar10.npz /tmp/data/cifar10/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry-whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FEDSD_DATA_DIR=/tmp/data PYTHONUNBUFFERED=1 FEDSD_CACHE_DIR=/tmp/fcache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/out/runs && tar xzf .carry-runs/results.tgz -C /tmp/out/runs && touch /tmp/carried
timeout $(( t_end - $(date +%s) )) python3 -m fedsd.cli.main reproduce --table features --datasets cifar10 \
    --device cuda --out /tmp/out 2>&1 | tr '\r' '\n' | grep -v '^\s*$' | awk '!seen[$0]++' | tail -n 40
cd /tmp/out/runs && find features -newer /tmp/carried -name result.json | sed 's|/result.json||' | sort > /tmp/made
tar czf $OUT/runs.tgz --exclude=checkpoint.pt -T /tmp/made && for d in $(cat /tmp/made); do
    python3 -c "import json,sys; r=json.load(open('$d/result.json')); print('$d', r.get('validation_accuracy'), r.get('test_accuracy'), round(r['wall_seconds']), r.get('device_name'))"; done
