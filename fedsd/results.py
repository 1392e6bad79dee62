"""Result folders: result.json, model.pt and curve.png, written whole or not at all."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from .errors import OutputExistsError  # noqa: F401 (also importable from here)


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before any work, an --out that exists and is not empty (unless overwrite)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"--out: {out} exists and is not empty; choose a new folder or pass --overwrite")
    return out


def fresh_out_dir(out: Path, overwrite: bool) -> None:
    """A run's folder that fills up as it goes (checkpoints, then result.json last): new, or
    emptied with overwrite (check_out_dir has already refused a non-empty one without it)."""
    if overwrite and out.is_dir():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


@contextmanager
def staged_out_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yield a scratch folder beside `out`; on success it replaces `out` in one rename, on failure
    it is removed, so `out` never holds half a result."""
    out = check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(scratch, out)


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; once written it replaces `path` in one rename
    (a reader, or a run resumed after a crash, sees the old file or the new one, never half of
    one). On failure the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")


def save_atomic(path: str | os.PathLike, obj) -> None:
    """torch.save, atomically (checkpoints, client privacy state)."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _jsonable(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_model(path: Path, weights: dict[str, torch.Tensor]) -> None:
    save_atomic(path, {k: v.detach().cpu() for k, v in weights.items()})


def plot_curve(path: Path, points: list[dict], x_key: str, title: str) -> None:
    """Test accuracy against epoch (or round)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[x_key] for p in points], [100 * p["test_accuracy"] for p in points], marker="o", ms=3)
    ax.set_xlabel(x_key)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def write_run(out: Path, result: dict, weights: dict[str, torch.Tensor], x_key: str) -> None:
    """The three files of a run, each written atomically, result.json last: a folder with a
    result.json holds a finished run."""
    save_model(out / "model.pt", weights)
    points = result["epochs"] if x_key == "epoch" else result["rounds"]
    title = f"{result['dataset']} {result['method']} ε={result['epsilon_target']}"
    plot_curve(out / "curve.png", points, x_key, title)
    write_json(out / "result.json", result)
