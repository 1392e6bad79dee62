"""What an owner's data service contributes to a secure sum at the masked-input stage
(fedsd.app.client.secure_stages answers the stages), and what admits and charges it.

The vector a client contributes is, with local noise (`contribution`), its ordinary training
update (the model delta after local training, which charges the ledger as a train round does),
in fixed point; under noise=distributed (`distributed_contribution`), its part of one DP-SGD step
of the federation: its clipped sum of a Poisson batch, quantised, with its Skellam share, after
the server's plan is checked against its own calibration (`_checked_plan`) and its ledger charged
(`_charge`), the plan it admitted pinned in its state folder (`admitted_plan`), its step padded as
fedsd.app.client.step_padding sizes it. At the advertise stage the same budgets are tried on a
copy of the ledger, before the owner joins (`admitted_at_advertise`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedsd.privacy import accounting as privacy
from fedsd.errors import ConfigError
from fedsd.app import secure_sum
from fedsd.app.records import record_to_model

from fedsd.app.client.secure_owner import Owner, StageRefused, _refused
from fedsd.app.client.step_padding import MAX_PADDED_BYTES, owner_rate, padded_rows, records_bound, row_bytes


def admitted_at_advertise(content: RecordDict, context: Context, owner: Owner) -> None:
    """Stage 0: whether this owner's budget (the run's own and its lifetime ledger) admits the
    round, tried on a copy of the ledger before it joins: an owner that cannot pay says so here,
    before any owner releases a masked input and is charged, so a round that cannot reach the
    threshold for want of budget is abandoned with nobody charged (it was charged to the owners
    that could, at the masked stage). The masked stage charges after the same checks. A refusal
    raises StageRefused (with "budget" alone where the ledger's figures would say more)."""
    from fedsd.app.client import handler
    from fedsd.errors import BudgetRefused, DataError, StateRolledBack

    config = content.get("config") if "config" in content else None
    if not isinstance(config, ConfigRecord):
        return  # a round without its settings is refused at the masked stage
    round_content = RecordDict({"config": config})
    if config.get("noise") == "distributed":
        plan, side, _, _ = _checked_plan(round_content, context, owner)
        if side.fed.privacy_unit != "client":  # what the masked stage refuses before its charge, said here
            records_bound(side, len(side.trainer.data.x_train))
        _charge(side, context, plan, handler.carried_state(side, context), dry_run=True)
        return
    try:
        side = handler.client_side(round_content, context, plain_release=False)
        refused = handler.admit(side, handler.carried_state(side, context), context, {}, dry_run=True)
    except (BudgetRefused, ConfigError, DataError, ValueError) as e:
        raise _refused(handler.hide_owner_paths(str(e), context.node_config)) from None
    except StateRolledBack as e:
        raise StageRefused(f"secure aggregation {handler.state_refused(e)}") from None
    if refused is not None:
        raise _refused(refused["refusal"]["reason"] if "refusal" in refused else
                       "this client would not train this round (its run's budget is spent)")

def contribution(content: RecordDict, context: Context, owner: Owner | None = None) -> tuple[np.ndarray, MetricRecord]:
    """This client's uint64 vector for the round and its metrics: its training update (the model
    delta after one round of local DP training, which charges the owner's ledger as a train
    round does), in fixed point. A refused round raises StageRefused with its reason."""
    from fedsd.app.client import handler

    round_content = RecordDict({"arrays": content["arrays"], "config": content["config"]})
    reply = handler.train_reply(round_content, context, into_sum=True)
    for record in ("refusal", "divergence"):
        if record in reply:
            raise _refused(reply[record]["reason"])
    if "arrays" not in reply:
        raise _refused("this client did not train this round (its run's budget is spent)")
    if int(reply["metrics"].get("replayed", 0)):
        # The round's update went into a sum already. Sent into a second sum, over another cohort,
        # the same vector would come out of the difference of the two: one update, one sum.
        raise _refused("this round's update went into a sum already; it goes into no other")
    from fedsd.secure import sum_bound
    from fedsd.settings.federation import client_config, from_flat

    cfg, fed = from_flat(dict(content["config"]))
    dim = sum(int(np.prod(content["arrays"][k].shape)) for k in secure_sum.float_keys(content["arrays"]))
    bound = sum_bound.public_local_bound(client_config(cfg, fed), fed, dim)  # the server checks the sum against it
    return (secure_sum.update_vector(content["arrays"], reply["arrays"], bound),
            public_counts(reply["metrics"], cfg.epsilon))


def public_counts(metrics: MetricRecord, run_epsilon: float) -> MetricRecord:
    """All a masked local-noise reply says beside its vector: its partition id (the owner's node
    config) and, as its ε, the run's (public, and above what it spent). Its record count, steps,
    σ, q and own ε (each a function of q = B / n) would tell how many records it holds, its
    seconds how long they took, its loss is a function of them: they stay with the owner."""
    return MetricRecord({"partition-id": int(metrics.get("partition-id", -1)), "skipped": 0,
                         "epsilon": float(run_epsilon)})


def _checked_plan(content: RecordDict, context: Context, owner: Owner):
    """The round's plan, checked against this owner's own calibration before anything is drawn
    (distributed_contribution); the client side, the owner's own plan and its t. A refusal
    raises StageRefused with a reason that tells the server none of the owner's paths."""
    from fedsd.app.client import handler
    from fedsd.secure import client_level, distributed_noise
    from fedsd.secure.distributed_step import DISTRIBUTED_METHODS, check_plan, dimension
    from fedsd.errors import BudgetRefused, DataError

    flat = dict(content["config"])
    try:
        plan, rounds = distributed_noise.from_settings(flat)
        sent = {"arrays": content["arrays"]} if "arrays" in content else {}  # none at stage 0 (admitted_at_advertise)
        side = handler.client_side(RecordDict({**sent, "config": ConfigRecord(flat)}), context, plain_release=False)
        fed, trainer, cfg = side.fed, side.trainer, side.trainer.cfg
        if not side.own_data:
            raise ConfigError("noise=distributed in a deployment: a client with its own data (client-data=own), "
                              "whose draws come from its secret stream")
        if not owner.node.secagg_roster and owner.node.secagg_trust != "honest-but-curious":
            # Without a roster a server can run every neighbour itself, with keys it made, and
            # unmask this owner's input alone: one share of the noise, μ / t (a review playing the
            # attacker did). Its owner may say it trusts the server to follow the protocol.
            raise ConfigError("noise=distributed without secagg-roster: the server could pose as every neighbour "
                              "and unmask this owner's input with its share of the noise alone; name the "
                              "federation's roster, or say secagg-trust=honest-but-curious")
        _check_unit(fed, cfg, DISTRIBUTED_METHODS, owner.node.max_local_steps)
        if rounds != fed.rounds:
            raise ValueError(f"distributed noise: the plan's length is {rounds} rounds, the run's {fed.rounds}")
        if not 1 <= side.server_round <= fed.rounds:
            raise ValueError(f"server-round {side.server_round}: outside the run's {fed.rounds} rounds")
        t = owner.node.secagg_min_clients
        if plan.honest > t:  # the others size their shares μ / plan's t: fewer than t of them would be < μ
            raise ValueError(f"distributed noise: the plan's t is {plan.honest}, above this owner's own {t} "
                             f"(secagg-min-clients): the other owners' shares, sized by the plan's t, would "
                             f"hold less noise than its t counts on (the run's honest-clients must be at most "
                             f"{t}, or this owner's secagg-min-clients at least {plan.honest})")
        if fed.privacy_unit == "client":  # S, q = 1, n and d this owner's; z at least its own
            adapting = fed.update_clip_quantile > 0  # its bit rides in one coordinate more
            own = client_level.calibrated(cfg.epsilon, cfg.delta, fed.update_clip, fed.num_clients, fed.rounds, t,
                                          dimension(trainer.model) + adapting)
            if adapting:  # the round's S' is the server's (it moves S; ε does not depend on it), the rest its own
                client_level.AdaptiveUpdateClip.of(fed, own).check_vector_clip(plan.clip)  # and σ_b > z/2
                own = dataclasses.replace(own, clip=plan.clip)
            client_level.check_plan(plan, own)
        else:
            if plan.expected_batch != float(cfg.batch_size):  # E is the run's public B, never the server's word
                raise ValueError(f"distributed noise: the plan's expected batch {plan.expected_batch:g} is not the "
                                 f"run's batch-size {cfg.batch_size} (the federation's expected batch)")
            own = distributed_noise.calibrated(cfg.epsilon, cfg.delta, cfg.clip, fed.sample_rate,
                                               float(cfg.batch_size), fed.rounds, t, dimension(trainer.model))
            check_plan(trainer, plan, own.noise_multiplier)  # C, q and length this owner's; z at least its own
    except (BudgetRefused, ConfigError, DataError, ValueError) as e:
        raise _refused(handler.hide_owner_paths(str(e), context.node_config)) from None
    return plan, side, own, t


def _check_unit(fed, cfg, methods, max_local_steps: int) -> None:
    """What each unit of protection takes in a round: record level, one DP-SGD step of a method
    that can be one; client level (fedsd.secure.client_level), `local-steps` steps of plain SGD,
    at most the owner's `max-local-steps` (a round's work is the owner's to bound)."""
    if fed.privacy_unit == "client":
        if fed.local_steps > max_local_steps:
            raise ConfigError(f"local-steps={fed.local_steps}: above this owner's max-local-steps={max_local_steps}")
        if cfg.method != "dpsgd":
            raise ConfigError(f"method={cfg.method}: privacy-unit=client trains each client's update without noise "
                              f"and without a teacher (method=dpsgd); self-distillation is record level")
        if fed.local_steps < 1:  # passes over its records would take a time that tells how many it holds
            raise ConfigError(f"local-steps={fed.local_steps}: privacy-unit=client in a deployment takes a fixed "
                              f"number of local steps a round (each on batch-size records drawn with "
                              f"replacement), so that its work does not depend on the owner's records; set it")
        return
    if fed.local_epochs != 1:
        raise ConfigError(f"local-epochs={fed.local_epochs}: noise=distributed takes one step a round (the "
                          f"server applies each step); 1 is the only value")
    if cfg.method not in methods:
        raise ConfigError(f"method={cfg.method}: noise=distributed runs {', '.join(methods)}")


def distributed_contribution(content: RecordDict, context: Context, owner: Owner) -> tuple[np.ndarray, MetricRecord]:
    """Under noise=distributed, record level (docs/algorithms.md, "Distributed noise"): one DP-SGD
    step's part, this owner's clipped sum of one Poisson batch at the run's q, quantised, with its
    Skellam share (fedsd.secure.distributed_step.contribution). The round's plan (the server's, in the
    round's settings: fedsd.secure.distributed_noise.to_settings) is hostile until checked against this
    owner's own calibration from the run's (ε, δ), q, C and length and its own t
    (secagg-min-clients), at least the plan's t, which sizes every honest share alike (μ / the
    plan's t: an owner's share sized by a larger own t would under-noise the others' sums); the owner's ledger then admits the run's
    whole plan on its first round and charges each round as Skellam steps, at integer orders,
    before anything is drawn (`_charge`). The plan admitted is pinned in the owner's state folder
    for the experiment, and a later round with another is refused (`admitted_plan`), as is a
    round this owner was charged for already.
    Its batch and noise come from a fresh secret stream; the per-sample work is padded to the
    run's public bound on any client's batch (padded_rows; an owner whose batch could pass it
    draws at a lower rate, owner_rate), so its time tells neither the batch nor its records. The metrics it releases are a function of the plan and of the rounds it
    took part in alone (`public_metrics`). A refusal raises StageRefused with its reason."""  # noqa: E501
    from fedsd.app.client import handler
    from fedsd.secure.distributed_step import contribution as step_part

    plan, side, own, t = _checked_plan(content, context, owner)
    cfg, trainer = side.trainer.cfg, side.trainer
    with handler.state_lock(side):
        request = handler.request_digest(side.server_round, content["arrays"])
        if handler.replayed_reply(side.state_file, request) is not None:
            raise _refused("this round's update went into a sum already; it goes into no other")
        offered = admitted_plan(side, plan)  # None: the plan this owner admitted; else its first round's
        state = handler.carried_state(side, context)
        if offered is not None and state is not None and state.steps > 0:
            raise _refused("this owner's state holds rounds of this experiment but no plan it admitted (a state "
                           "folder restored without it, or written before plans were pinned): refused, since "
                           "any plan now would be taken as the first")
        # What can fail without the data, before the charge: the model read and loaded, the padding sized.
        student, net, pad = _before_charge(side, plan, content["arrays"])
        bound = records_bound(side, len(trainer.data.x_train)) if net is None else 0
        _charge(side, context, plan, state)
        if offered is not None:  # pinned once the first round is charged: every later round must name it
            side.node.state().write_json(pinned_plan_name(side), offered)
        state = handler.secret_start() if state is None else dataclasses.replace(
            state, secret=handler.SecretStream.fresh(), rng_state=None)
        epoch = max(1, math.ceil(side.server_round * plan.sample_rate))
        try:
            if net is not None:
                vector, state = client_update(trainer, net, state, student, plan, own, side.fed)
            else:
                vector, state, _ = step_part(trainer, state, student, epoch, plan, key=None, honest=plan.honest,
                                             least_noise=own.noise_multiplier, pad_to=pad,
                                             draw_rate=owner_rate(plan, bound, pad))
        except Exception:  # charged and nothing released: the round still counts as taken part in
            handler.save_train_state(side.state_file, dataclasses.replace(state, steps=state.steps + 1), trainer.plan)
            raise
        handler.save_train_state(side.state_file, state, trainer.plan)  # the spent round on disk before the release
        handler.keep_reply(side.state_file, request, ArrayRecord({}), {}, summed=True)
    return vector, MetricRecord(public_metrics(plan, state.steps, cfg.delta, net is not None))


def _before_charge(side, plan, arrays):
    """(the round's student, client level's network holding it or None, the rows a record-level
    step is padded to): what can fail without the data, so that it fails before the charge (a
    model whose tensors are not this network's is refused here, not charged and then failed).
    The refusal is in fedsd's words, from the tensors' names and shapes alone: never an error's
    text from the device (an out-of-memory message counts the memory the owner's records take)."""
    from fedsd.models.networks import model_for

    trainer = side.trainer
    try:
        student = record_to_model(arrays)["student"]
    except (KeyError, ValueError) as e:
        raise _refused(f"the round's model is not this run's network: {type(e).__name__}") from None
    client = side.fed.privacy_unit == "client"
    if client and not trainer.cfg.batch_size * row_bytes(trainer.data.x_train) <= MAX_PADDED_BYTES:
        # its local steps hold batch-size rows at once: refused by public numbers alone
        raise _refused(f"batch-size={trainer.cfg.batch_size}: a local step would hold more than the "
                       f"{MAX_PADDED_BYTES >> 30} GiB of inputs an owner computes a step on")
    net = model_for(trainer.cfg, trainer.data.num_classes) if client else trainer.model
    mismatch = model_mismatch(net.state_dict(), student)
    if mismatch:
        raise _refused(f"the round's model is not this run's network: {mismatch}")
    if client:  # local_update loads the student into it, on the data's device
        return student, net, 0
    return student, None, padded_rows(plan, row_bytes(trainer.data.x_train), side.node.max_records or None)


def model_mismatch(own: dict, sent: dict) -> str:
    """What differs between the network's tensors and the model sent (names, shapes, kinds), in
    words; "" when it loads as it is."""
    missing, extra = sorted(set(own) - set(sent)), sorted(set(sent) - set(own))
    if missing or extra:
        return f"tensors missing {missing[:5]}, unknown {extra[:5]}"
    shaped = [k for k in own if tuple(own[k].shape) != tuple(sent[k].shape)
              or own[k].is_floating_point() != sent[k].is_floating_point()]
    return f"tensors of another shape or kind {shaped[:5]}" if shaped else ""


def client_update(trainer, net, state, student, plan, own, fed):
    """Client level (fedsd.secure.client_level, as `fedsd simulate --privacy-unit client` takes
    it): `local-steps` steps of plain SGD from the round's model, each on batch-size of this
    owner's records drawn with replacement (so the work, and the time it takes, does not tell
    how many records it holds), the update clipped to its own S, quantised, and its Skellam share
    (μ / the plan's t, at most its own) added, the key 16 bytes of the state's secret stream. The
    draws' generator is seeded from the same stream (64 bits: which records a step draws is no
    part of the guarantee, the noise is). The state counts the round and records it as the
    record-level Gaussian step it is for each record (z_e / 2 at q = 1: one record moves the
    clipped update by at most 2S)."""
    import torch

    from fedsd.secure import client_level

    cfg = trainer.cfg
    key, seed = state.secret.random_bytes(16), int.from_bytes(state.secret.random_bytes(8), "little")
    update, _ = client_level.local_update(net, trainer.data, student, fed.local_epochs, cfg.batch_size, cfg.lr,
                                          cfg.momentum, torch.Generator().manual_seed(seed), steps=fed.local_steps)
    adaptive = client_level.AdaptiveUpdateClip.of(fed, own)
    if adaptive is not None:  # the update clipped to S within the round's S', its below-S bit beside it, masked
        vector = client_level.adaptive_contribution(update, plan, own, key, adaptive)
    else:
        vector = client_level.update_contribution(update, plan, own, key)
    history = state.history + [[plan.gaussian_equivalent() / 2, 1.0, 1]]
    return vector, dataclasses.replace(state, history=history, steps=state.steps + 1)


def _charge(side, context: Context, plan, state, dry_run: bool = False) -> None:
    """The round admitted by the run's own budget and charged to the owner's ledger as one
    Skellam step at the plan's z_e (the run's whole plan admitted on the owner's first round),
    before anything is drawn; StageRefused with the reason, the ledger's bytes unchanged
    (`dry_run`: the same checks on a copy of the ledger, nothing charged or written). A
    round this owner was charged for already in this experiment (the ledger keys its charges by
    experiment and round) is refused: answered again, with a fresh batch and fresh noise, the
    same step would be released twice and one of the run's planned rounds spent on it."""
    from fedsd.app.client import handler
    from fedsd.errors import BudgetRefused, StateRolledBack
    from fedsd.secure import client_level

    fed, cfg = side.fed, side.trainer.cfg
    done = state.steps if state is not None else 0
    z_e, delta = plan.gaussian_equivalent(), cfg.delta
    # The ledger counts the owner's records. At client level a record moves the clipped update by
    # up to 2S: each round is, for a record, a Skellam step at z_e / 2, q = 1 (client_level.record_epsilon).
    whole = cfg.epsilon
    if fed.privacy_unit == "client":
        z_e, whole = z_e / 2, client_level.record_epsilon(plan, fed.rounds, delta)
    try:
        recorded = side.server_recorded_epsilon
        if recorded > plan.epsilon(done, delta) * (1 + 1e-6) + 1e-9:
            raise BudgetRefused(f"the server recorded ε = {recorded:.4f} spent by this client in this experiment, "
                                f"but its privacy state holds {done} rounds: the state was lost or replaced")
        if done + 1 > fed.rounds or plan.epsilon(done + 1, delta) > cfg.epsilon * (1 + 1e-9):
            raise BudgetRefused(f"the run's budget ε={cfg.epsilon:g} is spent ({done} rounds taken part in)")
        opened = handler.peeked_ledger if dry_run else handler.lifetime_ledger
        with opened(side.node, side.fingerprint) as ledger:
            if ledger is not None:
                if any(e.get("run") == fed.experiment_id and e.get("round") == side.server_round
                       for e in ledger.entries):
                    raise BudgetRefused(f"round {side.server_round} of this experiment: this owner was charged for "
                                        f"it already (a resumed run asks it again); a round is answered once")
                with handler.ledger_refusals():  # "budget" to the server, the figures in the owner's log
                    if state is None:  # this owner's first round of the run: the whole plan must fit
                        ledger.check(whole, delta, z_e, plan.sample_rate, fed.rounds, mechanism=privacy.SKELLAM)
                    ledger.spend(z_e, plan.sample_rate, 1, run=fed.experiment_id, mechanism=privacy.SKELLAM,
                                 flower_run=int(context.run_id), round=side.server_round)
    except BudgetRefused as e:
        raise _refused(e) from None
    except StateRolledBack as e:  # a restored, older state folder: the details in the owner's log alone
        raise StageRefused(f"secure aggregation {handler.state_refused(e)}") from None


def pinned_plan_name(side) -> str:
    """In the owner's state folder, beside its privacy state in the experiment: the plan it admitted."""
    return f"{side.fed.experiment_id}/client-{side.node.partition_id}-plan.json"


def admitted_plan(side, plan) -> dict | None:
    """The run's plan as this owner admits it on its first round of an experiment (ε and δ, the
    number of rounds, the unit protected, and the noise plan: z, C, q, the expected batch, t, d), to be pinned in its
    state folder once that round is charged; None when one is pinned already and this round's is
    the same. A plan other than the pinned one (a server that raises ε, lengthens the run, or
    changes q, C or z for later rounds, or after the service restarted) is refused, naming
    each setting that changed: the ledger admitted the pinned plan, not this one."""
    from fedsd.secure import distributed_noise

    cfg, fed = side.trainer.cfg, side.fed
    if fed.privacy_unit == "client" and fed.update_clip_quantile > 0:  # S' moves each round: pinned as the run's S
        plan = dataclasses.replace(plan, clip=fed.update_clip)
    offered = {"epsilon": cfg.epsilon, "delta": cfg.delta, "num-server-rounds": side.fed.rounds,
               "privacy-unit": side.fed.privacy_unit, **distributed_noise.to_settings(plan, side.fed.rounds)}
    try:
        pinned = side.node.state().read_json(pinned_plan_name(side))
    except ValueError:
        pinned = []
    if pinned is None:
        return offered
    if not isinstance(pinned, dict):  # damaged: every setting differs from it (admitted None)
        pinned = {}
    elif "privacy-unit" not in pinned:  # pinned before client level was deployed: record level was all there was
        pinned = {**pinned, "privacy-unit": "record"}
    changed = [f"{k} {offered.get(k)!r} (admitted {pinned.get(k)!r})" for k in sorted(set(offered) | set(pinned))
               if offered.get(k) != pinned.get(k)]
    if changed:
        raise _refused(f"this round's plan is not the one this owner admitted on its first round of this experiment: "
                       f"{', '.join(changed)}; a run's plan holds for its whole length (a new plan is a new "
                       f"experiment)")
    return None


def public_metrics(plan, rounds_taken: int, delta: float, client_unit: bool = False) -> dict:
    """All a service's masked reply says beside its vector under distributed noise: ε of the
    rounds it took part in, a function of the plan (public) and of its participation, which the
    server sees anyway; at client level also each single record's ε (at z_e / 2). No batch size,
    no step count, no loss, no time (clients/README.md)."""
    from fedsd.secure import client_level

    metrics = {"epsilon": float(plan.epsilon(rounds_taken, delta))}
    if client_unit:
        metrics["record-epsilon"] = float(client_level.record_epsilon(plan, rounds_taken, delta))
    return metrics
