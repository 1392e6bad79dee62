#!/bin/bash
# CIFAR-10's ScatterNet confirmation runs on the device: features-cifar10-plan.json, until $1 seconds from now.
# Carry .carry-cifar10.npz-{1,2,3} (cifar10.npz split in three pieces, carried by three calls back to back) and .whl
# (opacus, kymatio, appdirs wheels). $2: the sha256 of the whole file. Results: $OUT/runs.tgz.
t_end=$(( $(date +%s) + $1 ))
cat .carry-cifar10.npz-*/cifar10.npz.part* > /tmp/cifar10.npz && echo "$2  /tmp/cifar10.npz" | sha256sum -c - || exit 1
mkdir -p /tmp/data/cifar10 && mv /tmp/cifar10.npz /tmp/data/cifar10/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FEDSD_DATA_DIR=/tmp/data PYTHONUNBUFFERED=1 FEDSD_CACHE_DIR=/tmp/fcache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 results/gpu/run_plan.py $t_end results/gpu/features-cifar10-plan.json
tar tzf $OUT/runs.tgz | grep -c result.json
