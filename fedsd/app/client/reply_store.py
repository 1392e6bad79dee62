"""A client's kept last reply, beside its privacy state on its own disk: a round asked again
after a restart (the server resumed from the round before, after this client had trained,
charged and answered it) is answered with the reply it already released, which releases nothing
new and is not charged again (fedsd/app/client/handler.py)."""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from fedsd.files.results import save_atomic
from fedsd.files.state_folder import read_nofollow

from fedsd.app.client.node_config import NodeConfig


REPLY_FORMAT = 1  # of a client's kept last reply (last_reply_file)


def client_state_file(node: NodeConfig, experiment_id: str, partition_id: int) -> Path | None:
    """Where this client keeps its privacy state on its own disk (NodeConfig.state_root), one
    file per experiment (the server's id for the run, kept across --resume) and client."""
    if not experiment_id:
        return None
    return node.state_folder(experiment_id) / f"client-{partition_id}.pt"


def last_reply_file(state_file: Path) -> Path:
    """Where a client keeps the last reply it released, beside its privacy state."""
    return state_file.with_name(f"{state_file.stem}-last-reply.pt")


def request_digest(server_round: int, arrays: ArrayRecord) -> str:
    """What a train request asks for: the round and the exact global model (model_digest). The
    run is fixed by the folder the reply is kept in."""
    return hashlib.sha256(f"round {server_round} {model_digest(arrays)}".encode()).hexdigest()


def replayed_reply(state_file: Path | None, request: str) -> tuple[ArrayRecord, dict, bool] | None:
    """The arrays and metrics this client already released for `request`, if it is the last
    request it answered; else None. An unreadable file is no reply (the round is trained and
    charged, the safe side)."""
    path = None if state_file is None else last_reply_file(state_file)
    if path is None or not state_file.is_file():
        return None
    try:
        raw = read_nofollow(path)
        if raw is None:
            return None
        kept = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception:  # noqa: BLE001  (a damaged file, or a link: train and charge instead)
        return None
    if not isinstance(kept, dict) or kept.get("format") != REPLY_FORMAT or kept.get("request") != request:
        return None
    return (ArrayRecord({k: Array(v.numpy()) for k, v in kept["arrays"].items()}), dict(kept["metrics"]),
            bool(kept.get("summed", False)))


def keep_reply(state_file: Path, request: str, arrays: ArrayRecord, metrics: dict, summed: bool = False) -> None:
    """Keep the reply about to be released (after the state that charged it is on disk: a
    client stopped between the two trains the round again and is charged again, never less)."""
    save_atomic(last_reply_file(state_file), dict(
        format=REPLY_FORMAT, request=request, metrics=metrics, summed=summed,
        arrays={k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in arrays.items()}))


# -- federated evaluation ----------------------------------------------------------------------
def model_digest(arrays: ArrayRecord) -> str:
    """The exact model a message carries: every array's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for key in sorted(arrays):
        a = arrays[key].numpy()
        digest.update(f"{key} {a.dtype} {a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()

