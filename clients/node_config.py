"""The keys a SuperNode's owner sets in its `--node-config`, declared once like every other
setting (fedsd.settings), and checked as a whole before a round is admitted.

They are the owner's, never the server's: where this client's data is, its lifetime privacy
budget for that data, and where it keeps its state. A node that names its own `data` trains
only under an owner's `max-epsilon` (`inf` is an explicit "no limit"): one forgotten key must
not turn the guarantee off.

What the owner's config decides against a server it does not trust: a node with its own data
draws its noise and batches from a secret stream (fedsd.secret_random: a key from the operating
system's CSPRNG, kept in its state folder), never from the run's seed, which the server sets; it
trains only the networks its owner allows (allow-model); it answers federated evaluation only
when its owner says so; and with `service` its ClientApp, the code the server ships, only
forwards messages to the owner's data service (clients/data_service.py), which alone can read
the data and the state.
"""
from __future__ import annotations

import dataclasses
import math
import os
import stat
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
    download: bool = setting(False, "a shard of a built-in data set: download it with torchvision when this machine "
                                    "lacks it (the node's choice; a server's download=true is not taken)")
    noise: str = setting("auto", "where the noise and the batch sampling come from. secret: AES-256-CTR under a key "
                                 "from the operating system's CSPRNG, kept only in state-dir (0600); seeded: the run's seed, "
                                 "which the server sets, so the server can predict the noise and subtract it "
                                 "(needs trust-server-with-noise=true with own data); auto: secret with own data, "
                                 "seeded for a shard of a built-in data set (a simulation, reproducible bit for bit)",
                         choices=("auto", "secret", "seeded"))
    trust_server_with_noise: bool = setting(False, "with own data and noise=seeded: the owner accepts that the server "
                                                   "can remove this client's noise and so learn its sums of clipped "
                                                   "gradients, with no privacy against the server")
    federated_evaluation: bool = setting(False, "own data: answer the server's federated evaluation, of the model "
                                                "this client last received for training only, once a round, on its "
                                                "own test split; a release no accountant covers (default: refused)")
    min_evaluation_samples: int = setting(100, "own data with federated-evaluation=true: evaluate only on a test "
                                               "split of at least this many samples")
    service: str = setting("", "the owner's data service (a Unix socket, `fedsd data-service`): the ClientApp only "
                               "forwards each message to it; the service, started from the owner's installation as "
                               "the user who alone can read the data and the state, answers with its own node config")
    worker: str = setting("auto", "where this node's rounds run. auto: in a warm worker that keeps torch, the data "
                                  "and the trainer loaded from round to round, when the ClientApp runs as Flower's "
                                  "fresh per-message process (a deployed SuperNode; clients/data_service.py); off: in that "
                                  "process, paying the start-up every round", choices=("auto", "off"))
    worker_idle_seconds: float = setting(600.0, "a warm worker exits after this many seconds without a message "
                                                "(and at once when its SuperNode stops)")
    allow_model: str = setting("", "own data: the one network of a user's own (package.module:callable, importable "
                                   "from this node's installation) the server may name in `model`; without it, only "
                                   "the built-in networks and torchvision:NAME are taken, and no code the server "
                                   "names is ever imported")
    init_weights_sha256: str = setting("", "the sha256 of the only pretrained weights file (init-weights) this node "
                                           "trains from: a run that names another file, or none, is refused before "
                                           "anything is trained or charged (where this node reads the file, for "
                                           "features=backbone, its bytes are checked too)", default_text="none: any")
    skip_bad_files: bool = setting(False, "train on the readable images of `data` and leave out unreadable ones "
                                          "(reported to the server); default: one unreadable image refuses the "
                                          "whole data set")
    secagg_min_clients: int = setting(2, "secure aggregation: the fewest clients a round's cohort, and its survivors, "
                                         "may have for this node to take part (its assumption of how many honest "
                                         "clients hide its input in the sum); a smaller cohort is refused")
    secagg_max_colluders: int = setting(0, "secure aggregation: f, the most of a round's clients this owner allows "
                                           "to be the server's own; this node reveals its shares only when at least "
                                           "secagg-min-clients + f clients survive, so that secagg-min-clients "
                                           "honest inputs are in the sum")
    secagg_only: bool = setting(False, "take part only through secure aggregation: a plain train message, whose update "
                                       "would reach the server alone, is refused before anything is trained or "
                                       "charged")
    secagg_roster: str = setting("", "secure aggregation: the federation's roster, a file the owners agreed on (one "
                                     "'name ed25519:<base64>' a line; deploy/README.md). Every neighbour's keys, "
                                     "commitments and view must then be signed by its roster key, and this node's id "
                                     "is its own entry's; without it, secure aggregation protects only against a server "
                                     "that follows the protocol", default_text="none")
    secagg_trust: str = setting("roster", "secure aggregation without a roster: with secagg-only=true this node refuses "
                                          "to take part unless the owner says honest-but-curious (a server that "
                                          "follows the protocol)", choices=("roster", "honest-but-curious"))
    secagg_keep_inputs: bool = setting(False, "secure aggregation: keep each round's unmasked vector, as this node "
                                              "released it into the sum, in state-dir/secagg/<run>-<experiment>-<round>-<node>.npy "
                                              "(the owner's own audit of what it released)")

    @property
    def owns_data(self) -> bool:
        return bool(self.data)

    @property
    def state_root(self) -> Path:
        """This client's own folder: privacy state, its lifetime ledgers, its prepared data
        (absolute, resolved once by `parse`)."""
        return Path(self.state_dir)

    def state_folder(self, *parts: str) -> Path:
        """A folder of this client's state (made 0700). A node with its own data also refuses a
        state folder that another user owns or can write to, or has such a folder above it
        (private_folder); a simulated client's state lives in its run's folder."""
        if self.owns_data:  # every folder on the way made or checked without following a link
            folder = private_folder(self.state_root)
            for part in parts:
                folder = _private_child(folder, part)
            return folder
        folder = self.state_root.joinpath(*parts)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return folder

    @property
    def secret_noise(self) -> bool:
        """Whether this client's noise and batches come from a secret stream (NodeConfig.noise)."""
        return self.noise == "secret" or (self.noise == "auto" and self.owns_data)

    def as_node_config(self) -> dict:
        """The inverse of `parse`: this config as the key-value pairs a --node-config holds."""
        return {s.key: getattr(self, s.name) for s in settings_of(NodeConfig) if getattr(self, s.name) is not None}

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
    if node.secagg_min_clients < 2:
        raise NodeConfigError(f"node-config secagg-min-clients={node.secagg_min_clients}: must be ≥ 2 (a sum of one "
                              f"client's input is that input)")
    if node.secagg_max_colluders < 0:
        raise NodeConfigError(f"node-config secagg-max-colluders={node.secagg_max_colluders}: must be ≥ 0")
    if node.secagg_roster:
        from fedsd.identity import read_roster

        read_roster(node.secagg_roster)  # a roster that does not parse, others can write, or lists a key twice
    elif node.secagg_only and node.secagg_trust != "honest-but-curious":
        raise NodeConfigError("node-config secagg-only=true without secagg-roster: secure aggregation without a roster "
                              "protects only against a server that follows the protocol (it can substitute keys and "
                              "read this node's update); name the federation's roster (secagg-roster=PATH) or say "
                              "secagg-trust=honest-but-curious")
    if node.min_evaluation_samples < 1:
        raise NodeConfigError(f"node-config min-evaluation-samples={node.min_evaluation_samples}: must be ≥ 1")
    if node.service:
        owners = sorted(k for k in node_config if k not in SUPERNODE_WITH_SERVICE)
        if owners:
            raise NodeConfigError(f"node-config {owners[0]}: with service=... it belongs in the data service's own "
                                  f"--node-config (`fedsd data-service`), not the SuperNode's; the SuperNode's takes "
                                  f"only {', '.join(SUPERNODE_WITH_SERVICE)}")
        return node
    if node.data and not Path(node.data).exists():
        raise NodeConfigError(f"node-config data='{node.data}': no such file or folder")
    if node.owns_data and node.noise == "seeded" and not node.trust_server_with_noise:
        raise NodeConfigError("node-config noise=seeded: the server sets the run's seed, so with seeded noise it can "
                              "predict this client's noise and subtract it from its update, which leaves the sum of "
                              "clipped gradients of the owner's data unnoised; add trust-server-with-noise=true to "
                              "say the owner accepts that, or leave noise unset (secret noise)")
    return dataclasses.replace(node, state_dir=str(_state_root(node.state_dir)))


# With service=...: what the SuperNode's own node config holds (the rest is the service's).
SUPERNODE_WITH_SERVICE = ("partition-id", "num-partitions", "service")


def _state_root(state_dir: str) -> Path:
    """The state folder as an absolute path, resolved once: a relative one would name another
    folder in a process with another working directory (the worker's), and split the ledger."""
    root = Path(state_dir or os.environ.get("FEDSD_CLIENT_STATE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd" / "client-state")
    return Path(os.path.abspath(root.expanduser()))


def private_folder(folder: Path) -> Path:
    """`folder` made (mode 0700) or checked as this user's own, and returned as the real path
    it names; refused (NodeConfigError), never repaired, when it or a folder above it is owned
    by another user or can be written by one (a folder with the sticky bit, such as /tmp, owned
    by root or this user is allowed above it: others cannot rename or remove what is ours in
    it). The path is resolved first, so a link on the way is judged by where it leads. Another
    user who could write there could swap the ledger or the secret key, plant a prepared data
    set or stand in for the worker's socket."""
    real = Path(os.path.realpath(folder))
    for above in reversed(real.parents):
        if above.exists():
            _check_owned(os.stat(above), above, folder, sticky_ok=True)
        else:  # made here, ours and closed, as the folder itself
            _private_child(above.parent, above.name, folder)
    return _private_child(real.parent, real.name, folder)


def _private_child(parent: Path, name: str, named: Path | None = None) -> Path:
    """parent/name as a folder of this user's alone: made (0700) where it is missing, else
    checked with lstat, so a link planted there is refused rather than followed."""
    if name in ("", ".", "..") or "/" in name:
        raise NodeConfigError(f"node-config state-dir: {name!r} is not a folder name")
    path = parent / name
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NodeConfigError(f"node-config state-dir={named or path}: {path} is "
                              f"{'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}; this client's "
                              f"state lives in real folders only, which no one else can replace")
    _check_owned(st, path, named or path, sticky_ok=False)
    if stat.S_IMODE(st.st_mode) & 0o077:  # readable by others: closed (what is written there is 0600 too)
        os.chmod(path, 0o700)
    return path


def _check_owned(st: os.stat_result, path: Path, named: Path, sticky_ok: bool) -> None:
    me = os.geteuid()
    if st.st_uid not in (0, me) or (not sticky_ok and st.st_uid != me):
        raise NodeConfigError(f"node-config state-dir={named}: {path} belongs to another user (uid "
                              f"{st.st_uid}), who could replace this client's ledger; choose a state folder "
                              f"under folders only you or root own")
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        raise NodeConfigError(f"node-config state-dir={named}: {path} can be written by other users "
                              f"(mode {stat.S_IMODE(st.st_mode):o}), who could replace this client's ledger; "
                              f"choose a state folder under folders only you can write")


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
