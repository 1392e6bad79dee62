"""What a node with its own data checks before it reads a record, trains or is charged, whatever
the server says: its state folder is its owner's alone; the task it was first asked to fit is
the one it keeps (pin_task); a network the server names is data, never code
(check_model_allowed); the weights it starts from are its owner's (check_init_weights), and the
global model every message carries holds them (check_sent_weights) and is finite. Each refusal
says to the server nothing of the owner's paths or records; the owner's log has it in full."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord

from fedsd.data.client_data import task_for
from fedsd.errors import ConfigError
from fedsd.files.results import write_json
from fedsd.files.state_folder import read_nofollow
from fedsd.models import pretrained
from fedsd.models.networks import SCATTER_MODELS, TORCHVISION, is_builtin
from fedsd.settings.federation import client_config, from_flat
from fedsd.training.loop import frozen_part, initial_model

from fedsd.app.records import first_difference
from fedsd.app.client.node_config import NodeConfig, NodeConfigError

log = logging.getLogger("fedsd.client")


WEIGHTS_REFUSED = ("node-config init-weights: this node's own copy of the weights cannot be read as a weights file; "
                   "its owner's log says why")


STATE_REFUSED = ("node-config state-dir: this client's state folder is not its owner's alone (another user owns "
                 "or can write to it or to a folder above it, or a link is on its way); its owner's log says which")


def private_state_folder(node: NodeConfig, *parts: str) -> Path:
    """node.state_folder for a node with its own data, its refusal said to the server without
    the owner's paths (NodeConfigError, in full in the owner's log)."""
    try:
        return node.state_folder(*parts)
    except NodeConfigError as e:
        log.warning("refused a round: %s", e)
        raise NodeConfigError(STATE_REFUSED) from None


def pin_task(node: NodeConfig, task) -> None:
    """Whether a node's data fits a task (its labels, its class folders) is a fact about its
    records, which a refusal would tell the server. So the first task a node is asked to fit is
    kept in its state folder (task.json), and a run of any other task is refused as a setting,
    before a record is read: the server learns that one bit once, not one a query. The owner
    can delete task.json to allow another task."""
    path = private_state_folder(node) / "task.json"
    wanted = {"classes": list(task.classes), "channels": task.channels, "image-size": task.image_size}
    raw = read_nofollow(path)
    if raw is None:
        write_json(path, wanted)
        return
    kept = json.loads(raw)
    if kept != wanted:
        raise ConfigError(f"dataset, classes, channels, image-size: this client's data is kept for one task "
                          f"({len(kept['classes'])} classes {','.join(kept['classes'])[:200]}, {kept['channels']} "
                          f"channel(s), {kept['image-size']} pixels); its owner can delete state-dir/task.json to "
                          f"allow another")


def check_model_allowed(model: str, node: NodeConfig) -> None:
    """A network named by the server is data, never code, on a node with its own data: a
    built-in network or a torchvision one, or the one user's factory its owner names
    (node-config allow-model). Refused (ConfigError) before anything is imported or read."""
    if model is None or is_builtin(model) or model in SCATTER_MODELS or model.startswith(TORCHVISION) \
            or model == node.allow_model:  # None: the data set's built-in network
        return
    raise ConfigError(f"model={model[:80]!r}: this client takes the built-in networks and torchvision:NAME; a "
                      f"network of a user's own only where its owner's node config names it (allow-model=...)")


def check_init_weights(flat: dict, node: NodeConfig) -> None:
    """A node whose owner named the pretrained weights it trains from refuses a run that starts
    from other weights, or from none (NodeConfigError naming the keys, before anything is read,
    trained or charged). With node-config init-weights-sha256 alone, that is the sha256 the server
    claims (init-weights-sha256 in the run config): a server that breaks the protocol can claim
    it and send other weights. With node-config init-weights (the owner's own copy of the public
    file), the file's sha256 must also be init-weights-sha256's, where set, and the run's; the run
    then reads the weights from it (features=backbone included), never from a path the server
    names, and every message's model is checked against it (check_sent_weights)."""
    expected = node.init_weights_sha256.strip().lower()
    told = str(flat.get("init-weights-sha256", "")).strip().lower()
    if expected and told != expected:
        raise NodeConfigError(f"init-weights-sha256={told[:64] or 'none'}: this node trains only from the weights its "
                              f"owner named (node-config init-weights-sha256={expected[:64]}); other weights are "
                              f"refused")
    if not node.init_weights:
        return
    try:
        own = pretrained.read_weights(node.init_weights)[1]
    except ConfigError as e:  # said in full to the owner alone: it names the owner's path
        log.warning("refused a round: %s", e)
        raise NodeConfigError(WEIGHTS_REFUSED) from None
    if expected and own != expected:
        raise NodeConfigError(f"node-config init-weights: the owner's file is not the one node-config "
                              f"init-weights-sha256={expected[:64]} names (its sha256 differs); this node trains from "
                              f"neither until its owner fixes its node config")
    if told != own:
        raise NodeConfigError(f"init-weights-sha256={told[:64] or 'none'}: not the sha256 of this node's own copy of "
                              f"the weights (node-config init-weights); other weights are refused")
    flat["init-weights"] = node.init_weights  # the owner's file, never a path the server names


# Per process, for the latest run: the model a node builds from its own copy of the weights
# (its frozen part and its whole initial student), keyed by the run's settings (the file's sha256 among them).
_REFERENCES: dict[tuple, tuple[dict, dict]] = {}


def own_reference(flat: dict, node: NodeConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the frozen blocks, the whole initial student) of the run's network, built from this
    node's own weights file (flat's init-weights, set by check_init_weights) the way fedsd builds
    the initial model: the same seed, the same head made new where the file's is of another shape."""
    key = tuple(sorted(flat.items()))
    if key not in _REFERENCES:
        cfg, fed = from_flat(flat)
        if node.owns_data:  # no code the server names is imported (check_model_allowed)
            check_model_allowed(cfg.model, node)
        cfg = client_config(cfg, fed)
        num_classes = len(task_for(cfg).classes)
        start = initial_model(cfg, num_classes)["student"]
        _REFERENCES.clear()
        _REFERENCES[key] = (frozen_part(cfg, num_classes), start)
    return _REFERENCES[key]


def check_sent_weights(arrays: ArrayRecord, flat: dict, node: NodeConfig, first_round: bool) -> None:
    """With node-config init-weights: the global model a message carries must hold, bit for bit
    as float32 (the wire format), what this node builds from its own copy of the weights: the
    frozen blocks (every parameter and buffer of the blocks --train-layers freezes) in every
    group, every round, train and evaluate alike; and in the first round's train message the
    whole student (with --train-layers all and features=backbone nothing is frozen on the wire,
    so that check is the only one). NodeConfigError naming the first tensor that differs, before
    anything is read, trained or charged. A node without init-weights checks nothing here."""
    if not node.init_weights:
        return
    frozen, start = own_reference(flat, node)
    differs = (first_difference(arrays, start, ("student",)) if first_round else None) or \
        first_difference(arrays, frozen)
    if differs:
        part = "initial model" if first_round else "frozen blocks"
        raise NodeConfigError(f"model: the global model's {differs[:120]} is not what this node builds from its own "
                              f"copy of the weights (node-config init-weights: the {part}, bit for bit); other "
                              f"weights are refused")


def check_finite_model(arrays: ArrayRecord) -> None:
    """The model a server sends to a node with its own data holds finite weights (ConfigError
    before any record is read): a non-finite weight would make the round's outcome a property of
    the records rather than of the noise."""
    for key in arrays:
        a = arrays[key].numpy()
        if a.dtype.kind == "f" and not np.isfinite(a.astype(np.float32)).all():  # as the network will hold them
            raise ConfigError(f"model: the global model's {key[:80]} holds weights that are not finite")

