"""What travels between ServerApp and ClientApp, and what a client keeps in context.state.

A global model is named groups of weights ("student", and "ema" / "kd_teacher" where the method
has them); on the wire it is one ArrayRecord with keys "<group>/<parameter>", so every Flower
strategy aggregates all groups alike. Arrays travel as float32: an exact round trip.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedsd.training import Model, TrainState

STATE_ARRAYS = "fedsd.arrays"
STATE_CONFIG = "fedsd.privacy"


def model_to_record(model: Model) -> ArrayRecord:
    return ArrayRecord({f"{group}/{name}": Array(t.detach().cpu().numpy())
                        for group, weights in model.items() for name, t in weights.items()})


def record_to_model(record: ArrayRecord) -> Model:
    model: Model = {}
    for key, array in record.items():
        group, name = key.split("/", 1)
        model.setdefault(group, {})[name] = torch.from_numpy(np.array(array.numpy(), copy=True))
    return model


def save_state(store: RecordDict, state: TrainState) -> None:
    """Write a client's TrainState into its context.state (kept across rounds by Flower)."""
    arrays = {"rng": Array(state.rng_state.cpu().numpy())}
    for name, t in (state.local_model or {}).items():
        arrays[f"local_model/{name}"] = Array(t.detach().cpu().numpy())
    for i, t in enumerate(state.momentum or []):
        arrays[f"momentum/{i}"] = Array(t.detach().cpu().numpy())
    store[STATE_ARRAYS] = ArrayRecord(arrays)
    store[STATE_CONFIG] = ConfigRecord({"history": json.dumps(state.history), "steps": state.steps})


def load_state(store: RecordDict) -> TrainState | None:
    if STATE_CONFIG not in store:
        return None
    config, arrays = store[STATE_CONFIG], store[STATE_ARRAYS]
    tensors = {k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in arrays.items()}
    local_model = {k.split("/", 1)[1]: t for k, t in tensors.items() if k.startswith("local_model/")}
    momentum = [tensors[f"momentum/{i}"] for i in range(sum(k.startswith("momentum/") for k in tensors))]
    return TrainState(history=json.loads(config["history"]), rng_state=tensors["rng"], steps=int(config["steps"]),
                      local_model=local_model or None, momentum=momentum or None)
