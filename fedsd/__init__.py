"""fedsd: differentially private training with self-distillation (DP3SD, DPDSD) and baselines.

The algorithm library: data, models, losses, privacy accounting and the one DP training loop.
It imports nothing of Flower; `clients/` and `server/` adapt it to Flower.
"""
import os

# PyTorch's CPU allocator backs large tensors with transparent huge pages when this is set. A
# training step allocates hundreds of MB of activations and gradients and frees them again,
# and without huge pages the page faults of touching that fresh memory cost as much as the
# arithmetic: a cifar-cnn step takes 0.36 s with it and 0.55 s without (results/perf.md). It
# changes no result. It must be set before torch's first large allocation, which is why it is
# here, the first thing any fedsd process imports; a value the user set is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
