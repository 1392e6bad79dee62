"""Result folders: result.json, model.pt and curve.png, written whole or not at all."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch


class OutputExistsError(FileExistsError):
    pass


def check_out_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before any work, an --out that exists and is not empty (unless overwrite)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"--out: {out} exists and is not empty; choose a new folder or pass --overwrite")
    return out


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


def write_json(path: Path, obj) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, path)


def _jsonable(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def save_model(path: Path, weights: dict[str, torch.Tensor]) -> None:
    torch.save({k: v.detach().cpu() for k, v in weights.items()}, path)


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
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_run(out: Path, result: dict, weights: dict[str, torch.Tensor], x_key: str) -> None:
    """The three files of a run, into a (staged) folder."""
    write_json(out / "result.json", result)
    save_model(out / "model.pt", weights)
    points = result["epochs"] if x_key == "epoch" else result["rounds"]
    title = f"{result['dataset']} {result['method']} ε={result['epsilon_target']}"
    plot_curve(out / "curve.png", points, x_key, title)
