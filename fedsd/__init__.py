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
# After each parallel region, PyTorch's OpenMP threads (GNU libgomp) spin for about 300,000
# iterations before they sleep. Book-keeping's conv kernel (fedsd.conv_kernel) runs on threads
# of its own right after PyTorch's backward pass, and those spinning threads took half the
# cores: at 2 threads its mnist-cnn convs took 8 + 11 ms, with 10,000 spins 4 + 6 ms, and the
# plain non-private step is no slower (results/perf.md). Read when torch loads, so set here.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def _keep_freed_memory() -> None:
    """Let glibc's malloc keep the memory a step frees, for the next step to reuse.

    By default glibc returns every block of over 32 MB to the kernel when it is freed (mmap),
    and the next step's block of that size is fresh memory again, whose pages the kernel
    zeroes as they are first touched. A step allocates and frees many such blocks, a DP step
    more than a plain one (the per-sample gradients, the kept activations). Measured on
    mnist-cnn at B = 1600, 2 threads: the DP step 90–96 → 70–73 ms, the plain step 73–76 →
    60–61 ms (results/perf.md). With mmap off, freed blocks stay in the heap and are reused;
    the heap stays at its peak. Set MALLOC_MMAP_MAX_ yourself to keep glibc's way (glibc reads
    it when the process starts, so it is left alone).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_MAX_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; musl and others have none
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


_keep_freed_memory()

__version__ = "0.1.0"


def cache_root():
    """fedsd's on-disk cache, shared by its processes and runs (calibrated σ, the built conv
    kernel): FEDSD_CACHE_DIR, else ~/.cache/fedsd (XDG_CACHE_HOME respected)."""
    from pathlib import Path

    return Path(os.environ.get("FEDSD_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd")
