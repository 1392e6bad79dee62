"""What travels between ServerApp and ClientApp, and what a client keeps in context.state.

A global model is named groups of weights ("student", and "ema" / "kd_teacher" where the method
has them); on the wire it is one ArrayRecord with keys "<group>/<parameter>", so every Flower
strategy aggregates all groups alike. Arrays travel as float32: an exact round trip.
"""
from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedsd.privacy.accounting import PrivacyPlan
from fedsd.training.loop import Model, TrainState

STATE_ARRAYS = "fedsd.arrays"
STATE_CONFIG = "fedsd.privacy.accounting"
# A train request's config key: the ε its client reported spending in its earlier replies of
# this experiment. A client whose own privacy state holds less (its state-dir lost or replaced)
# refuses instead of starting its accountant again.
SPENT_EPSILON = "spent-epsilon"


def model_to_record(model: Model) -> ArrayRecord:
    return ArrayRecord({f"{group}/{name}": Array(t.detach().cpu().numpy())
                        for group, weights in model.items() for name, t in weights.items()})


def record_to_model(record: ArrayRecord) -> Model:
    model: Model = {}
    for key, array in record.items():
        group, name = key.split("/", 1)
        model.setdefault(group, {})[name] = torch.from_numpy(np.array(array.numpy(), copy=True))
    return model


def save_state(store: RecordDict, state: TrainState, plan: PrivacyPlan) -> None:
    """Write a client's TrainState into its context.state (kept across rounds by Flower): its
    state_dict, tensors in an ArrayRecord and the rest in a ConfigRecord."""
    flat = state.state_dict(plan)
    store[STATE_ARRAYS] = ArrayRecord({k: Array(v.numpy()) for k, v in flat.items() if isinstance(v, torch.Tensor)})
    store[STATE_CONFIG] = ConfigRecord({k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)})


def load_state(store: RecordDict, plan: PrivacyPlan) -> TrainState | None:
    if STATE_CONFIG not in store:
        return None
    flat = dict(store[STATE_CONFIG])
    flat.update({k: torch.from_numpy(np.array(a.numpy(), copy=True)) for k, a in store[STATE_ARRAYS].items()})
    return TrainState.from_state_dict(flat, plan)


def with_frozen(arrays: ArrayRecord, frozen: dict[str, torch.Tensor]) -> ArrayRecord:
    """`arrays` with every group's frozen blocks (`frozen`: student keys to the initial model's
    values, fedsd.training.loop.frozen_part) put back as the initial model holds them. The server
    does this after each round's aggregation: frozen weights never change, but a weighted mean
    of equal float32 values, FedAdam's step or server-side DP's noise moves them by ulps or more,
    and a node that holds the weights file (node-config init-weights) checks them bit for bit."""
    if not frozen:
        return arrays
    out = {}
    for key, array in arrays.items():
        name = key.split("/", 1)[1]
        out[key] = Array(frozen[name].detach().cpu().numpy()) if name in frozen else array
    return ArrayRecord(out)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def first_difference(arrays: ArrayRecord, expected: dict[str, torch.Tensor],
                     groups: tuple[str, ...] | None = None) -> str | None:
    """The first wire key (group by group, in `expected`'s order) whose array is not, bit for bit
    as float32 (the wire format), `expected`'s tensor of that name, in every group `arrays`
    carries (or `groups`); a key the student lacks is a difference too. None when all are equal."""
    present = sorted({key.split("/", 1)[0] for key in arrays}) if groups is None else groups
    for group in present:
        for name, want in expected.items():
            key = f"{group}/{name}"
            if key not in arrays:
                if group == "student":
                    return f"{key} (missing)"
                continue
            got = arrays[key].numpy()
            if tuple(got.shape) != tuple(want.shape):
                return f"{key} (shape {tuple(got.shape)}, not {tuple(want.shape)})"
            if not np.array_equal(_bits(got), _bits(want.detach().cpu().numpy())):
                return key
    return None
