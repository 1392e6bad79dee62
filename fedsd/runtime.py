"""Process-wide settings that make fedsd's training fast, made only when an entry point asks.

Importing any part of fedsd changes nothing about the process. `tune_process()` does, and
fedsd's own entry points call it first thing: the `fedsd` command, the ClientApp and ServerApp
modules (Flower loads them in each process that runs them, Ray workers included), and the
Ray workers also inherit the environment variables from the `fedsd` process that starts Ray.
A program that uses fedsd as a library calls it itself, or not at all. FEDSD_TUNE_PROCESS=0
turns it off everywhere; a value you set for any variable below is kept.
"""
from __future__ import annotations

import getpass
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OPT_OUT_ENV = "FEDSD_TUNE_PROCESS"

# PyTorch's CPU allocator backs large tensors with transparent huge pages when this is set. A
# training step allocates hundreds of MB of activations and gradients and frees them again,
# and without huge pages the page faults of touching that fresh memory cost as much as the
# arithmetic (results/perf.md). It changes no result. PyTorch reads it at its first large
# allocation.
HUGE_PAGES = ("THP_MEM_ALLOC_ENABLE", "1")
# After each parallel region, PyTorch's OpenMP threads (GNU libgomp) spin for about 300,000
# iterations before they sleep, on cores that other threads need: book-keeping's conv kernel
# where it is built without OpenMP (fedsd.clipping.conv_kernel; built with it, it runs on those
# threads themselves), and other clients' processes on the same machine (results/perf.md).
# libgomp reads it when torch loads, so it only takes effect when set before `import torch`
# (or in a child process's environment).
OMP_SPIN = ("GOMP_SPINCOUNT", "10000")


def tune_process() -> dict:
    """Set fedsd's process-wide speed settings; returns what was set (empty when
    FEDSD_TUNE_PROCESS=0). Call it before importing torch for the OpenMP setting to apply."""
    if os.environ.get(OPT_OUT_ENV, "1") == "0":
        return {}
    done = {}
    for name, value in (HUGE_PAGES, OMP_SPIN):
        if name not in os.environ:
            os.environ[name] = value
            done[name] = value
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        done["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_by_isa()
    if keep_freed_memory():
        done["malloc"] = "freed memory kept in the heap (M_MMAP_MAX=0)"
    return done


def inductor_cache_by_isa(environ=os.environ) -> str:
    """Inductor's graph caches (torch 2.14) are not keyed by ATEN_CPU_CAPABILITY: a graph compiled
    under the CPU's own instruction set and reused under `ATEN_CPU_CAPABILITY=avx2` computed
    mnist-cnn's max-pool backward with garbage indices (tests/training/test_torch_inductor_maxpool.py).
    Each instruction-set setting gets its own cache folder, unless the user named one; returns it.
    Where fedsd compiles: `fedsd bench step`, and training (fedsd.training.compiled), whose
    bitwise check would catch such garbage and fall back to eager, but only after compiling.
    tune_process() sets it for the entry points."""
    if "TORCHINDUCTOR_CACHE_DIR" not in environ:
        isa = "-".join(environ.get(k, "native") for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
        try:
            user = getpass.getuser()
        except (KeyError, OSError):  # a uid with no name (an owner's service under its own uid)
            user = str(os.getuid())
        user = "".join(c for c in user if c.isalnum()) or "user"
        environ["TORCHINDUCTOR_CACHE_DIR"] = str(own_folder(Path(tempfile.gettempdir())
                                                            / f"torchinductor_{user}_{isa.lower()}"))
    return environ["TORCHINDUCTOR_CACHE_DIR"]


def own_folder(path: Path) -> Path:
    """`path`, made 0700 if new, where it is this user's own folder that nobody else may write
    in; else a new private folder beside it. The temporary folder is everybody's: a folder there
    that another user made first would give them code in this process (inductor loads the
    libraries and graphs it finds in its cache)."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"{path.name}-"))


_kept = False


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a step frees, for the next step to reuse.

    By default glibc returns every block of over 32 MB to the kernel when it is freed (mmap),
    and the next step's block of that size is fresh memory again, whose pages the kernel
    zeroes as they are first touched. A step allocates and frees many such blocks, a DP step
    more than a plain one (results/perf.md). With mmap off, freed blocks stay in the heap and
    are reused; the heap stays at its peak. Set MALLOC_MMAP_MAX_ yourself to keep glibc's way
    (glibc reads it when the process starts, so it is left alone). Returns whether it changed
    the allocator (only on glibc, once a process).
    """
    global _kept
    if _kept or not sys.platform.startswith("linux") or "MALLOC_MMAP_MAX_" in os.environ:
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; musl and others have none
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    _kept = True
    return True


# Ray's FutureWarning, at every start of Ray, that a future version stops overriding
# CUDA_VISIBLE_DEVICES for workers that take no GPU: this opts in to that behaviour now, which
# silences it (fedsd chooses each client's device itself). Ray reads it when it starts: the
# ClientApp's module sets it, which Flower's simulation engine imports before it starts Ray.
RAY_ACCELERATOR_NOTICE = ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def quiet_ray() -> None:
    """Silence Ray's accelerator notice (RAY_ACCELERATOR_NOTICE) unless the variable is set."""
    os.environ.setdefault(*RAY_ACCELERATOR_NOTICE)


def resolve_device(name: str) -> torch.device:
    """The device --device names: auto is a GPU where torch sees one, else the CPU; cuda without
    one is a ConfigError."""
    import torch

    from fedsd.errors import ConfigError

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device: cuda was asked for but torch sees no GPU; use cpu or auto")
    return torch.device(name)
