"""Files written whole or not at all: a reader, or a run resumed after a crash, sees the old
file or the new one, never half of one."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; once written it replaces `path` in one rename
    (a reader, or a run resumed after a crash, sees the old file or the new one, never half of
    one). On failure the temporary file is removed. Durable: the file is flushed to the disk
    before the rename and the folder after it, so once this returns the new file survives a
    crash of the machine, not only of the process (a client's charge is on its disk before the
    update it paid for leaves)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
