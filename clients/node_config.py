"""The keys a SuperNode's owner sets in its `--node-config`, declared once like every other
setting (fedsd.settings), and checked as a whole before a round is admitted.

They are the owner's, never the server's: where this client's data is, its lifetime privacy
budget for that data, and where it keeps its state. A node that names its own `data` trains
only under an owner's `max-epsilon` (`inf` is an explicit "no limit"): one forgotten key must
not turn the guarantee off.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fedsd.errors import BudgetRefused, ConfigError
from fedsd.settings import setting, settings_of

NO_BUDGET = ("this client has no lifetime budget: start its SuperNode with "
             "--node-config \"max-epsilon=…\"")


@dataclass(frozen=True)
class NodeConfig:
    partition_id: int | None = setting(None, "this client's number in the run (0 … num-clients − 1); without data, "
                                             "also which shard of the built-in data set it trains on",
                                       default_text="required")
    num_partitions: int | None = setting(None, "checked against the run's num-clients", default_text="not checked")
    data: str = setting("", "this client's own data: an image folder (train/<class>/<image>) or an .npz; it needs "
                            "max-epsilon")
    max_epsilon: float | None = setting(None, "the owner's lifetime ε for this data, across every run and "
                                              "experiment; inf for no limit",
                                        default_text="none: a node with its own data refuses every run")
    max_delta: float = setting(1e-5, "the owner's lifetime δ for this data")
    state_dir: str = setting("", "where this client keeps its ledgers, privacy state and prepared data",
                             default_text="FEDSD_CLIENT_STATE_DIR, else ~/.cache/fedsd/client-state")
    data_dir: str = setting("", "where the built-in data sets are (a simulated client's shard)",
                            default_text="FEDSD_DATA_DIR or the usual places")
    worker: str = setting("auto", "where this node's rounds run. auto: in a warm worker that keeps torch, the data "
                                  "and the trainer loaded from round to round, when the ClientApp runs as Flower's "
                                  "fresh per-message process (a deployed SuperNode; clients/worker.py); off: in that "
                                  "process, paying the start-up every round", choices=("auto", "off"))
    worker_idle_seconds: float = setting(600.0, "a warm worker exits after this many seconds without a message "
                                                "(and at once when its SuperNode stops)")
    skip_bad_files: bool = setting(False, "train on the readable images of `data` and leave out unreadable ones "
                                          "(reported to the server); default: one unreadable image refuses the "
                                          "whole data set")

    @property
    def owns_data(self) -> bool:
        return bool(self.data)

    @property
    def state_root(self) -> Path:
        """This client's own folder: privacy state, its lifetime ledgers, its prepared data."""
        return Path(self.state_dir or os.environ.get("FEDSD_CLIENT_STATE_DIR")
                    or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd" / "client-state")

    def require_budget(self) -> None:
        """Raise BudgetRefused when this node holds its own data and its owner set no budget."""
        if self.owns_data and self.max_epsilon is None:
            raise BudgetRefused(NO_BUDGET)

    def budget(self) -> dict:
        """The owner's lifetime limits, as a reply's metrics carry them (none when unset)."""
        if self.max_epsilon is None:
            return {}
        return {"max-epsilon": self.max_epsilon, "max-delta": self.max_delta}


KEYS = {s.key: s for s in settings_of(NodeConfig)}


class NodeConfigError(ConfigError):
    """A --node-config value that is not allowed; the message names the key and what is allowed."""


def parse(node_config: Mapping) -> NodeConfig:
    """The node config checked as a whole: unknown keys, numbers that are not numbers or out of
    range, a `data` that does not exist, each refused with ConfigError naming the key and what
    is allowed."""
    unknown = sorted(set(node_config) - set(KEYS))
    if unknown:
        raise NodeConfigError(f"node-config {unknown[0]}: not a key fedsd reads; the keys are {', '.join(KEYS)}")
    values = {KEYS[k].name: _value(k, v) for k, v in node_config.items()}
    node = NodeConfig(**values)
    if node.max_epsilon is not None and not node.max_epsilon > 0:
        raise NodeConfigError(f"node-config max-epsilon={node.max_epsilon:g}: must be > 0 (or inf for no limit)")
    if not 0 < node.max_delta < 1 or math.isinf(node.max_delta):
        raise NodeConfigError(f"node-config max-delta={node.max_delta:g}: must be in (0, 1)")
    if node.partition_id is None:
        raise NodeConfigError("node-config partition-id: required (this client's number in the run, 0 … num-clients − 1)")
    if node.partition_id < 0:
        raise NodeConfigError(f"node-config partition-id={node.partition_id}: must be ≥ 0")
    if not node.worker_idle_seconds > 0:
        raise NodeConfigError(f"node-config worker-idle-seconds={node.worker_idle_seconds:g}: must be > 0")
    if node.data and not Path(node.data).exists():
        raise NodeConfigError(f"node-config data='{node.data}': no such file or folder")
    return node


def _value(key: str, value):
    """A node-config value as its declared type. Flower hands over TOML values: 3 (int), 3.0 or
    inf (float), '3' (a quoted string); a number may come as any of them, a bool never."""
    s = KEYS[key]
    if s.type is str:
        if s.choices and str(value) not in s.choices:
            raise NodeConfigError(f"node-config {key}={value!r}: choose one of {', '.join(s.choices)}")
        return str(value)
    if s.type is bool:
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return value if isinstance(value, bool) else str(value).lower() == "true"
        raise NodeConfigError(f"node-config {key}={value!r} is not true or false")
    if isinstance(value, bool) or value is None:
        raise NodeConfigError(f"node-config {key}={value!r} is not a number")
    try:
        number = float(value) if s.type is float else int(value)
    except (TypeError, ValueError):
        raise NodeConfigError(f"node-config {key}={value!r} is not a"
                          f"{' number' if s.type is float else 'n integer'}") from None
    if s.type is float and math.isnan(number):
        raise NodeConfigError(f"node-config {key}={value!r} is not a number")
    if s.type is int and isinstance(value, float) and value != number:
        raise NodeConfigError(f"node-config {key}={value!r} is not an integer")
    return number


def parse_partition_id(node_config: Mapping) -> int | None:
    """The node's partition id where it is a valid one, else None (to name a refusing client)."""
    try:
        value = _value("partition-id", node_config["partition-id"])
    except (KeyError, ConfigError):
        return None
    return value if value >= 0 else None
