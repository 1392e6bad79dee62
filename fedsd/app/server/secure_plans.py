"""What the server plans and bounds under secure aggregation (the rounds: fedsd.app.server.secure_rounds):
under noise=distributed, the run's noise plan and the server's optimizer (`distributed_plan`;
at privacy-unit=client, `client_level_plan`), refused before any round when the run cannot be
one; with local noise, the bound the survivors' mean update stays below (`local_noise_bound`); the
graph a round's cohort runs on (`round_graph`).
"""
from __future__ import annotations

import math

from fedsd.secure import distributed_noise, sum_bound
from fedsd.errors import ConfigError
from fedsd.secure.ring import Graph, choose_graph
from fedsd.secure.secagg import MAX_NEIGHBOURS
from fedsd.settings.federation import RING_ABOVE, deployed_honest_clients
from fedsd.app import secure_sum

RUN_CONFIG = {"clients": "num-clients", "honest": "honest-clients", "colluders": "secagg-max-colluders",
              "dropout": "secagg-dropout", "graph": "secagg-graph"}


def round_graph(fed, n: int) -> Graph | None:
    """The graph a deployed round's cohort of n runs on (secagg-graph, as `fedsd simulate` picks it:
    fedsd.secure.ring.choose_graph): None for the complete graph, else the ring, its t
    honest-clients (0: the owners' default secagg-min-clients) and F secagg-max-colluders, which
    every owner checks against its own. ConfigError naming the run config where none fits. The
    multi-round protocol (secure-sum=multi-round) is set up on the complete graph: auto is complete there."""
    setting = fed.secagg_graph
    if fed.secure_sum == "multi-round":
        if setting == "ring":
            raise ConfigError("secagg-graph=ring: secure-sum=multi-round sets its run up on the complete graph; take "
                              "secagg-graph=complete (or auto), or secure-sum=protocol for a ring")
        setting = "complete"
    try:
        return choose_graph(setting, n, deployed_honest_clients(fed), fed.secagg_max_colluders, fed.secagg_dropout,
                            most=MAX_NEIGHBOURS, ring_above=RING_ABOVE, spelled="{}={}", names=RUN_CONFIG,
                            plain="secure-sum=protocol (multi-round's setup is on the complete graph)"
                            if fed.secure_sum == "multi-round" else "fewer owners a run")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def local_noise_bound(cfg, fed, dim: int) -> float:
    """The L2 norm the mean of the survivors' local-noise updates stays below: the run's public
    bound on one honest update (fedsd.secure.sum_bound.public_local_bound, which every owner scales
    its update down to) plus each update's fixed-point rounding, half a unit a coordinate. No
    client's report enters it: a member cannot loosen it."""
    return sum_bound.public_local_bound(cfg, fed, dim) + math.sqrt(dim) / secure_sum.SCALE


def distributed_plan(cfg, fed, num_classes: int):
    """noise=distributed in a deployment: the run's noise plan (one Skellam-noised DP-SGD step a
    round at the run's q = sample-rate; batch-size is the federation's expected batch, t
    honest-clients) and the server's optimizer. Refused (ConfigError) before any round when the
    run cannot be one."""
    from fedsd.secure.distributed_step import DISTRIBUTED_METHODS, ServerOptimizer, dimension
    from fedsd.models.networks import model_for

    honest = deployed_honest_clients(fed)  # honest-clients 0: the owners' default secagg-min-clients, 2
    if fed.client_data != "own":  # every owner would refuse it at its first stage: said before round 1
        raise ConfigError(f"client-data={fed.client_data}: noise=distributed in a deployment draws each "
                          f"owner's batch and noise from its own data and its own secret stream; set client-data=own "
                          f"(each SuperNode's owner names its data in its node config)")
    if fed.privacy_unit == "client":
        return client_level_plan(cfg, fed, num_classes, honest)
    if fed.local_epochs != 1:
        raise ConfigError(f"local-epochs={fed.local_epochs}: noise=distributed takes one step a round (the server "
                          f"applies each step); leave it at 1")
    if not 0 < fed.sample_rate <= 1:
        raise ConfigError("sample-rate: noise=distributed in a deployment needs the run's q, batch-size / the "
                          "federation's records (each client draws at it)")
    if cfg.method not in DISTRIBUTED_METHODS:
        raise ConfigError(f"method={cfg.method}: noise=distributed runs {', '.join(DISTRIBUTED_METHODS)}")
    if honest < 1:
        raise ConfigError("honest-clients: noise=distributed in a deployment needs t, the fewest clients whose "
                          "shares the noise counts on")
    net = model_for(cfg, num_classes)
    plan = distributed_noise.calibrated(cfg.epsilon, cfg.delta, cfg.clip, fed.sample_rate, float(cfg.batch_size),
                                        fed.rounds, honest, dimension(net))
    return plan, ServerOptimizer(net, cfg.lr, cfg.momentum)


def client_level_plan(cfg, fed, num_classes: int, honest: int):
    """privacy-unit=client in a deployment (fedsd.secure.client_level): every client every round
    (q = 1), each update clipped to update-clip by its owner, the sum over n applied with learning
    rate 1 (FedAvg of the clipped, noised updates), as `fedsd simulate --privacy-unit client`."""
    from fedsd.models.networks import model_for
    from fedsd.secure import client_level
    from fedsd.secure.distributed_step import ServerOptimizer, dimension

    if cfg.method != "dpsgd":
        raise ConfigError(f"method={cfg.method}: privacy-unit=client trains each client's update without noise and "
                          f"without a teacher (method=dpsgd); self-distillation is record level")
    if not 1 <= honest <= fed.num_clients:
        raise ConfigError(f"honest-clients={fed.honest_clients}: t must be in [1, num-clients={fed.num_clients}]")
    net = model_for(cfg, num_classes)
    adapting = fed.update_clip_quantile > 0  # each client's bit: one coordinate more (client_level.AdaptiveUpdateClip)
    plan = client_level.calibrated(cfg.epsilon, cfg.delta, fed.update_clip, fed.num_clients, fed.rounds, honest,
                                   dimension(net) + adapting)
    optimizer = ServerOptimizer(net, client_level.server_lr(fed), 0.0)
    if adapting:
        client_level.AdaptiveUpdateClip.of(fed, plan)  # σ_b refused before round 1
        optimizer.update_clip = fed.update_clip
    return plan, optimizer
