"""The keys a SuperNode's owner sets in its `--node-config`, declared once like every other
setting (fedsd.settings.declared), and checked as a whole before a round is admitted.

They are the owner's, never the server's: where this client's data is, its lifetime privacy
budget for that data, and where it keeps its state. A node that names its own `data` trains
only under an owner's `max-epsilon` (`inf` is an explicit "no limit"): one forgotten key must
not turn the guarantee off.

What the owner's config decides against a server it does not trust: a node with its own data
draws its noise and batches from a secret stream (fedsd.privacy.secret_random: a key from the operating
system's CSPRNG, kept in its state folder), never from the run's seed, which the server sets; it
trains only the networks its owner allows (allow-model); it answers federated evaluation only
when its owner says so; and with `service` its ClientApp, the code the server ships, only
forwards messages to the owner's data service (fedsd/app/client/owner_service.py), which alone can read
the data and the state.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fedsd.app.client.forward import SUPERNODE_WITH_SERVICE
from fedsd.errors import BudgetRefused, ConfigError, FedsdNote
from fedsd.settings.declared import OWNER_MIN_CLIENTS, setting, settings_of
from fedsd.files.state_folder import StateFolder, StateFolderError, state_folder

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
    record_dir: str = setting("", "own data: where the owner's record of what its state folder spent and joined is "
                                  "kept, outside state-dir, so that a restored copy of the folder is refused "
                                  "(fedsd data-service --accept-restored-state accepts one); not inside state-dir",
                              default_text="FEDSD_RECORD_DIR, else $XDG_STATE_HOME/fedsd, else ~/.local/state/fedsd")
    data_dir: str = setting("", "where the built-in data sets are (a simulated client's shard)",
                            default_text="FEDSD_DATA_DIR or the usual places")
    download: bool = setting(False, "a shard of a built-in data set: download it with torchvision when this machine "
                                    "lacks it (the node's choice; a server's download=true is not taken)")
    randomness: str = setting("auto", "where the noise and the batch sampling come from (before fedsd 0.2: noise). "
                                 "secret: AES-256-CTR under a key from the operating system's CSPRNG, kept only in "
                                 "state-dir (0600); seeded: the run's seed, "
                                 "which the server sets, so the server can predict the noise and subtract it "
                                 "(needs trust-server-with-noise=true with own data); auto: secret with own data, "
                                 "seeded for a shard of a built-in data set (a simulation, reproducible bit for bit)",
                         choices=("auto", "secret", "seeded"))
    trust_server_with_noise: bool = setting(False, "with own data and randomness=seeded: the owner accepts that "
                                                   "the server can remove this client's noise and so learn its sums "
                                                   "of clipped gradients, with no privacy against the server")
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
                                  "fresh per-message process (a deployed SuperNode; "
                                  "fedsd/app/client/owner_service.py); off: in that process, paying the start-up "
                                  "every round", choices=("auto", "off"))
    worker_idle_seconds: float = setting(600.0, "a warm worker exits after this many seconds without a message "
                                                "(and at once when its SuperNode stops)")
    allow_model: str = setting("", "own data: the one network of a user's own (package.module:callable, importable "
                                   "from this node's installation) the server may name in `model`; without it, only "
                                   "the built-in networks and torchvision:NAME are taken, and no code the server "
                                   "names is ever imported")
    init_weights: str = setting("", "the owner's own copy of the public pretrained weights file the run starts "
                                    "from: its sha256 must be init-weights-sha256's (where set) and the run's; every "
                                    "train and evaluate message's frozen blocks (--train-layers head|last:N; in round "
                                    "1 the whole student) must then equal, bit for bit, the network this node builds "
                                    "from it, and features=backbone is computed from it; without it the node checks "
                                    "only the sha256 the server claims", default_text="none")
    init_weights_sha256: str = setting("", "the sha256 of the only pretrained weights file (the run's "
                                           "init-weights) this node trains from: a run that names another file, or "
                                           "none, is refused before anything is trained or charged (where this node "
                                           "reads the file, for features=backbone, its bytes are checked too)",
                                       default_text="none: any")
    skip_bad_files: bool = setting(False, "train on the readable images of `data` and leave out unreadable ones "
                                          "(reported to the server); default: one unreadable image refuses the "
                                          "whole data set")
    secagg_min_clients: int = setting(OWNER_MIN_CLIENTS, "secure aggregation: the fewest clients a round's cohort, "
                                         "and its survivors, may have for this node to take part (its assumption "
                                         "of how many honest clients hide its input in the sum); "
                                         "a smaller cohort is refused")
    max_records: int = setting(0, "distributed noise at record level: a bound on this owner's training records, its "
                                  "own number; its step's draw rate is set from it (or, at 0, from the run's "
                                  "secagg-max-records), never from the records it holds, so that no record changes "
                                  "the rate the others are drawn at. Data with more records than it is refused "
                                  "before anything is charged")
    secagg_max_colluders: int = setting(0, "secure aggregation: f, the most of a round's clients this owner allows "
                                           "to be the server's own; this node reveals its shares only when at least "
                                           "secagg-min-clients + f clients survive, so that secagg-min-clients "
                                           "honest inputs are in the sum")
    secagg_only: bool = setting(False, "take part only through secure aggregation: a plain train message, whose update "
                                       "would reach the server alone, is refused before anything is trained or "
                                       "charged")
    secagg_roster: str = setting("", "secure aggregation: the federation's roster, a file the owners agreed on (one "
                                     "'name ed25519:<base64>' a line; clients/README.md). Every neighbour's keys, "
                                     "commitments and view must then be signed by its roster key, and this node's id "
                                     "is its own entry's; without it, secure aggregation protects only against a "
                                     "server that follows the protocol", default_text="none")
    secagg_trust: str = setting("roster", "secure aggregation without a roster: with secagg-only=true this node "
                                          "refuses to take part unless the owner says honest-but-curious (a server "
                                          "that follows the protocol)", choices=("roster", "honest-but-curious"))
    max_local_steps: int = setting(10_000, "the most local steps (local-steps) a round may ask of this node: a "
                                           "round's work, and how long its service is busy, is the owner's to bound")
    secagg_keep_inputs: bool = setting(False, "secure aggregation: keep each round's unmasked vector, as this node "
                                              "released it into the sum, in "
                                              "state-dir/secagg/<run>-<experiment>-<round>-<id>.npy "
                                              "(the owner's own audit of what it released)")

    @property
    def owns_data(self) -> bool:
        return bool(self.data)

    @property
    def state_root(self) -> Path:
        """This client's own folder: privacy state, its lifetime ledgers, its prepared data
        (absolute, resolved once by `parse`)."""
        return Path(self.state_dir)

    def records(self):
        """The owner's record of what its state folder spent and joined (fedsd.privacy.owner_record),
        held open, for a node with its own data; None for a simulated client. NodeConfigError
        where its folder is refused, naming it and why."""
        if not self.owns_data:
            return None
        from fedsd.privacy.owner_record import Records

        try:
            return Records.open(record_root_of(self.record_dir))
        except StateFolderError as e:
            raise NodeConfigError(f"node-config {e}") from None

    def state(self, pin: bool = False) -> StateFolder:
        """This client's state folder held open (fedsd.files.state_folder): walked once from `/`
        without following a link, as the owner's (private) for a node with its own data; every
        file under it is then opened through its descriptor. `pin`: the owner's service, at its
        start: the folder opened then is the one it uses for its life. NodeConfigError where the
        folder is refused, naming it and why."""
        try:
            return state_folder(self.state_root, private=self.owns_data, pin=pin)
        except StateFolderError as e:
            raise NodeConfigError(f"node-config {e}") from None

    def state_folder(self, *parts: str) -> Path:
        """A folder of this client's state (made 0700), as a path through the state folder's
        descriptor (StateFolder.via). A node with its own data also refuses a state folder that
        another user owns or can write to, or has such a folder above it, or a link on its way
        (fedsd.files.state_folder); a simulated client's state lives in its run's folder."""
        folder = self.state()
        try:
            return folder.folder(*parts)
        except StateFolderError as e:
            raise NodeConfigError(f"node-config {e}") from None

    @property
    def secret_noise(self) -> bool:
        """Whether this client's noise and batches come from a secret stream (NodeConfig.randomness)."""
        return self.randomness == "secret" or (self.randomness == "auto" and self.owns_data)

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


# Keys renamed in fedsd 0.2 (old: new). `noise` said where the noise is added in the run config
# (noise=local|distributed) and where its randomness comes from here; each word now means one thing.
RENAMED_KEYS = {"noise": "randomness"}


def renamed_keys(node_config: Mapping) -> dict:
    """The node config with each old key under its new name, said once in a note; both given is refused."""
    out = dict(node_config)
    for old, new in RENAMED_KEYS.items():
        if old in out:
            if new in out:
                raise NodeConfigError(f"node-config {old} and {new}: {old} is {new}'s old name (fedsd 0.2); "
                                      f"give {new} only")
            warnings.warn(FedsdNote(f"node-config {old}: renamed {new} in fedsd 0.2 (write {new}={out[old]}); "
                                    f"{old}= still works in this release"), stacklevel=3)
            out[new] = out.pop(old)
    return out


def _check_counts(node: NodeConfig) -> None:
    if node.max_local_steps < 1:
        raise NodeConfigError(f"node-config max-local-steps={node.max_local_steps}: must be ≥ 1")
    if node.min_evaluation_samples < 1:
        raise NodeConfigError(f"node-config min-evaluation-samples={node.min_evaluation_samples}: must be ≥ 1")
    if node.max_records < 0:
        raise NodeConfigError(f"node-config max-records={node.max_records}: must be ≥ 0 (0: the run's "
                              f"secagg-max-records)")


def _check_secagg(node: NodeConfig) -> None:
    """Secure aggregation's keys: t and f in range, the roster readable and long enough for a
    round this owner can take part in."""
    if node.secagg_min_clients < 2:
        raise NodeConfigError(f"node-config secagg-min-clients={node.secagg_min_clients}: must be ≥ 2 (a sum of one "
                              f"client's input is that input)")
    if node.secagg_max_colluders < 0:
        raise NodeConfigError(f"node-config secagg-max-colluders={node.secagg_max_colluders}: must be ≥ 0")
    if node.secagg_roster:
        from fedsd.secure.identity import read_roster

        roster = read_roster(node.secagg_roster)  # one that does not parse, others can write, or lists a key twice
        check_roster_size(len(roster), node.secagg_min_clients, node.secagg_max_colluders)
    elif node.secagg_only and node.secagg_trust != "honest-but-curious":
        raise NodeConfigError("node-config secagg-only=true without secagg-roster: secure aggregation without a roster "
                              "protects only against a server that follows the protocol (it can substitute keys and "
                              "read this node's update); name the federation's roster (secagg-roster=PATH) or say "
                              "secagg-trust=honest-but-curious")


def fewest_clients(min_clients: int, max_colluders: int) -> int:
    """The fewest clients a round must have for an owner with secagg-min-clients t and
    secagg-max-colluders f to take part (fedsd.secure.secagg's checks at advertise): t + 2f
    neighbours, so that f silent after the masked input still leave the t + f it unmasks with;
    and a threshold above (neighbours + f) / 2 and above two thirds of them, yet at most
    neighbours − f (so more than 3f neighbours)."""
    from fedsd.secure.secagg_primitives import lowest_threshold

    t, f = min_clients, max_colluders
    n = max(2, t + 2 * f)
    while lowest_threshold(n, f) > n - f:
        n += 1
    return n


def check_roster_size(members: int, min_clients: int, max_colluders: int) -> None:
    """NodeConfigError, with the arithmetic, where a roster of `members` owners can never hold a
    round this owner takes part in: every round's cohort is drawn from the roster."""
    need = fewest_clients(min_clients, max_colluders)
    if members >= need:
        return
    t, f = min_clients, max_colluders
    most_f = max((g for g in range(f) if fewest_clients(t, g) <= members), default=None)
    fix = (f"lower secagg-max-colluders to {most_f}" if most_f is not None else
           f"lower secagg-min-clients to {members}" if members >= 2 else "list at least 2 owners")
    raise NodeConfigError(
        f"node-config secagg-max-colluders={f} with secagg-min-clients={t}: a round needs at least {need} clients "
        f"(t + 2f = {t + 2 * f}: f silent after the masked input must still leave the t + f = {t + f} this owner "
        f"unmasks with; and the threshold, above (clients + f) / 2 and above two thirds of the clients, must be at "
        f"most clients − f, which takes more than 3f = {3 * f}), but the roster lists {members} owner(s): add "
        f"owners to the roster, or {fix}")


def _typed(node_config: Mapping) -> NodeConfig:
    """Each key known and each value of its declared type; nothing else checked."""
    unknown = sorted(set(node_config) - set(KEYS))
    if unknown:
        raise NodeConfigError(f"node-config {unknown[0]}: not a key fedsd reads; the keys are {', '.join(KEYS)}")
    return NodeConfig(**{KEYS[k].name: _value(k, v) for k, v in node_config.items()})


def identity_config(node_config: Mapping) -> NodeConfig:
    """What `fedsd data-service --identity` reads of the owner's node config: its state folder
    alone (made absolute, as `parse` makes it). Every key is still checked as a key and a value,
    so a misspelt one is refused; partition-id, data and max-epsilon are not needed, and
    secagg-roster is not read (the roster that will list this identity need not exist yet)."""
    node_config = {k: v for k, v in renamed_keys(node_config).items() if k != "secagg-roster"}
    node = _typed(node_config)
    return dataclasses.replace(node, state_dir=str(state_root_of(node.state_dir)))


def parse(node_config: Mapping) -> NodeConfig:
    """The node config checked as a whole: unknown keys, numbers that are not numbers or out of
    range, a `data` that does not exist, each refused with ConfigError naming the key and what
    is allowed. A key renamed in fedsd 0.2 still works for this release, with a note naming its new name."""
    node_config = renamed_keys(node_config)
    node = _typed(node_config)
    if node.max_epsilon is not None and not node.max_epsilon > 0:
        raise NodeConfigError(f"node-config max-epsilon={node.max_epsilon:g}: must be > 0 (or inf for no limit)")
    if not 0 < node.max_delta < 1 or math.isinf(node.max_delta):
        raise NodeConfigError(f"node-config max-delta={node.max_delta:g}: must be in (0, 1)")
    if node.partition_id is None:
        raise NodeConfigError("node-config partition-id: required (this client's number in the run, "
                              "0 … num-clients − 1; `fedsd data-service --identity` needs only state-dir)")
    if node.partition_id < 0:
        raise NodeConfigError(f"node-config partition-id={node.partition_id}: must be ≥ 0")
    if not node.worker_idle_seconds > 0:
        raise NodeConfigError(f"node-config worker-idle-seconds={node.worker_idle_seconds:g}: must be > 0")
    _check_secagg(node)
    _check_counts(node)
    if node.service:
        owners = sorted(k for k in node_config if k not in SUPERNODE_WITH_SERVICE)
        if owners:
            raise NodeConfigError(f"node-config {owners[0]}: with service=... it belongs in the data service's own "
                                  f"--node-config (`fedsd data-service`), not the SuperNode's; the SuperNode's takes "
                                  f"only {', '.join(SUPERNODE_WITH_SERVICE)}")
        return node
    if node.init_weights:
        if not Path(node.init_weights).expanduser().is_file():
            raise NodeConfigError("node-config init-weights: no such file (the owner's copy of the pretrained weights)")
        node = dataclasses.replace(node, init_weights=os.path.abspath(Path(node.init_weights).expanduser()))
    if node.data and not Path(node.data).exists():
        raise NodeConfigError(f"node-config data='{node.data}': no such file or folder")
    if node.owns_data and node.randomness == "seeded" and not node.trust_server_with_noise:
        raise NodeConfigError("node-config randomness=seeded: the server sets the run's seed, so with seeded noise it "
                              "can predict this client's noise and subtract it from its update, which leaves the sum "
                              "of clipped gradients of the owner's data unnoised; add trust-server-with-noise=true to "
                              "say the owner accepts that, or leave randomness unset (secret noise)")
    node = dataclasses.replace(node, state_dir=str(state_root_of(node.state_dir)),  # absolute: the same in a worker
                               record_dir=str(record_root_of(node.record_dir)) if node.record_dir else "")
    if node.owns_data:
        check_record_dir(node)
    return node


def state_root_of(state_dir: str) -> Path:
    """The state folder as an absolute path, resolved once: a relative one would name another
    folder in a process with another working directory (the worker's), and split the ledger."""
    root = Path(state_dir or os.environ.get("FEDSD_CLIENT_STATE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedsd" / "client-state")
    return Path(os.path.abspath(root.expanduser()))


RECORD_ENV = "FEDSD_RECORD_DIR"  # the owner's record folder where node-config record-dir is unset


def record_root_of(record_dir: str) -> Path:
    """The owner's record folder as an absolute path: record-dir, else FEDSD_RECORD_DIR, else
    $XDG_STATE_HOME/fedsd, else ~/.local/state/fedsd (the owner's state home, which a copy of
    its state folder does not carry)."""
    xdg = os.environ.get("XDG_STATE_HOME", "")
    home = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return Path(os.path.abspath(Path(record_dir or os.environ.get(RECORD_ENV) or home / "fedsd").expanduser()))


def check_record_dir(node: NodeConfig) -> None:
    """The record folder may not be the state folder or lie inside it: a copy of the folder would
    carry the record, and a restore roll both back."""
    record, state = record_root_of(node.record_dir), node.state_root
    if record == state or state in record.parents:
        raise NodeConfigError(f"node-config record-dir={record}: inside state-dir={state}, where a copy of the state "
                              f"folder would carry it; set record-dir (or {RECORD_ENV}) to a folder outside state-dir")


def private_folder(folder: Path) -> Path:
    """`folder` made (mode 0700) or checked as this user's own, and returned: refused
    (NodeConfigError), never repaired, when it or a folder above it is owned by another user or
    can be written by one (a folder with the sticky bit, such as /tmp, owned by root or this user
    is allowed above it: others cannot rename or remove what is ours in it), or when a link is
    on its way (fedsd.files.state_folder: pass the resolved path). Another user who could write there
    could swap the ledger, plant a prepared data set or stand in for the worker's socket."""
    try:
        StateFolder.open(folder, private=True).close()
    except StateFolderError as e:
        raise NodeConfigError(f"node-config {e}") from None
    return Path(os.path.abspath(folder))


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


# How Flower splits a --node-config into pairs (flwr.common.config.parse_config_args): KEY=VALUE,
# the value in quotes or up to the next space.
PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def owner_pairs(text: str) -> dict:
    """The owner's `fedsd data-service --node-config`: 'k=v ...' pairs (`pairs_of`), or a .toml
    file of them, as Flower reads a SuperNode's (a table's keys joined by dots)."""
    if "=" in text or not text.strip().endswith(".toml"):
        return pairs_of(text)
    from flwr.common.config import parse_config_args  # Flower's own reader of a node config's .toml

    try:
        return parse_config_args([text.strip()])
    except OSError as e:
        raise NodeConfigError(f"--node-config {text!r}: {e.strerror}") from None
    except ValueError as e:  # TOMLDecodeError
        raise NodeConfigError(f"--node-config {text!r}: not a TOML file ({e})") from None


def pairs_of(text: str) -> dict:
    """An owner's `--node-config 'k=v ...'` (`fedsd data-service`) as a dict, its values TOML as
    Flower reads a SuperNode's: a number, true or false, or a string in quotes. A key whose
    value is a string (state-dir, data, secagg-roster, ...) also takes it unquoted, up to the
    next space: state-dir=/srv/owner/state is the string '/srv/owner/state', as nothing else
    could be meant. Text that is not a pair (a path with a space, unquoted) and a key given
    twice are refused, as is a value that is not TOML, each with the form to type."""
    stray = PAIR.sub(" ", text).split()
    if stray:
        raise NodeConfigError(f"--node-config {text!r}: {stray[0]!r} is not a key=value pair (a value with a space "
                              f"goes in quotes: data='/srv/owner data')")
    pairs = {}
    for key, raw in PAIR.findall(text):
        if key in pairs:
            raise NodeConfigError(f"--node-config {text!r}: {key} given twice")
        pairs[key] = _toml_value(key, raw, text)
    return pairs


def _toml_value(key: str, raw: str, text: str):
    declared = KEYS.get(RENAMED_KEYS.get(key, key))
    if (declared is None or declared.type is str) and raw[0] not in "'\"":
        # a string's key: the value as typed, which TOML would want in quotes (an unknown key: refused later)
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        quoted = f"'{raw}'" if "'" not in raw else f'"{raw}"'
        raise NodeConfigError(f"--node-config {text!r}: not 'k=v ...' pairs with TOML values: {key}={raw} is not "
                              f"a number, true or false, or a string in quotes ({key}={quoted}; e.g. "
                              f"max-epsilon=3 state-dir='/srv/owner/state')") from None


def parse_partition_id(node_config: Mapping) -> int | None:
    """The node's partition id where it is a valid one, else None (to name a refusing client)."""
    try:
        value = _value("partition-id", node_config["partition-id"])
    except (KeyError, ConfigError):
        return None
    return value if value >= 0 else None
