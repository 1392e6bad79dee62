"""Federated settings, free of Flower: what a federation adds to a TrainConfig, the flat
key/value form both travel in (Flower's run config and each round's ConfigRecord), and the
epoch numbering that lines a federation up with central training (docs/algorithms.md)."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from fedsd.settings import declared as settings
from fedsd.settings.run import TrainConfig, check_setting, renamed_keys
from fedsd.errors import ConfigError
from fedsd.settings.declared import declared_only, setting

PARTITIONS = ("iid", "dirichlet", "inner-dirichlet", "pathological")
CLIENT_DATA = ("partition", "own")
STRATEGIES = ("fedavg", "fedadam", "fedprox")
NOISE = ("local", "distributed")
PRIVACY_UNITS = ("record", "client")
SECURE_SUMS = ("protocol", "multi-round", "plain")
SECAGG_GRAPHS = ("auto", "complete", "ring")
RING_ABOVE = 40  # secagg-graph=auto: the ring above this many clients (results/README.md, the graphs measured)
TEACHER_MODES = ("round-start", "local-previous", "global-ema")
# An owner's default secagg-min-clients, declared beside the settings' machinery (the node config
# imports it there without this module's, and with it torch's, import cost): a deployment's t where
# honest-clients is 0 (`deployed_honest_clients`), so that owners and server left at their defaults agree.
from fedsd.settings.declared import OWNER_MIN_CLIENTS  # noqa: E402


@dataclass
class FedConfig:
    """What a federation adds to a TrainConfig (fedsd.settings.declared: each setting declared once)."""

    num_clients: int = setting(10, "clients in the federation (a shard of the training set each); under "
                               "`flwr run`, 0 (the app's default, FLOWER_APP_DEFAULTS): one per SuperNode "
                               "of the federation", flag="--clients")
    rounds: int = setting(5, "federated rounds", key="num-server-rounds")  # Flower's own name for it
    client_data: str = setting("partition", "where a client's training data comes from: partition = its shard "
                               "of the built-in data set (simulations); own = the data its SuperNode names "
                               "(--node-config data=...), which the server never sees", choices=CLIENT_DATA)
    local_epochs: int = setting(1, "local epochs a client trains each round")
    fraction_train: float = setting(1.0, "fraction of the clients sampled each round")
    partition: str = setting("iid", "how the training set is split across clients (flwr-datasets' partitioners): "
                             "dirichlet = each class spread over the clients by Dirichlet(α), shard sizes vary; "
                             "inner-dirichlet = equal shard sizes, each client's labels drawn from Dirichlet(α), "
                             "which scales to thousands of clients", choices=PARTITIONS)
    dirichlet_alpha: float = setting(0.5, "dirichlet and inner-dirichlet partitions: concentration α (smaller: "
                                     "more skewed)")
    classes_per_client: int = setting(2, "pathological partition: classes per client")
    teacher: str = setting("round-start", "self-distillation teacher: round-start = the round's global model; "
                           "local-previous = the client's own model from its previous round; global-ema = an "
                           "exponential moving average of the global models the client has received (all of "
                           "them released models: no privacy cost)", choices=TEACHER_MODES)
    teacher_ema_decay: float = setting(0.9, "teacher=global-ema: the average's decay per round")
    strategy: str = setting("fedavg", "server aggregation", choices=STRATEGIES)
    proximal_mu: float = setting(0.01, "FedProx: weight μ of the pull towards the global model")
    server_lr: float = setting(0.1, "FedAdam: the server's learning rate η; with --update-clip-normalize, the "
                               "server's step per unit of clip")
    federated_evaluation: bool = setting(False, "clients also evaluate each round's global model on their own "
                                         "test split and the server averages (weighted by count); a custom "
                                         "task, which has no public test split, always does. Releases each "
                                         "client's test accuracy, outside the DP guarantee")
    secure_aggregation: bool = setting(False, "the server learns only the sum of the clients' updates (SecAgg+, run "
                                       "by each client: in a deployment by its owner's data service)")
    noise: str = setting("local", "where the DP noise is added: local = each client adds all of it to its own "
                         "update; distributed = with --secure-aggregation, each client adds a share and only the "
                         "sum carries all of it (one DP-SGD step a round; --batch-size is then the federation's "
                         "expected batch and --rounds its steps)", choices=NOISE)
    honest_clients: int = setting(0, "--noise distributed: t, the fewest clients assumed honest; each client's "
                                  "share is sized so that any t shares give the target σ, and a round with fewer "
                                  "clients is refused. 0 = every client in a simulation; in a deployment, 2 (each "
                                  "owner refuses a t above its own secagg-min-clients, whose default is 2)")
    sample_rate: float = setting(0.0, "--noise distributed in a deployment: q, the rate at which every client draws "
                                 "each of its records into a round's Poisson batch (public: batch-size / the "
                                 "federation's records); 0 = a simulation's, batch-size / its training samples",
                                 cli=False)
    privacy_unit: str = setting("record", "--noise distributed: what one guarantee protects: record = each "
                                "training record (one DP-SGD step a round); client = a whole client (each client "
                                "trains --local-epochs without noise, clips its update to --update-clip and adds "
                                "its share; every client every round, the server applies the mean, ε is each "
                                "client's)", choices=PRIVACY_UNITS)
    secagg_threshold: int = setting(0, "--secure-aggregation: the shares needed to unmask (each client's neighbours); "
                                    "0 = more than two thirds. An owner with secagg-max-colluders f refuses a "
                                    "threshold at or below (neighbours + f) / 2", cli=False)
    secagg_graph: str = setting("auto", "--secure-aggregation: whom each client shares with and masks with. "
                                "complete = every other client (each client's cost grows with the clients); ring = its "
                                "k nearest on a ring every owner derives from the round and cohort, k from the "
                                "clients, --honest-clients, --secagg-max-colluders and --secagg-dropout "
                                f"(docs/design/sparse-secure-aggregation.md); auto = the ring above "
                                f"{RING_ABOVE} clients where one fits, else complete", choices=SECAGG_GRAPHS)
    secagg_max_colluders: int = setting(0, "--secure-aggregation on a ring: F, the most of a round's clients the "
                                        "graph is planned against as the server's (each owner refuses a ring "
                                        "planned for fewer than its own secagg-max-colluders)")
    secagg_dropout: float = setting(0.05, "--secure-aggregation on a ring: the fraction of a round's clients the graph "
                                    "is planned to lose at random between stages (k grows with it; a round still "
                                    "goes through with probability 1 - 2^-20)")
    secagg_max_records: int = setting(60_000, "--secure-aggregation: the most training records a client is taken "
                                      "to hold, a public number. With local noise, the server bounds an honest "
                                      "update from the run's public numbers alone (no client's report moves the "
                                      "bound); an owner scales an update above that bound down to it before it "
                                      "enters the sum. With distributed noise at record level, an owner without "
                                      "its own max-records draws at the rate whose batch of this many records "
                                      "fits its padded step, at most q (spending less), whatever it holds",
                                      cli=False)
    secagg_roster: str = setting("", "--secure-aggregation in a deployment: the server's copy of the owners' roster "
                                 "(public keys); a node whose identity is not on it is left out of every round and "
                                 "named. Each owner checks its own copy; this one only keeps strangers out early",
                                 cli=False)
    secure_sum: str = setting(
        "protocol", "fedsd simulate --noise distributed: how the round's sum is made. protocol = every round runs the "
        "whole secure-aggregation protocol between the simulated clients and the server; multi-round = the protocol "
        "set up once a run, every round's secrets dealt ahead, two exchanges a round "
        "(docs/design/multi-round-secure-aggregation.md; deployed, it needs each owner's roster and record-dir); "
        "plain = the same clients' vectors "
        "added in this process without masks: the same sum bit for bit (so the same run, weights and ε), without the "
        "protocol's cost, which grows with the square of the clients (studies at many clients, as TFF's "
        "distributed-DP studies simulate the secure sum). A Flower run takes protocol or multi-round",
        choices=SECURE_SUMS)
    update_clip: float = setting(0.1, "--privacy-unit client: the L2 norm S each client clips its model update to")
    update_clip_quantile: float = setting(0.0, "--privacy-unit client: adaptive clipping of the updates (Andrew et "
                                          "al. 2021): --update-clip is where S starts, and it follows this quantile "
                                          "of the clients' update norms, each client's below-S bit inside its "
                                          "masked vector; 0: S stays --update-clip")
    update_clip_lr: float = setting(0.2, "--update-clip-quantile: the clip's geometric learning rate η (the paper's)")
    update_clip_count_noise: float = setting(0.0, "--update-clip-quantile: the std σ_b of the noise on each round's "
                                             "count of clients below S (0: clients/20, the paper's, raised to 4 "
                                             "times the run's noise multiplier z where below it); the update's "
                                             "noise is raised so that the two spend the run's ε (by 1/√(1 − "
                                             "(z/2σ_b)²): 1.008× at 4z, 1.155× at z)")
    update_clip_normalize: bool = setting(False, "--update-clip-quantile: the server steps by --server-lr times each "
                                          "round's mean update over that round's clip S (post-processing), so "
                                          "that a clip that moves changes which updates are clipped, not the "
                                          "step's size (at --server-lr S the step is plain FedAvg's at clip S)")
    local_steps: int = setting(0, "--privacy-unit client: each client's SGD steps a round, each on --batch-size of "
                               "its records drawn with replacement, so that its work does not depend on how many "
                               "it holds (an owner's service requires it); 0 = --local-epochs passes over them")
    budget_rounds: int = setting(0, "rounds each client calibrates σ for; 0 = every round of the run")
    server_dp_noise: float = setting(0.0, "user-level DP at the server (Flower's fixed clipping): noise "
                                     "multiplier; 0 = off. A separate guarantee, not in ε")
    server_dp_clip: float = setting(1.0, "server-side DP: clipping norm of a client's update")
    client_cpus: float = setting(1.0, "CPUs a simulated client takes (Ray's scheduler)")
    client_gpus: float = setting(0.0, "GPUs a simulated client takes (fractional shares one)")
    out_dir: str = setting("", "result folder of a Flower run; \"\" = fedsd-runs/<dataset>-<method>-<time>",
                           cli=False)  # the command line has --out
    resume_dir: str = setting("", "go on with the run in this folder after its last completed round",
                              flag="--resume")
    round_timeout: float = setting(3600.0, "seconds the server waits for a round's replies")
    min_nodes: int = setting(0, "nodes a round after a launch's first needs connected; 0 = half the "
                             "sampled clients")
    experiment_id: str = setting("", "set by the server: names each client's on-disk privacy state", cli=False)

    @property
    def planned_rounds(self) -> int:
        return self.budget_rounds or self.rounds

    @classmethod
    def from_dict(cls, saved: dict) -> "FedConfig":
        """Options as a run saved them, by any version of fedsd (settings.declared_only)."""
        return cls(**declared_only(cls, saved))

    def validate(self) -> None:
        check = check_setting
        check(self.num_clients >= 1, "--clients", "must be >= 1", self.num_clients)
        check(self.rounds >= 1, "--rounds", "must be >= 1", self.rounds)
        check(self.local_epochs >= 1, "--local-epochs", "must be >= 1", self.local_epochs)
        check(0 < self.fraction_train <= 1, "--fraction-train", "must be in (0, 1]", self.fraction_train)
        settings.check_choices(self)  # --client-data, --partition, --strategy, --teacher, as declared
        check(0 <= self.teacher_ema_decay < 1, "--teacher-ema-decay", "must be in [0, 1)", self.teacher_ema_decay)
        check(math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0, "--dirichlet-alpha",
              "must be > 0", self.dirichlet_alpha)
        check(self.classes_per_client >= 1, "--classes-per-client", "must be >= 1", self.classes_per_client)
        check(self.proximal_mu >= 0, "--proximal-mu", "must be >= 0", self.proximal_mu)
        check(self.server_lr > 0, "--server-lr", "must be > 0", self.server_lr)
        check(self.budget_rounds >= 0, "--budget-rounds", "must be >= 0", self.budget_rounds)
        check(self.noise == "local" or self.secure_aggregation, "--noise distributed",
              "needs --secure-aggregation (without it the server would see each client's share, which alone is far "
              "below the noise the guarantee counts)", self.noise)
        check(self.privacy_unit == "record" or (self.noise == "distributed" and self.secure_aggregation),
              "--privacy-unit client", "needs --noise distributed and --secure-aggregation (each client adds its "
              "share; the server sees only the sum)",
              f"noise={self.noise}, secure-aggregation={self.secure_aggregation}")
        check(self.secure_sum == "protocol" or (self.noise == "distributed" and self.secure_aggregation),
              f"--secure-sum {self.secure_sum}", "is a way of making fedsd simulate --secure-aggregation --noise "
              "distributed's sum (the same sum bit for bit)",
              f"noise={self.noise}, secure-aggregation={self.secure_aggregation}")
        check(math.isfinite(self.sample_rate) and 0 <= self.sample_rate <= 1, "sample-rate", "must be in [0, 1]",
              self.sample_rate)
        check(math.isfinite(self.update_clip) and self.update_clip > 0, "--update-clip", "must be > 0",
              self.update_clip)
        check(self.update_clip_quantile == 0 or 0 < self.update_clip_quantile < 1, "--update-clip-quantile",
              "must be in (0, 1), or 0 for a fixed clip", self.update_clip_quantile)
        check(self.update_clip_quantile == 0 or self.privacy_unit == "client", "--update-clip-quantile",
              "applies to --privacy-unit client (records: --clip-quantile)", self.update_clip_quantile)
        check(math.isfinite(self.update_clip_lr) and 0 < self.update_clip_lr <= 10, "--update-clip-lr",
              "must be in (0, 10]", self.update_clip_lr)
        check(not self.update_clip_quantile or self.update_clip <= 1e6, "--update-clip",
              "with --update-clip-quantile, the clip's start must be at most 1e6", self.update_clip)
        check(not self.update_clip_normalize or self.update_clip_quantile > 0, "--update-clip-normalize",
              "applies to --update-clip-quantile", self.update_clip_normalize)
        check(math.isfinite(self.update_clip_count_noise) and self.update_clip_count_noise >= 0,
              "--update-clip-count-noise", "must be a finite number > 0 (0: the larger of clients/20 and 4z)",
              self.update_clip_count_noise)
        check(self.secagg_max_records >= 1, "secagg-max-records", "must be >= 1", self.secagg_max_records)
        check(self.local_steps >= 0, "--local-steps", "must be >= 0 (0: --local-epochs passes)", self.local_steps)
        check(self.local_steps == 0 or self.privacy_unit == "client", "--local-steps", "applies to --privacy-unit "
              "client (record level takes one DP-SGD step, or --local-epochs, a round)", self.local_steps)
        check(self.server_dp_noise >= 0, "--server-dp-noise", "must be >= 0", self.server_dp_noise)
        check(self.server_dp_clip > 0, "--server-dp-clip", "must be > 0", self.server_dp_clip)
        check(self.client_cpus > 0, "--client-cpus", "must be > 0", self.client_cpus)
        check(self.client_gpus >= 0, "--client-gpus", "must be >= 0", self.client_gpus)
        check(self.round_timeout > 0, "--round-timeout", "must be > 0 seconds", self.round_timeout)
        check(0 <= self.min_nodes <= self.num_clients, "--min-nodes", f"must be in [0, {self.num_clients}]",
              self.min_nodes)
        # A client names its on-disk state after it: a name, never a path (`../..`, `/etc`).
        check(not self.experiment_id or EXPERIMENT_ID.fullmatch(self.experiment_id) is not None, "experiment-id",
              "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64", self.experiment_id)


# Where the Flower app's run config (pyproject.toml) differs from the declared defaults. Under
# `flwr run` the federation, not the app, says how many SuperNodes there are (Flower's local
# simulation starts 2 unless told otherwise): the server counts them (fedsd.app.server.server_app.one_client_per_node).
FLOWER_APP_DEFAULTS = {"num-clients": 0}

EXPERIMENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def deployed_honest_clients(fed: FedConfig) -> int:
    """t of a deployment under noise=distributed: honest-clients, else OWNER_MIN_CLIENTS (at most
    num-clients). Not every client, as a simulation's 0 means: an owner refuses a plan whose t is
    above its own secagg-min-clients, and that is 2 unless its owner says otherwise."""
    return fed.honest_clients or min(OWNER_MIN_CLIENTS, max(fed.num_clients, 1))


def client_config(cfg: TrainConfig, fed: FedConfig) -> TrainConfig:
    """The client's TrainConfig: it plans for every local epoch of every budgeted round."""
    if cfg.feature_norm != "group":
        # Each client would release noisy statistics of its own shard, and under a non-IID
        # partition they differ: the global model would see as many normalisations as clients.
        # One shared normalisation needs the statistics aggregated before round 1 (not built).
        raise ConfigError(f"--feature-norm {cfg.feature_norm}: central runs only; a federation normalises "
                          "the features per sample (--feature-norm group)")
    if cfg.clip_quantile and fed.secure_aggregation:
        # Each owner's count would have to join the secure sum, its noise distributed as the
        # update's; until then an owner's clip estimate would be one more number beside its masked vector.
        raise ConfigError("--clip-quantile: adaptive clipping is not built under --secure-aggregation yet; give a "
                          "fixed --clip (--clip-quantile 0)")
    return dataclasses.replace(cfg, epochs=fed.planned_rounds * fed.local_epochs).resolved()


def round_epochs(server_round: int, local_epochs: int) -> list[int]:
    """The global (1-based) epoch numbers of a round: with one client and E = 1, round r is
    central epoch r."""
    return list(range((server_round - 1) * local_epochs + 1, server_round * local_epochs + 1))


# -- the flat form: what Flower's run config, each round's ConfigRecord and a checkpoint hold -
def to_flat(cfg: TrainConfig, fed: FedConfig) -> dict:
    return settings.to_flat(cfg, fed)


def from_flat(flat: dict) -> tuple[TrainConfig, FedConfig]:
    """Inverse of to_flat; a missing key keeps its default, and -1 / "" in an optional
    TrainConfig setting means "the paper's default for this data set". A key of fedsd 0.1's
    (alpha, tau-s, ...) is read under the run's method's new name, with a note."""
    flat = {k.replace("_", "-"): v for k, v in flat.items()}
    return settings.from_flat(renamed_keys(flat), TrainConfig, FedConfig)


