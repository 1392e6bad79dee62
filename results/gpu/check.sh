#!/bin/bash
# The CUDA path's checks, one call of the device machine (results/README.md, "On a GPU"): every
# method, same seed twice, SIGKILL and resume, the step benchmark, resnet18 in physical batches,
# ScatterNet. Run from the repository root with .whl/ (opacus, kymatio, appdirs wheels: the image
# has torch but not these) and .devdata/ (MNIST's four files; cifar10/cifar10.npz, 2,400 train and
# 1,000 test images of CIFAR-10: the whole file is over what one call carries); $OUT gets the runs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FEDSD_DATA_DIR=$PWD/.devdata PYTHONUNBUFFERED=1 FEDSD_CACHE_DIR=/tmp/fcache
F="python3 -m fedsd.cli.main"
R=/tmp/runs; mkdir -p $R
step() { local name=$1; shift; local t0=$(date +%s); echo "=== $name: $*"; timeout ${T:-120} "$@" > $R/$name.log 2>&1; local rc=$?; echo "rc=$rc seconds=$(( $(date +%s) - t0 ))"; tail -n ${TAILN:-6} $R/$name.log; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, opacus, kymatio; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'opacus', opacus.__version__)"
for m in dpsgd dpema dpkd dp3sd dpdsd; do step mnist-$m $F train --dataset mnist --method $m --epsilon 3 --epochs 3 --seed 0 --out $R/mnist-$m --quiet; done
# same seed twice, then killed after epoch 1 and resumed: the same weights?
step again-dp3sd $F train --dataset mnist --method dp3sd --epsilon 3 --epochs 3 --seed 0 --out $R/again-dp3sd --quiet
( $F train --dataset mnist --method dp3sd --epsilon 3 --epochs 3 --seed 0 --out $R/killed-dp3sd --quiet > $R/killed.log 2>&1 & p=$!; while ! grep -qs '"epochs_done": [12]' $R/killed-dp3sd/progress.json; do sleep 0.2; done; kill -9 $p; wait $p; echo killed at $(cat $R/killed-dp3sd/progress.json) )
step resumed-dp3sd $F train --resume $R/killed-dp3sd --quiet
python3 - <<'P'
import torch
def w(d): return torch.load(f"/tmp/runs/{d}/model.pt", map_location="cpu", weights_only=False)
a, b, c = (w(d) for d in ("mnist-dp3sd", "again-dp3sd", "killed-dp3sd"))
sd = lambda m: m["state_dict"] if isinstance(m, dict) and "state_dict" in m else m
for name, x in (("again", b), ("resumed", c)):
    try:
        diffs = [float((sd(a)[k].float() - sd(x)[k].float()).abs().max()) for k in sd(a)]
        print(name, "max |dw| =", max(diffs))
    except Exception as e: print(name, "compare failed:", repr(e)[:300])
P
T=150 step bench-routes-mnist $F bench step --model mnist-cnn --device cuda --json
T=150 step bench-routes-cifar $F bench step --model cifar-cnn --device cuda --json
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $R/mem.log & smi=$!
T=200 step resnet18 $F train --model torchvision:resnet18 --dataset cifar10 --epochs 1 --subset 2000 --batch-size 1000 --epsilon 3 --out $R/resnet18 --quiet
kill $smi; echo "peak GPU memory used (MiB, whole card):" $(sort -n $R/mem.log | tail -1)
T=200 step scatter-group $F train --dataset mnist --features scatter --model scatter-linear --batch-size 4096 --lr 4 --epochs 5 --epsilon 3 --out $R/scatter-group --quiet
T=200 step scatter-private $F train --dataset mnist --features scatter --model scatter-linear --feature-norm private --batch-size 4096 --lr 4 --epochs 5 --epsilon 3 --out $R/scatter-private --quiet
step routes $F bench routes
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude=tensorboard runs && tar czf $OUT/models.tgz --exclude=checkpoint.pt --exclude=tensorboard runs/mnist-dp3sd/model.pt runs/scatter-private runs/resnet18/result.json
ls -la $OUT
