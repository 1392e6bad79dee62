"""Handcrafted features (`--features scatter`): Tramèr & Boneh's ScatterNet (ICLR 2021,
"Differentially Private Learning Needs Better Features").

A wavelet scattering transform (kymatio; J = 2 scales, L = 8 angles) maps each image of C
channels, H×W, to C·81 channels of H/4 × W/4: its local averages and the averaged moduli of its
first- and second-order wavelet coefficients. The transform is fixed (no training, no data
statistics) and applied to one sample at a time, so computing it costs no privacy: DP-SGD then
trains a small network on the features (fedsd.models.networks: scatter-linear, scatter-cnn), which
normalise them with GroupNorm, per sample (--feature-norm group) or, as Tramèr & Boneh did for
MNIST and CIFAR-10, with the training set's per-channel mean and variance released with Gaussian
noise (--feature-norm private: `private_statistics`, its ε composed into the run's).

Each party computes the features of its own images (a federated client: its shard or its own
files). They are cached on that machine's disk, keyed by the images' bytes and the transform's
settings, as float16 (CIFAR-10's 60,000 images: 1.9 GB instead of 3.7 GB in float32); a cache
whose settings or data do not match has another key, so it is made anew, never reused.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from fedsd.files.cache import cache_root
from fedsd.errors import ConfigError

FEATURES = ("none", "scatter", "backbone")  # backbone: a pretrained network's frozen blocks (backbone_features)
# group: GroupNorm in the network (fedsd.models.networks), each sample on its own, free of privacy cost;
# private: Tramèr & Boneh's "frozen BatchNorm" (their dp_utils.scatter_normalization), below.
FEATURE_NORMS = ("group", "private")
NORM_RELEASES = 2  # the mean and the mean square per channel: two Gaussian releases
NORM_EPS = 1e-5  # BatchNorm's ε, as in their frozen BatchNorm
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
    digest.update(repr((CACHE_FORMAT, SCATTER_J, SCATTER_L, kymatio.__version__, tuple(x.shape),
                        str(x.dtype))).encode())
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
    cached = _cached(path, shape, np.float16)
    if cached is not None:
        return cached
    from tqdm.auto import tqdm

    transform = scattering_class()(J=SCATTER_J, shape=(h, w), L=SCATTER_L)
    out = np.empty(shape, dtype=np.float16)
    with torch.no_grad():
        for start in tqdm(range(0, n, CHUNK), desc=f"scattering {n} {what}", unit="chunk", leave=False,
                          disable=None):
            part = transform(x[start:start + CHUNK])  # (n, C, 81, H/4, W/4)
            out[start:start + len(part)] = part.reshape(len(part), *shape[1:]).numpy().astype(np.float16)
    _save(folder, path, out)
    return torch.from_numpy(out)


def inputs(x: torch.Tensor, features, what: str = "images") -> torch.Tensor:
    """What the model takes: the normalised images themselves, or their features (`features`:
    "none", "scatter", or a Backbone: fedsd.models.networks.feature_source)."""
    if isinstance(features, Backbone):
        return backbone_features(x, features, what)
    if features == "backbone":
        raise ValueError("--features backbone: the inputs are made with the run's Backbone "
                         "(fedsd.models.networks.feature_source)")
    return x if features == "none" else scattered(x, what)


@dataclass(frozen=True)
class Backbone:
    """A pretrained network's frozen blocks (--features backbone with --init-weights; built by
    fedsd.models.networks.backbone_for): `module` in eval mode, `key` naming the weights (their file's
    sha256) and the cut, `shape` of one sample's output as kept: flat features as (D, 1, 1)."""
    module: torch.nn.Module
    key: str
    shape: tuple[int, int, int]


BACKBONE_FORMAT = 1


def backbone_features(x: torch.Tensor, backbone: Backbone, what: str = "images") -> torch.Tensor:
    """The frozen blocks' output for images `x` (float32, (N, *backbone.shape)), computed once
    on this machine, in eval mode and in chunks, and cached as ScatterNet features are (keyed by
    the images' bytes, the weights' sha256 and the cut: other images or weights make a new file)."""
    x = x.detach().to("cpu", torch.float32)
    shape = (len(x), *backbone.shape)
    digest = hashlib.sha256(repr((BACKBONE_FORMAT, backbone.key, tuple(x.shape))).encode())
    digest.update(x.contiguous().numpy().tobytes())
    folder = cache_root() / "features"
    path = folder / f"backbone-{digest.hexdigest()[:32]}.npy"
    cached = _cached(path, shape, np.float32)
    if cached is not None:
        return cached
    from tqdm.auto import tqdm

    out = np.empty(shape, dtype=np.float32)
    module = backbone.module.eval()
    with torch.no_grad():
        for start in tqdm(range(0, len(x), CHUNK), desc=f"backbone features of {len(x)} {what}", unit="chunk",
                          leave=False, disable=None):
            part = module(x[start:start + CHUNK])
            out[start:start + len(part)] = part.reshape(len(part), *backbone.shape).numpy()
    _save(folder, path, out)
    return torch.from_numpy(out)


def _cached(path, shape: tuple, dtype) -> torch.Tensor | None:
    """Features kept in `path` of this shape and type, or None (none there, or unreadable: a
    machine that crashed while writing; made again)."""
    if path.is_file():
        try:
            cached = np.load(path, mmap_mode="r", allow_pickle=False)
            if cached.shape == shape and cached.dtype == dtype:
                return torch.from_numpy(np.array(cached))
        except (OSError, ValueError):
            pass
    return None


def _save(folder, path, array) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# The order of each of the 81 scattering channels of one image channel, in kymatio's layout: the
# local average (order 0), J·L first-order moduli, then the second-order ones.
SCATTER_ORDER = torch.tensor([0] + [1] * SCATTER_J * SCATTER_L + [2] * (SCATTER_CHANNELS - 1 - SCATTER_J * SCATTER_L))
ORDERS = 3
# Per image channel and scattering order, the L2 bounds of a sample's per-channel feature means
# and mean squares (norm_bounds). Chosen once, as a default learning rate is, from 3,000 training
# images each of MNIST, Fashion-MNIST and CIFAR-10 (never from a run's data): their largest
# norms per order are, for the means, 1.21 / 0.63 / 0.18 (CIFAR-10's order 0: 1.69), and for the
# mean squares 1.96 / 0.19 / 0.011 (CIFAR-10's order 0: 3.27), so almost nothing is clipped.
MEAN_BOUNDS = (1.5, 0.7, 0.2)
SQUARE_BOUNDS = (2.5, 0.2, 0.01)


def norm_bounds(image_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each feature channel's bound (K,) for the means and for the mean squares: its order's,
    times √C (C image channels concatenate C such vectors).

    Tramèr & Boneh clip the whole vector at the data's median norm (a leak they name:
    "technically a small privacy leak"), and with one bound for all channels the noise is the
    same on each: the second-order channels, whose variance is 10⁴ times smaller than the local
    average's, get noise larger than their spread (MNIST, validation: 98.05 % with one bound of
    2, against 98.73 % with the exact statistics). A bound per order puts the noise where each
    order's scale is."""
    order = SCATTER_ORDER.repeat(image_channels)
    scale = math.sqrt(image_channels)
    return torch.tensor(MEAN_BOUNDS)[order] * scale, torch.tensor(SQUARE_BOUNDS)[order] * scale


def normalisation_prior(noise_multiplier: float) -> tuple:
    """What the private statistics spend, as accountant entries (σ, q, steps): two Gaussian
    releases over the whole training set (q = 1)."""
    return ((float(noise_multiplier), 1.0, NORM_RELEASES),)


def _per_sample(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's per-channel spatial mean and mean square (N, K) in float32, in chunks (the
    features are float16; CIFAR-10's in float32 would take 3.7 GB)."""
    means, squares = [], []
    for part in features.split(4 * CHUNK):
        flat = part.float().flatten(2)
        means.append(flat.mean(-1))
        squares.append(flat.square().mean(-1))
    return torch.cat(means), torch.cat(squares)


def _clipped_sum(rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The sum over samples of `rows` (N, K) in units of `bounds`, each sample's part of each
    scattering order clipped to norm 1 there: one sample moves the sum by at most √ORDERS."""
    scaled = rows / bounds
    order = SCATTER_ORDER.repeat(rows.shape[1] // SCATTER_CHANNELS)
    for k in range(ORDERS):
        part = scaled[:, order == k]
        scaled[:, order == k] = part / part.norm(dim=1, keepdim=True).clamp_min(1.0)
    return scaled.sum(0)


def private_statistics(features: torch.Tensor, image_channels: int, noise_multiplier: float,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel (mean, variance) of the training `features` (N, K, h, w), released with
    Gaussian noise: the sums of the samples' per-channel means and mean squares, each sample's
    part of each scattering order clipped to its bound (norm_bounds), so that one sample moves
    each sum by at most √ORDERS in units of the bounds; noise of std √ORDERS · `noise_multiplier`
    there, drawn from `generator`; divided by N. That is two Gaussian mechanisms at noise
    multiplier σ on the whole set (normalisation_prior), under add/remove-one adjacency with N
    taken as public, as Tramèr & Boneh do. The variance is E[f²] − E[f]², floored at 0."""
    n = len(features)
    mean_bounds, square_bounds = norm_bounds(image_channels)
    means, squares = _per_sample(features)

    def released(rows, bounds):
        noise = torch.normal(0.0, math.sqrt(ORDERS) * noise_multiplier, size=rows.shape[1:], generator=generator)
        return (_clipped_sum(rows, bounds) + noise) * bounds / n

    mean = released(means, mean_bounds)
    variance = (released(squares, square_bounds) - mean.square()).clamp_min(0.0)
    return mean, variance


def shift_and_scale(mean: torch.Tensor, variance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel (shift, scale) of a frozen BatchNorm, (x − shift) · scale, shaped to
    broadcast over (N, C, H, W)."""
    return mean.view(1, -1, 1, 1), (variance + NORM_EPS).rsqrt().view(1, -1, 1, 1)


def normalise(features: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
    """(features − mean) / √(variance + ε) per channel, as a frozen BatchNorm would, kept in
    float16 (made in chunks)."""
    shift, scale = shift_and_scale(mean, variance)
    out = torch.empty_like(features, dtype=torch.float16)
    for start in range(0, len(features), 4 * CHUNK):
        out[start:start + 4 * CHUNK] = ((features[start:start + 4 * CHUNK].float() - shift) * scale).half()
    return out


class FeatureMap(torch.nn.Module):
    """A released scatter model's features of new images, made on the fly (fedsd.load_model):
    the scattering transform, then the run's released statistics where it normalised by them
    (`statistics`: result.json's feature_statistics; None for GroupNorm, which is in the network)."""

    def __init__(self, image_size: int, statistics: dict | None = None):
        super().__init__()
        self.transform = scattering_class()(J=SCATTER_J, shape=(image_size, image_size), L=SCATTER_L)
        self.normalised = statistics is not None
        if self.normalised:
            shift, scale = shift_and_scale(torch.tensor(statistics["mean"]), torch.tensor(statistics["variance"]))
            self.register_buffer("mean", shift)
            self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.transform(x.contiguous())
        out = out.reshape(len(x), -1, *out.shape[-2:])
        return (out - self.mean) * self.scale if self.normalised else out
