"""Handcrafted features (`--features scatter`): Tramèr & Boneh's ScatterNet (ICLR 2021,
"Differentially Private Learning Needs Better Features").

A wavelet scattering transform (kymatio; J = 2 scales, L = 8 angles) maps each image of C
channels, H×W, to C·81 channels of H/4 × W/4: its local averages and the averaged moduli of its
first- and second-order wavelet coefficients. The transform is fixed (no training, no data
statistics) and applied to one sample at a time, so computing it costs no privacy: DP-SGD then
trains a small network on the features (fedsd.models: scatter-linear, scatter-cnn), which
normalise them with GroupNorm, per sample.

Each party computes the features of its own images (a federated client: its shard or its own
files). They are cached on that machine's disk, keyed by the images' bytes and the transform's
settings, as float16 (CIFAR-10's 60,000 images: 1.9 GB instead of 3.7 GB in float32); a cache
whose settings or data do not match has another key, so it is made anew, never reused.
"""
from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import torch

from . import cache_root
from .errors import ConfigError

FEATURES = ("none", "scatter")
SCATTER_J, SCATTER_L = 2, 8
SCATTER_CHANNELS = 1 + SCATTER_J * SCATTER_L + SCATTER_L ** 2 * SCATTER_J * (SCATTER_J - 1) // 2  # 81
MIN_IMAGE_SIZE = 2 ** SCATTER_J * 4  # kymatio pads by 2^J a side; below this the averages see mostly padding
CHUNK = 256  # images transformed at once (bounded memory; a progress bar step)
CACHE_FORMAT = 1


def check_features(features: str, image_size: int) -> None:
    if features not in FEATURES:
        raise ConfigError(f"--features: unknown value {features!r}; choose one of {', '.join(FEATURES)}")
    if features == "scatter" and image_size < MIN_IMAGE_SIZE:
        raise ConfigError(f"--features scatter: needs images of at least 2^J · 4 = {MIN_IMAGE_SIZE} pixels a side "
                          f"(J = {SCATTER_J}), got {image_size}")
    if features == "scatter":
        scattering_class()  # kymatio importable


def feature_shape(channels: int, image_size: int) -> tuple[int, int, int]:
    """(channels, height, width) of the scattering features of (channels, size, size) images."""
    side = -(-image_size // 2 ** SCATTER_J)
    return channels * SCATTER_CHANNELS, side, side


def scattering_class():
    """kymatio's torch frontend, imported on its own: `import kymatio.torch` also imports its 3-D
    module, which needs scipy.special.sph_harm, removed in SciPy 1.15."""
    try:
        from kymatio.scattering2d.frontend.torch_frontend import ScatteringTorch2D
    except ImportError as e:
        raise ConfigError(f"--features scatter: needs kymatio (pip install kymatio): {e}") from e
    return ScatteringTorch2D


def _key(x: torch.Tensor) -> str:
    import kymatio

    digest = hashlib.sha256()
    digest.update(repr((CACHE_FORMAT, SCATTER_J, SCATTER_L, kymatio.__version__, tuple(x.shape), str(x.dtype))).encode())
    digest.update(x.contiguous().numpy().tobytes())
    return digest.hexdigest()[:32]


def scattered(x: torch.Tensor, what: str = "images") -> torch.Tensor:
    """The scattering features of images `x` (N, C, H, W, float32 as the run normalises them),
    as float16 (N, C·81, H/4, W/4): read from this machine's cache, else computed (a progress
    bar on a terminal) and cached."""
    x = x.detach().to("cpu", torch.float32)
    n, c, h, w = x.shape
    shape = (n, c * SCATTER_CHANNELS, -(-h // 2 ** SCATTER_J), -(-w // 2 ** SCATTER_J))
    folder = cache_root() / "features"
    path = folder / f"scatter-{_key(x)}.npy"
    if path.is_file():
        try:
            cached = np.load(path, mmap_mode="r", allow_pickle=False)
            if cached.shape == shape and cached.dtype == np.float16:
                return torch.from_numpy(np.array(cached))
        except (OSError, ValueError):
            pass  # unreadable (a machine that crashed while writing): made again
    from tqdm.auto import tqdm

    transform = scattering_class()(J=SCATTER_J, shape=(h, w), L=SCATTER_L)
    out = np.empty(shape, dtype=np.float16)
    with torch.no_grad():
        for start in tqdm(range(0, n, CHUNK), desc=f"scattering {n} {what}", unit="chunk", leave=False,
                          disable=None):
            part = transform(x[start:start + CHUNK])  # (n, C, 81, H/4, W/4)
            out[start:start + len(part)] = part.reshape(len(part), *shape[1:]).numpy().astype(np.float16)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, out)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return torch.from_numpy(out)


def inputs(x: torch.Tensor, features: str, what: str = "images") -> torch.Tensor:
    """What the model takes: the normalised images themselves, or their features."""
    return x if features == "none" else scattered(x, what)
