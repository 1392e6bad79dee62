"""Federated settings, free of Flower: what a federation adds to a TrainConfig, the flat
key/value form both travel in (Flower's run config and each round's ConfigRecord), and the
epoch numbering that lines a federation up with central training (SPEC §5, §8)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from .config import ConfigError, TrainConfig

PARTITIONS = ("iid", "dirichlet", "pathological")
STRATEGIES = ("fedavg", "fedadam", "fedprox")
TEACHER_MODES = ("round-start", "local-previous")


@dataclass
class FedOptions:
    num_clients: int = 10
    rounds: int = 5
    local_epochs: int = 1
    fraction_train: float = 1.0
    partition: str = "iid"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    teacher: str = "round-start"
    strategy: str = "fedavg"
    proximal_mu: float = 0.01  # FedProx
    server_lr: float = 0.1  # FedAdam's η
    budget_rounds: int = 0  # rounds a client calibrates σ for; 0 = every round of the run
    server_dp_noise: float = 0.0  # user-level DP at the server (Flower's fixed clipping); 0 = off
    server_dp_clip: float = 1.0
    client_cpus: float = 1.0
    client_gpus: float = 0.0
    out_dir: str = ""
    resume_dir: str = ""  # continue the run whose checkpoint.pt is there
    round_timeout: float = 3600.0  # seconds the server waits for a round's replies
    min_nodes: int = 0  # nodes a round after a launch's first needs connected; 0 = half the sampled clients
    experiment_id: str = ""  # set by the server: names each client's on-disk privacy state

    @property
    def planned_rounds(self) -> int:
        return self.budget_rounds or self.rounds

    def validate(self) -> None:
        def check(ok, option, allowed, value):
            if not ok:
                raise ConfigError(f"{option}: {allowed}, got {value!r}")
        check(self.num_clients >= 1, "--clients", "must be >= 1", self.num_clients)
        check(self.rounds >= 1, "--rounds", "must be >= 1", self.rounds)
        check(self.local_epochs >= 1, "--local-epochs", "must be >= 1", self.local_epochs)
        check(0 < self.fraction_train <= 1, "--fraction-train", "must be in (0, 1]", self.fraction_train)
        check(self.partition in PARTITIONS, "--partition", f"choose one of {', '.join(PARTITIONS)}", self.partition)
        check(self.strategy in STRATEGIES, "--strategy", f"choose one of {', '.join(STRATEGIES)}", self.strategy)
        check(self.teacher in TEACHER_MODES, "--teacher", f"choose one of {', '.join(TEACHER_MODES)}", self.teacher)
        check(math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0, "--dirichlet-alpha",
              "must be > 0", self.dirichlet_alpha)
        check(self.classes_per_client >= 1, "--classes-per-client", "must be >= 1", self.classes_per_client)
        check(self.proximal_mu >= 0, "--proximal-mu", "must be >= 0", self.proximal_mu)
        check(self.server_lr > 0, "--server-lr", "must be > 0", self.server_lr)
        check(self.budget_rounds >= 0, "--budget-rounds", "must be >= 0", self.budget_rounds)
        check(self.server_dp_noise >= 0, "--server-dp-noise", "must be >= 0", self.server_dp_noise)
        check(self.server_dp_clip > 0, "--server-dp-clip", "must be > 0", self.server_dp_clip)
        check(self.client_cpus > 0, "--client-cpus", "must be > 0", self.client_cpus)
        check(self.client_gpus >= 0, "--client-gpus", "must be >= 0", self.client_gpus)
        check(self.round_timeout > 0, "--round-timeout", "must be > 0 seconds", self.round_timeout)
        check(0 <= self.min_nodes <= self.num_clients, "--min-nodes", f"must be in [0, {self.num_clients}]",
              self.min_nodes)


def client_config(cfg: TrainConfig, fed: FedOptions) -> TrainConfig:
    """The client's TrainConfig: it plans for every local epoch of every budgeted round."""
    return dataclasses.replace(cfg, epochs=fed.planned_rounds * fed.local_epochs).resolved()


def round_epochs(server_round: int, local_epochs: int) -> list[int]:
    """The global (1-based) epoch numbers of a round: with one client and E = 1, round r is
    central epoch r."""
    return list(range((server_round - 1) * local_epochs + 1, server_round * local_epochs + 1))


# -- the flat form: kebab-case keys, no None (TOML and ConfigRecord have none) ----------------
# -1 (or "") stands for "not set": the paper's default; never 0, since α = 0 is a real ablation.
_NONE = {int: -1, float: -1.0, str: ""}
_SKIP = {"extra"}


_KEYS = {"rounds": "num-server-rounds"}  # Flower's own name for it


def _kebab(name: str) -> str:
    return _KEYS.get(name, name.replace("_", "-"))


def _field_types(cls) -> dict[str, type]:
    hints = {}
    for f in fields(cls):
        if f.name in _SKIP:
            continue
        t = str(f.type)
        hints[f.name] = bool if "bool" in t else int if "int" in t else float if "float" in t else str
    return hints


def to_flat(cfg: TrainConfig, fed: FedOptions) -> dict:
    flat = {}
    for cls, obj in ((TrainConfig, cfg), (FedOptions, fed)):
        for name, typ in _field_types(cls).items():
            value = getattr(obj, name)
            flat[_kebab(name)] = _NONE.get(typ, value) if value is None else value
    return flat


def from_flat(flat: dict) -> tuple[TrainConfig, FedOptions]:
    """Inverse of to_flat; a missing key keeps its default, and -1 / "" in an optional
    TrainConfig setting means "the paper's default for this data set"."""
    flat = {k.replace("_", "-"): v for k, v in flat.items()}
    out = []
    for cls in (TrainConfig, FedOptions):
        defaults = cls()
        values = {}
        for name, typ in _field_types(cls).items():
            key = _kebab(name)
            if key not in flat:
                continue
            value = flat[key]
            optional = cls is TrainConfig and getattr(defaults, name) is None
            if optional and value in (-1, -1.0, ""):
                value = None
            elif typ is bool:
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif value is not None:
                value = typ(value)
            values[name] = value
        out.append(cls(**values))
    return out[0], out[1]
