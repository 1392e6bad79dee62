"""A data holder's own data: an image folder tree or an .npz file on its own machine.

The run's task (a built-in data set's shape and classes, or `dataset=custom` with `classes`,
`image-size`, `channels`) says what the model expects; the holder's files are decoded once,
converted and resized to that, checked, and cached on the holder's disk under a fingerprint of
their content. Flower starts a fresh ClientApp process for every message, so a later message
finds the prepared tensors instead of decoding the images again.

Normalisation uses fixed constants (the built-in data sets' standard ones, or the run's
`mean`/`std`), never statistics of the holder's data: those would be a release about the
private data that no accountant covers.

Layouts (torchvision's ImageFolder convention, or arrays):
  DIR/train/<class>/<image>  and optionally  DIR/test/<class>/<image>   (PNG or JPEG, any size)
  DIR/<class>/<image>        (a plain ImageFolder: training images only, as train/ without test/)
  FILE.npz with x_train (uint8, N×H×W or N×H×W×C), y_train (integers), optionally x_test, y_test
  (or a folder holding such a data.npz, as `fedsd split-data --format npz` writes)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fedsd.data import datasets as data_lib
from fedsd.files.atomic import save_atomic, write_json
from fedsd.files.cache import cache_root
from fedsd.data.datasets import BUILTIN_SHAPES, CUSTOM, STANDARD_STATS, ImageData, normalise, stratified_subset
from fedsd.errors import ConfigError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
# Bounds on a task's sizes: a run config is the server's, and a client prepares its data to it
# (a 100 000-pixel square or a million classes would only exhaust the client's memory).
MAX_IMAGE_SIZE, MAX_CLASSES = 512, 1000


@dataclass(frozen=True)
class Task:
    """What the model expects: classes (names in label order), channels, square image size,
    and the fixed normalisation constants."""

    classes: tuple[str, ...]
    channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.classes, self.channels, self.image_size]).encode()).hexdigest()[:16]


def builtin_task(dataset: str) -> Task:
    """A built-in data set's task: classes named by their label ("0" … "9")."""
    channels, size = BUILTIN_SHAPES[dataset]
    mean, std = STANDARD_STATS[dataset]
    return Task(tuple(str(i) for i in range(10)), channels, size, mean, std)


@dataclass
class HolderData:
    """Prepared uint8 images (N, C, H, W) and int64 labels; the test split may be empty."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    fingerprint: str  # of the files' content: the key of the holder's privacy ledger
    source: str
    named_fingerprint: str = ""  # fedsd 0.1.0's, which hashed the file names too (_named_fingerprint)
    skipped: list[str] = field(default_factory=list)  # unreadable files left out (skip_bad_files)


def _content_fingerprint(path: Path, files: list[Path]) -> str:
    """The data's content, whatever its files are called (its ledger's key): an .npz's bytes, or
    for a folder each image's bytes with the folders it lies in (its split and class), sorted, so
    neither renaming nor reordering files makes a fresh data set with a fresh budget."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()[:32]
    entries = sorted(f"{'/'.join(f.relative_to(path).parts[:-1])}\0{hashlib.sha256(f.read_bytes()).hexdigest()}"
                     for f in files)
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:32]


def _named_fingerprint(path: Path, files: list[Path]) -> str:
    """The fingerprint of fedsd 0.1.0, which hashed file names too: kept to find a ledger that
    version wrote (fedsd.privacy.lifetime_ledger.adopt), so an upgrade does not start a data set's budget again."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:32]


def _listing(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _stat_key(files: list[Path]) -> str:
    """Cheap to compute every message: names, sizes and modification times."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def is_plain_image_folder(path: Path) -> bool:
    """A plain ImageFolder: no train/, and class folders right under `path` holding images."""
    return (path.is_dir() and not (path / "train").exists() and not (path / "test").exists()
            and any(f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
                    for folder in path.iterdir() if folder.is_dir() for f in folder.iterdir()))


def split_roots(path: Path) -> dict[str, Path]:
    """The class folders' parent for each split a folder of images has: train/ and test/, or,
    in a plain ImageFolder, the folder itself as the training split (no test split)."""
    return {"train": path} if is_plain_image_folder(path) else {"train": path / "train", "test": path / "test"}


def data_file(path: Path) -> Path:
    """`path`, or for a folder of `fedsd split-data --format npz` (a data.npz, no train/) its data.npz."""
    if path.is_dir() and not (path / "train").exists() and (path / "data.npz").is_file():
        return path / "data.npz"
    return path


@dataclass(frozen=True)
class DataIdentity:
    """What a holder's files are, without their images: the fingerprints its ledger is kept
    under and the files left out (HolderData's fields of the same names)."""

    fingerprint: str
    source: str
    named_fingerprint: str = ""
    skipped: list[str] = field(default_factory=list)


def known_holder_data(data: str | os.PathLike, task: Task, cache_dir: str | os.PathLike,
                      skip_bad_files: bool = False) -> DataIdentity | None:
    """The holder's data as its cache knows it, unchanged files and prepared for `task`, without
    reading a file of it (a data service asks at every message, and trains from the data it
    prepared once); None where `load_holder_data` would read or prepare. Raises as it does."""
    path, index, _, _ = _index_of(data, task, cache_dir, skip_bad_files)
    if not index.is_file():
        return None
    fingerprint, named, skipped = _indexed(index)
    return DataIdentity(fingerprint, str(path), named, skipped) if \
        _prepared(cache_dir, fingerprint, task).is_file() else None


def _indexed(index: Path) -> tuple[str, str, list[str]]:
    """The fingerprint, fedsd 0.1.0's named fingerprint and the files left out, as an index keeps them."""
    known = json.loads(index.read_text())
    return known["fingerprint"], known.get("named_fingerprint", ""), known.get("skipped", [])


def _prepared(cache_dir, fingerprint: str, task: Task) -> Path:
    return Path(cache_dir) / f"prepared-{fingerprint}-{task.key}.pt"


def _index_of(data, task: Task, cache_dir, skip_bad_files: bool) -> tuple[Path, Path, list[Path], bool]:
    """The data's file, the cache index for its files' names, sizes and times, its files, and
    whether unreadable images are left out; DataError where the data is not there or not a kind read here."""
    path = Path(data).expanduser()
    if not path.exists():
        raise DataError(f"data={path}: no such file or folder")
    path = data_file(path)
    if path.is_file() and path.suffix != ".npz":
        raise DataError(f"data={path}: expected a folder (train/<class>/<image>, or <class>/<image>) or an .npz file")
    files = _listing(path)
    # Names, sizes and times map to the content's fingerprint, so an unchanged folder is not
    # read and hashed again on every message; changed (or copied) files are hashed once more.
    skip = skip_bad_files and path.is_dir()
    return path, Path(cache_dir) / f"index-v2-{_stat_key(files)}{'-skip' if skip else ''}.json", files, skip


def load_holder_data(data: str | os.PathLike, task: Task, cache_dir: str | os.PathLike,
                     skip_bad_files: bool = False) -> HolderData:
    """The holder's data prepared for `task`, from its cache when the files are unchanged.
    Raises DataError naming the file and the problem; with `skip_bad_files` an unreadable
    image is left out instead (HolderData.skipped names them), and the fingerprint, so the
    ledger, is that of the readable files: the same samples are charged to the same ledger
    whether or not an unreadable file lies beside them."""
    path, index, files, skip = _index_of(data, task, cache_dir, skip_bad_files)
    cache = Path(cache_dir)
    arrays, skipped = None, []
    if index.is_file():
        fingerprint, named, skipped = _indexed(index)
    else:
        if skip:  # which files are readable is known only once they are decoded
            arrays, skipped = _load_folder(path, task, skip=True)
        readable = [f for f in files if str(f.relative_to(path) if f != path else f.name) not in skipped]
        fingerprint, named = _content_fingerprint(path, readable), _named_fingerprint(path, readable)
    prepared = _prepared(cache, fingerprint, task)
    if arrays is None and prepared.is_file():
        arrays = torch.load(prepared, weights_only=True)
    elif arrays is None:
        arrays, skipped = (_load_npz(path, task), []) if path.is_file() else _load_folder(path, task, skip)
    if not prepared.is_file():
        if not len(arrays["y_train"]):
            raise DataError(f"data={path}: the training split is empty"
                            + (f" ({len(skipped)} unreadable file(s) left out)" if skipped else ""))
        cache.mkdir(parents=True, exist_ok=True)
        save_atomic(prepared, arrays)
    if not index.is_file():
        write_json(index, {"fingerprint": fingerprint, "named_fingerprint": named, "data": str(path),
                           "skipped": skipped})
    return HolderData(**arrays, fingerprint=fingerprint, source=str(path), skipped=skipped, named_fingerprint=named)


def _to_task(images: torch.Tensor, task: Task, what: str) -> torch.Tensor:
    """uint8 (N, C, H, W) in the task's channels and size: grey ↔ RGB converted, resized with
    antialiasing when the size differs."""
    from torchvision.transforms.v2 import functional as TF

    c = images.shape[1]
    if c not in (1, 3, 4):
        raise DataError(f"{what}: {c} channels; expected 1 (grey), 3 (RGB) or 4 (RGBA)")
    if c == 4:
        images, c = images[:, :3], 3
    if c != task.channels:
        images = TF.rgb_to_grayscale(images) if task.channels == 1 else images.expand(-1, 3, -1, -1)
    if tuple(images.shape[2:]) != (task.image_size, task.image_size):
        images = TF.resize(images, [task.image_size, task.image_size], antialias=True)
    return images.contiguous()


def _labels(raw: np.ndarray, task: Task, what: str) -> torch.Tensor:
    if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer):
        raise DataError(f"{what}: labels must be one integer per image, got dtype {raw.dtype}, shape {raw.shape}")
    bad = raw[(raw < 0) | (raw >= len(task.classes))]
    if len(bad):
        raise DataError(f"{what}: label {int(bad[0])} is out of range: the task has {len(task.classes)} classes "
                        f"(labels 0 … {len(task.classes) - 1})")
    return torch.from_numpy(raw.astype(np.int64))


def _load_npz(path: Path, task: Task) -> dict:
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001  (a corrupt file: name it and say why)
        raise DataError(f"data={path}: not a readable .npz file ({e})") from None
    with z:
        for key in ("x_train", "y_train"):
            if key not in z.files:
                raise DataError(f"data={path}: no array {key!r}; it holds {', '.join(z.files) or 'nothing'}")
        out = {}
        for split in ("train", "test"):
            if f"x_{split}" not in z.files:
                out[f"x_{split}"] = torch.zeros((0, task.channels, task.image_size, task.image_size), dtype=torch.uint8)
                out[f"y_{split}"] = torch.zeros(0, dtype=torch.long)
                continue
            x, y = z[f"x_{split}"], z.get(f"y_{split}")
            what = f"data={path} x_{split}"
            if x.dtype != np.uint8:
                raise DataError(f"{what}: dtype {x.dtype}; expected uint8 pixels (0 … 255)")
            if x.ndim == 3:
                x = x[:, :, :, None]
            if x.ndim != 4:
                raise DataError(f"{what}: shape {x.shape}; expected N×H×W or N×H×W×C")
            if y is None or len(y) != len(x):
                raise DataError(f"data={path} y_{split}: expected {len(x)} labels, one per image in x_{split}")
            images = torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2)
            out[f"x_{split}"] = _to_task(images, task, what)
            out[f"y_{split}"] = _labels(np.asarray(y), task, f"data={path} y_{split}")
    return out


def _load_folder(path: Path, task: Task, skip: bool = False) -> tuple[dict, list[str]]:
    """The folder's splits, and the unreadable images left out (skip; else DataError)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    mode = ImageReadMode.GRAY if task.channels == 1 else ImageReadMode.RGB
    out, skipped = {}, []
    roots = split_roots(path)
    for split in ("train", "test"):
        root = roots.get(split)
        images, labels = [], []
        if root is not None and root.is_dir():
            for folder in sorted(p for p in root.iterdir() if p.is_dir()):
                if folder.name not in task.classes:
                    raise DataError(f"data={folder}: class folder {folder.name!r} is not one of the task's "
                                    f"classes ({', '.join(task.classes)})")
                label = task.classes.index(folder.name)
                for f in sorted(folder.iterdir(), key=_natural):
                    if f.suffix.lower() not in IMAGE_SUFFIXES:
                        continue
                    try:
                        image = decode_image(read_file(str(f)), mode=mode)
                    except Exception:  # noqa: BLE001  (whatever the decoder raises: name the file)
                        if skip:
                            skipped.append(str(f.relative_to(path)))
                            continue
                        raise DataError(f"data={f}: not a readable PNG or JPEG image; start the SuperNode "
                                        f"with --node-config \"skip-bad-files=true ...\" to train on the "
                                        f"readable ones") from None
                    images.append(_to_task(image[None], task, f"data={f}")[0])
                    labels.append(label)
        elif split == "train":
            raise DataError(f"data={path}: no train/ folder and no class folder of images (expected "
                            f"train/<class>/<image>, or <class>/<image>)")
        shape = (0, task.channels, task.image_size, task.image_size)
        out[f"x_{split}"] = torch.stack(images) if images else torch.zeros(shape, dtype=torch.uint8)
        out[f"y_{split}"] = torch.tensor(labels, dtype=torch.long)
    return out, skipped


def _natural(path: Path) -> tuple:
    """File order 2.png before 10.png: numbered files load in their numbers' order."""
    return (0, int(path.stem), "") if path.stem.isdigit() else (1, 0, path.name)


def input_stats(cfg) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The (mean, std) a run normalises its inputs with: --mean / --std, else the task's fixed
    constants (ConfigError naming the option when they do not fit the task)."""
    task = task_for(cfg)
    return tuple(task.mean), tuple(task.std)


def normalised(images: torch.Tensor, task: Task) -> torch.Tensor:
    """float32 in [0, 1], then normalised with the task's fixed constants."""
    return normalise(images, task.mean, task.std)


def _floats(text: str, option: str, channels: int) -> tuple[float, ...]:

    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{option}: comma-separated numbers, one per channel, got {text!r}") from None
    if len(values) != channels:
        raise ConfigError(f"{option}: {channels} value(s), one per channel, got {text!r}")
    return values


def task_for(cfg) -> Task:
    """The task a (resolved) TrainConfig describes; ConfigError naming the setting when the
    task and the model do not fit."""

    if cfg.dataset != CUSTOM:
        task = builtin_task(cfg.dataset)
    else:
        classes = tuple(c.strip() for c in cfg.classes.split(",") if c.strip())
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise ConfigError(f"--classes: dataset=custom needs two or more distinct class names in label order, "
                              f"comma-separated, got {cfg.classes!r}")
        if cfg.channels not in (1, 3):
            raise ConfigError(f"--channels: dataset=custom needs 1 (grey) or 3 (RGB), got {cfg.channels}")
        if len(classes) > MAX_CLASSES:
            raise ConfigError(f"--classes: at most {MAX_CLASSES} classes, got {len(classes)}")
        if not 8 <= cfg.image_size <= MAX_IMAGE_SIZE:
            raise ConfigError(f"--image-size: dataset=custom needs a size in [8, {MAX_IMAGE_SIZE}], "
                              f"got {cfg.image_size}")
        # Fixed constants, never the data's own statistics: 0.5 maps [0, 1] to [-1, 1].
        task = Task(classes, cfg.channels, cfg.image_size, (0.5,) * cfg.channels, (0.5,) * cfg.channels)
    mean = _floats(cfg.mean, "--mean", task.channels) if cfg.mean else task.mean
    std = _floats(cfg.std, "--std", task.channels) if cfg.std else task.std
    if any(v <= 0 for v in std):
        raise ConfigError(f"--std: every value must be > 0, got {cfg.std!r}")
    needs = {"mnist-cnn": "1 channel, 28×28 images", "cifar-cnn": "3 channels"}
    fits = (task.channels, task.image_size) == (1, 28) if cfg.model == "mnist-cnn" else task.channels == 3
    if cfg.model in needs and not fits:  # any other network is checked on one sample (models.check_fits_task)
        hint = ("; for your own images, pass --model cifar-cnn --channels 3 (grey images are converted), or "
                "--channels 1 --image-size 28 for mnist-cnn" if cfg.dataset == CUSTOM else "")
        raise ConfigError(f"--model: {cfg.model} takes {needs[cfg.model]}; the task has {task.channels} channel(s) "
                          f"at {task.image_size}×{task.image_size}{hint}")
    return Task(task.classes, task.channels, task.image_size, mean, std)


# Custom data trained centrally or in a simulation (`fedsd train|simulate --dataset custom
# --data-dir D`): the formats a SuperNode takes, the task read from the files where not given.
# Data without a test split gets one: this share of the training samples, class-stratified and
# drawn with a fixed seed, so that runs of every seed are judged on the same held-out samples.
CUSTOM_TEST_SHARE = 0.2
CUSTOM_TEST_SEED = 104729
CUSTOM_LAYOUTS = ("a folder train/<class>/<image> (PNG or JPEG; optionally test/<class>/<image>), a folder "
                  "<class>/<image> (torchvision's ImageFolder), or an .npz file with x_train (uint8, N×H×W or "
                  "N×H×W×C) and y_train (optionally x_test, y_test)")


def custom_path(cfg) -> Path:
    """A custom run's data: --data-dir, which must exist (a folder, an .npz, or a folder of data.npz)."""

    if not cfg.data_dir:
        raise ConfigError(f"--data-dir: --dataset custom trains on files of your own; pass --data-dir with "
                          f"{CUSTOM_LAYOUTS}")
    path = Path(cfg.data_dir).expanduser()
    if not path.exists():
        raise ConfigError(f"--data-dir {cfg.data_dir}: no such file or folder")
    path = data_file(path)
    if not (path.suffix == ".npz" and path.is_file()) and not (path / "train").is_dir() \
            and not is_plain_image_folder(path):
        raise ConfigError(f"--data-dir {cfg.data_dir}: expected {CUSTOM_LAYOUTS}")
    return path


@dataclass(frozen=True)
class FoundTask:
    """What a custom data set's files say of its task (image_size 0: the images differ in size)."""

    classes: tuple[str, ...]
    channels: int
    sizes: tuple[tuple[int, int], ...]  # the (height, width) seen

    @property
    def image_size(self) -> int:
        """The images' one square size, else 0."""
        h, w = self.sizes[0]
        return h if len(self.sizes) == 1 and h == w else 0


def describe(path: Path) -> FoundTask:
    """The classes (folder names, sorted as torchvision's ImageFolder sorts them; an .npz's
    labels 0 … K−1 as names), channels (1 grey, 3 colour) and square size of a custom data set,
    read from its labels and from a few images per class."""
    if path.is_file():
        try:
            shape = _npz_shape(path, "x_train")  # the images are read once, by the loader, not here
            with np.load(path, allow_pickle=False) as z:
                labels = [z["y_train"]] + ([z["y_test"]] if "y_test" in z.files else [])
        except (KeyError, ValueError, OSError, zipfile.BadZipFile) as e:
            raise DataError(f"data={path}: not an .npz with x_train and y_train ({e})") from None
        if len(shape) not in (3, 4) or not shape[0]:
            raise DataError(f"data={path} x_train: shape {shape}; expected N×H×W or N×H×W×C")
        count = max(int(np.max(y)) for y in labels if len(y)) + 1
        channels = 1 if len(shape) == 3 or shape[3] in (1, 2) else 3
        return FoundTask(tuple(str(i) for i in range(count)), channels, ((int(shape[1]), int(shape[2])),))
    from torchvision.io import ImageReadMode, decode_image, read_file

    folders = sorted((p for p in split_roots(path)["train"].iterdir() if p.is_dir()), key=lambda p: p.name)
    channels, sizes = 1, set()
    for folder in folders:
        for f in sorted((f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES), key=_natural)[:3]:
            try:
                image = decode_image(read_file(str(f)), mode=ImageReadMode.UNCHANGED)
            except Exception:  # noqa: BLE001  (the loader names unreadable files; skip-bad-files may leave them out)
                continue
            channels = max(channels, 1 if image.shape[0] in (1, 2) else 3)
            sizes.add((int(image.shape[1]), int(image.shape[2])))
    if not sizes:
        raise DataError(f"data={path}: no readable PNG or JPEG image under "
                        f"{'<class>/' if is_plain_image_folder(path) else 'train/<class>/'}")
    return FoundTask(tuple(p.name for p in folders), channels, tuple(sorted(sizes)))


def training_records(path: Path) -> int:
    """How many training images a holder's data holds (an .npz's x_train from its header, or an
    image folder's files under train/ or its class folders), without decoding any; DataError
    when it holds none that can be counted."""
    path = data_file(Path(path))
    try:
        if path.is_file():
            return int(_npz_shape(path, "x_train")[0])
        root = split_roots(path)["train"]
        return sum(1 for folder in root.iterdir() if folder.is_dir()
                   for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    except (KeyError, ValueError, OSError, IndexError, zipfile.BadZipFile) as e:
        raise DataError(f"data={path}: no training images to count ({type(e).__name__})") from None


def _npz_shape(path: Path, key: str) -> tuple[int, ...]:
    """The shape of array `key` in an .npz, from its header alone (KeyError when it has none)."""
    with zipfile.ZipFile(path) as archive, archive.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        return tuple(read(f)[0])


def with_custom_task(cfg):
    """dataset=custom: a copy of `cfg` with the classes, channels and image size the files say,
    where the run does not give them (every party of a simulation reads the same files, so all
    agree). Other data sets: `cfg` as it is."""

    if cfg.dataset != CUSTOM or (cfg.classes and cfg.channels and cfg.image_size):
        return cfg
    found = describe(custom_path(cfg))
    size = cfg.image_size or found.image_size
    if not size:
        seen = ", ".join(f"{h}×{w}" for h, w in found.sizes[:4]) + (", …" if len(found.sizes) > 4 else "")
        raise ConfigError(f"--image-size: the images are not all one square size ({seen}); pass --image-size N "
                          f"to resize every image to N×N")
    if size > MAX_IMAGE_SIZE and not cfg.image_size:
        raise ConfigError(f"--image-size: the images are {size}×{size}, above {MAX_IMAGE_SIZE}; pass --image-size N "
                          f"(at most {MAX_IMAGE_SIZE}) to resize them")
    return dataclasses.replace(cfg, classes=cfg.classes or ",".join(found.classes),
                               channels=cfg.channels or found.channels, image_size=size)


def custom_images(cfg):
    """A custom run's data as a data_lib.ImageData (its test split held out from the training
    samples when the files have none: CUSTOM_TEST_SHARE, stratified, seeded; `source` says so).
    `cfg` has its task (with_custom_task). The prepared tensors are cached on this machine
    (fedsd.cache_root()/custom-data), so a simulation's Ray workers decode the images once."""

    path, task = custom_path(cfg), task_for(cfg)
    held = load_holder_data(path, task, cache_root() / "custom-data", skip_bad_files=False)
    x_train, y_train, x_test, y_test, source = held.x_train, held.y_train, held.x_test, held.y_test, str(path)
    if not len(y_test):
        n = len(y_train)
        size = max(1, round(CUSTOM_TEST_SHARE * n))
        if n - size < 1:
            raise DataError(f"data={path}: {n} training sample(s), too few to hold a test split out of")
        test = stratified_subset(y_train, size, CUSTOM_TEST_SEED)
        keep = torch.ones(n, dtype=torch.bool)
        keep[test] = False
        x_train, y_train, x_test, y_test = x_train[keep], y_train[keep], x_train[test], y_train[test]
        source += (f" (no test split: {size} of its {n} training samples, {CUSTOM_TEST_SHARE:.0%}, held out as the "
                   f"test split, class-stratified with a fixed seed)")
    return ImageData("custom", x_train, y_train, x_test, y_test, source, stats=(task.mean, task.std),
                     class_count=len(task.classes))


def run_images(cfg):
    """The labelled images a run trains and tests on: a built-in data set, or (dataset=custom,
    `cfg` with its task) the files at --data-dir."""

    if cfg.dataset == CUSTOM:
        return custom_images(cfg)
    return data_lib.load(cfg.dataset, cfg.data_dir, cfg.download)
