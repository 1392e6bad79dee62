"""Secure aggregation in the owner's data service: the stages of SecAgg+ (fedsd.secure.secagg),
answered by the process that holds the data, the ledger, the secret randomness and the owner's
identity key.

Who this service is in the protocol is the owner's, never the server's: with a roster
(`secagg-roster`, fedsd.secure.identity) its id is its identity key's and every neighbour's keys,
commitments and view must carry that neighbour's roster signature; without one its id is its
node id and a key made for each round signs, which protects only against a server that follows
the protocol (said in the owner's log and in the identify reply, which the server's summary
shows). The service takes part in a round once: its sessions are keyed by (state folder, run,
experiment, round), and the last round it joined for each run and experiment is kept in its
state folder, so a second advertise for a round it joined, under any node id, after any number
of other rounds or a restart, is refused.

The service keeps one `SecAggClient` per round in memory, the last MAX_SESSIONS of them; its
private keys and its self-mask seed never leave it. Every stage message is hostile until
checked: its fields (fedsd.app.secure_sum.read_map), its round (the round id is derived here from the
run, the experiment and the round number, never taken from the message), the order of the
stages (a replayed or early one is refused), the owner's `secagg-min-clients` and
`secagg-max-colluders`, and the protocol's own checks. A refusal is a `StageRefused` with its
reason (naming a culprit by roster name), and comes before the ledger is charged: every
neighbour's key is checked and every agreement computed at the share stage, and every share is
decrypted and checked against its dealer's signed commitment before the masked-input stage
trains and charges (`SecAggClient.check_masked_input`).

The vector a client contributes is, with local noise (`contribution`), its ordinary training
update (the model delta after local training, which charges the ledger as a train round does),
in fixed point; under noise=distributed (`distributed_contribution`), its part of one DP-SGD step
of the federation: its clipped sum of a Poisson batch, quantised, with its Skellam share, after
the server's plan is checked against its own calibration and its ledger charged; with `secagg-keep-inputs=true` the owner keeps each round's vector, as released into the
sum, in state-dir/secagg/<run>-<experiment>-<round>-<id>.npy.
"""
from __future__ import annotations

import dataclasses
import io
import logging
import math
from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedsd.privacy import accounting as privacy
from fedsd.secure import secagg
from fedsd.errors import ConfigError
from fedsd.settings.federation import EXPERIMENT_ID
from fedsd.secure.identity import load_identity, read_roster
from fedsd.app import secure_sum
from fedsd.app.records import record_to_model
from fedsd.app.secure_sum import KEY_FIELDS, BadMessage, read_map, write_map

from fedsd.app.client import node_config as node_configs

log = logging.getLogger("fedsd.secure_aggregation")
MAX_SESSIONS = 8  # rounds a service keeps state for; an older one is dropped (its round cannot go on)
BARRED = "secagg-barred.json"  # in the state folder: members named with checkable evidence, per run and experiment
JOINED = "secagg-joined.json"  # in the state folder: each run and experiment's last round this owner joined
_SESSIONS: "OrderedDict[tuple, secagg.SecAggClient]" = OrderedDict()
RECORD_REFUSED = ("node-config record-dir: this owner's record folder is not its owner's alone, or cannot be read; its "
                  "owner's log says why")
UNAUTHENTICATED = ("secure aggregation without a roster (secagg-roster): this node protects its update only against "
                   "a server that follows the protocol")


class StageRefused(ValueError):
    """A stage message this service does not answer; the text says why, nothing of the data
    (the data service passes it on to the server as it is)."""


def _refused(e: object) -> StageRefused:
    return StageRefused(f"secure aggregation refused: {e}")


class Owner:
    """What the owner's node config and state folder say of this service in the protocol: its
    identity, its roster (None without one) and its id."""

    def __init__(self, node: node_configs.NodeConfig, context: Context):
        from fedsd.app.client.owner_checks import STATE_REFUSED

        self.node = node
        self.roster = read_roster(node.secagg_roster) if node.secagg_roster else None
        if self.roster is not None:
            try:
                state = node.state()
            except node_configs.NodeConfigError as e:  # in full in the owner's log, never the paths to the server
                log.warning("refused a round: %s", e)
                raise node_configs.NodeConfigError(STATE_REFUSED) from None
            self.identity = load_identity(state)
            self.id = self.identity.id
            if self.id not in self.roster:
                raise secagg.ProtocolError("this owner's identity is not on its own roster (fedsd data-service "
                                           "--identity prints the line to add)")
        else:
            self.identity, self.id = None, secure_sum.secagg_id(context.node_id)

    def join(self, key: tuple) -> None:
        """Record that this owner joined the round `key`, on disk and before it answers: a round at
        or below the last one it joined for that run and experiment is refused, whatever node id
        it comes under, however many other rounds came since, and after a restart. With own data,
        the owner's record outside the state folder is checked first and raised before the folder
        (fedsd.privacy.owner_record): a restored, older copy of the folder is refused, the server
        told only that the state refused."""
        from fedsd.app.client.handler import state_refused
        from fedsd.errors import StateRolledBack

        state = self.node.state()
        name = f"{key[1]}|{key[2]}"
        with state.lock(JOINED + ".lock"):
            joined = state.read_json(JOINED) or {}
            if not isinstance(joined, dict):
                raise secagg.ProtocolError(f"{JOINED} in the state folder does not parse; its owner's log has why")
            try:
                with self._recorded(state, joined):
                    if int(joined.get(name, 0)) >= key[3]:
                        raise secagg.ProtocolError(f"round {key[3]} was advertised to this owner already, or a later "
                                                   f"round of this run (under any node id, it takes part in a round "
                                                   f"once)")
                    joined[name] = key[3]
            except StateRolledBack as e:
                raise StageRefused(f"secure aggregation {state_refused(e)}") from None
            state.write_json(JOINED, joined)

    def _recorded(self, state, joined: dict):
        """The owner's record of the rounds this state folder joined, held around a join (nothing
        for a simulated client); its folder refused is said to the server without its path."""
        from contextlib import nullcontext

        try:
            records = self.node.records()
        except node_configs.NodeConfigError as e:
            log.warning("refused a round: %s", e)
            raise node_configs.NodeConfigError(RECORD_REFUSED) from None
        return nullcontext() if records is None else records.joined(state, joined)

    def client(self, round_id: bytes) -> secagg.SecAggClient:
        node = self.node
        return secagg.SecAggClient(self.id, round_id, min_cohort=node.secagg_min_clients,
                                   max_colluders=node.secagg_max_colluders, identity=self.identity, roster=self.roster)

    def refuse_spoilers(self, key: tuple, evidence: object, cohort: list) -> None:
        """A cohort holding a member named with checkable evidence of spoiling an earlier round of
        this run (fedsd.secure.secagg.verify_blame, against this owner's own roster) is refused
        before anything is drawn or charged. Evidence the server sends is checked here and kept
        in the state folder (BARRED), so a later round without it is refused all the same."""
        if self.roster is None:
            return  # without a roster no evidence can be checked: protected only against an honest server
        state, name = self.node.state(), f"{key[1]}|{key[2]}"
        with state.lock(BARRED + ".lock"):
            barred = state.read_json(BARRED) or {}
            if not isinstance(barred, dict):
                raise secagg.ProtocolError(f"{BARRED} in the state folder does not parse")
            known = {int(k): v for k, v in dict(barred.get(name, {})).items()}
            found = _checked_evidence(evidence, key, self.roster, known)
            if set(found) - set(known):
                barred[name] = {str(k): v for k, v in {**known, **found}.items()}
                state.write_json(BARRED, barred)
                known.update(found)
        spoilers = sorted(set(known) & {c for c in cohort if isinstance(c, int)})
        if spoilers:
            raise secagg.ProtocolError(f"the cohort holds {', '.join(self.roster.name(c) for c in spoilers)}, named "
                                       f"with evidence of spoiling round {known[spoilers[0]]} of this run "
                                       f"(culprit: {spoilers[0]})")


def _checked_evidence(evidence: object, key: tuple, roster, known: dict) -> dict[int, int]:
    """The spoilers the server's evidence (a JSON list of SecAggServer.evidence's records) proves,
    by protocol id → round: one item per roster member not `known` already, each for a round of
    this run and experiment before this one, its holders on the roster, checked against the
    roster's key of its dealer (one rebuilding of t shares each, t at most the roster's size).
    Evidence that does not check is passed over."""
    import json

    if not isinstance(evidence, str) or not evidence or len(evidence) > 1 << 22:
        return {}
    try:
        items = json.loads(evidence)
    except ValueError:
        return {}
    found = {}
    for item in (items if isinstance(items, list) else [])[:len(roster)]:
        if not isinstance(item, dict) or not isinstance(item.get("round"), int) or not 1 <= item["round"] < key[3]:
            continue
        dealer, holders = item.get("dealer"), item.get("holders")
        if not isinstance(dealer, int) or dealer in known or dealer in found or dealer not in roster or \
                not isinstance(holders, list) or not all(isinstance(h, int) and h in roster for h in holders):
            continue
        if item.get("round_id") == secure_sum.round_id(key[1], key[2], item["round"]).hex() and \
                secagg.verify_blame(item, roster.key(dealer)):
            found[dealer] = item["round"]
    return found


def _stage_fields(content: RecordDict, context: Context) -> tuple[tuple, ConfigRecord, Owner]:
    """The session key, the stage's own record and the owner, checked."""
    record = content.get(secure_sum.RECORD) if secure_sum.RECORD in content else None
    if not isinstance(record, ConfigRecord):
        raise BadMessage(f"a '{secure_sum.RECORD}' config record was expected")
    experiment, server_round = record.get("experiment-id"), record.get("server-round")
    if not isinstance(experiment, str) or EXPERIMENT_ID.fullmatch(experiment) is None:
        raise BadMessage("experiment-id: letters, digits, '.', '_' and '-', at most 64")
    if not isinstance(server_round, int) or isinstance(server_round, bool) or not 1 <= server_round <= 1 << 31:
        raise BadMessage("server-round: a positive integer")
    try:
        node = node_configs.parse(context.node_config)
    except ConfigError as e:  # in full in the owner's log; to the server without the owner's paths
        from fedsd.app.client.handler import hide_owner_paths

        log.warning("refused a round: %s", e)
        raise ConfigError(hide_owner_paths(str(e), context.node_config)) from None
    owner = Owner(node, context)
    return (owner.node.state_dir, int(context.run_id), experiment, server_round), record, owner


def _round_id(key: tuple) -> bytes:
    return secure_sum.round_id(*key[1:4])


def _session(key: tuple) -> secagg.SecAggClient:
    if key not in _SESSIONS:
        raise BadMessage(f"round {key[3]} of this run was not advertised to this client (or was dropped)")
    return _SESSIONS[key]


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


def identify_reply(content: RecordDict, context: Context) -> RecordDict:
    """Before stage 0: this service's id in the protocol and its identity's public key (empty
    without a roster), which the server needs to name the cohort, signed for this round and the
    node it answers for (so that no member can tell another owner's). Nothing secret, nothing kept."""
    try:
        key, _, owner = _stage_fields(content, context)
    except (BadMessage, secagg.ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    if owner.roster is None:
        log.warning(UNAUTHENTICATED)
        return RecordDict({secure_sum.RECORD: ConfigRecord({"id": owner.id, "v": b"", "sig": b"",
                                                            "authenticated": False})})
    signature = owner.identity.sign(secagg.identify_message(_round_id(key), context.node_id))
    return RecordDict({secure_sum.RECORD: ConfigRecord({"id": owner.id, "v": owner.identity.public, "sig": signature,
                                                        "authenticated": True})})


def advertise_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 0: the cohort, this client's neighbours, the threshold and the round's settings
    (checked at the masked input); its public keys, signed with the settings' digest, so that a
    neighbour given other settings fails every other client's check at share-keys."""
    try:
        key, record, owner = _stage_fields(content, context)
        if key in _SESSIONS:
            raise secagg.ProtocolError(f"round {key[3]} was advertised to this owner already (under any node id, "
                                       f"it takes part in a round once)")
        owner.refuse_spoilers(key, record.get("evidence"), list(record.get("cohort", [])))
        admitted_at_advertise(content, context, owner)
        client = owner.client(_round_id(key))
        keys = client.advertise(list(record.get("cohort", [])), list(record.get("neighbours", [])),
                                record.get("threshold"), secure_sum.settings_digest(content.get("config")))
        owner.join(key)  # a refused round leaves nothing behind; a joined one is remembered, on disk
    except (BadMessage, secagg.ProtocolError, ConfigError, TypeError) as e:
        raise _refused(e) from None
    _SESSIONS[key] = client
    while len(_SESSIONS) > MAX_SESSIONS:
        _SESSIONS.popitem(last=False)
    return RecordDict({secure_sum.RECORD: ConfigRecord(keys)})


def share_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 1: the neighbours' signed public keys; once every one is checked, this client's
    encrypted shares for each and its signed commitments to them."""
    try:
        key, record, _ = _stage_fields(content, context)
        client = _session(key)
        fields = {f: read_map(record, f"keys-{f}") for f in KEY_FIELDS}
        if any(set(m) != set(fields["c"]) for m in fields.values()):
            raise BadMessage("keys-c, keys-s, keys-v and keys-sig name different clients")
        dealt = client.share_keys({j: {f: fields[f][j] for f in KEY_FIELDS} for j in fields["c"]})
    except (BadMessage, secagg.ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    out = ConfigRecord({"dealing": dealt["dealing"], "digest": dealt["digest"]})
    write_map(out, "shares", dealt["shares"])
    write_map(out, "commits", dealt["commits"])
    return RecordDict({secure_sum.RECORD: out})


def masked_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 2: the shares sent to this client with their dealers' commitments, and the round's
    model and settings; its vector, masked (the ledger charged by `contribution`, after every
    check)."""
    try:
        key, record, owner = _stage_fields(content, context)
        client = _session(key)
        ciphertexts, commits = read_map(record, "shares"), read_map(record, "commits")
        client.check_masked_input(ciphertexts, commits)  # before the vector is computed and charged
        config = content.get("config")
        if isinstance(config, ConfigRecord) and (config.get("experiment-id"), config.get("server-round")) != key[2:4]:
            raise BadMessage("the round's settings name another experiment or round than its stage record")
        if secure_sum.settings_digest(config) != client.context or not client.context:
            raise secagg.ProtocolError("the round's settings are not those it was advertised with (every client "
                                       "signed those; other settings now would differ from its neighbours')")
        if owner.node.secagg_keep_inputs and kept_input_path(owner, key).exists():
            raise secagg.ProtocolError("this client kept an input for this round already; it sends no other")
    except (BadMessage, secagg.ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    distributed = isinstance(content.get("config"), ConfigRecord) and content["config"].get("noise") == "distributed"
    vector, metrics = (distributed_contribution if distributed else contribution)(content, context, owner)
    masked = client.masked_input(ciphertexts, commits, vector)
    if owner.node.secagg_keep_inputs:
        keep_input(owner, key, vector)
    log.info("secure aggregation: round %d's masked input (%d values) sent", key[3], len(vector))
    return RecordDict({secure_sum.RECORD: ArrayRecord({"masked": Array(masked)}), "metrics": metrics})


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
                             f"hold less noise than its t counts on")
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
    took part in alone (`public_metrics`). A refusal raises StageRefused with its reason."""
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


def padded_rows(plan, bytes_a_row: int = 4, max_records: int | None = None) -> int:
    """The rows an owner's per-sample work covers whatever its Poisson batch: a bound on any batch
    from numbers that are not its data, the Poisson tail of the plan's expected batch E =
    batch-size (the federation's, which every owner checks the plan against), or, where the owner
    set `max-records` K (its own bound on its records, `max_records` here), of q × K when that is
    smaller; never of the records it holds. A time that followed the owner's own bound would tell
    how many records it holds (a review measured +171 ms for 2,000 records against 200 with E = 1,
    where padding fell back to each owner's own). Padded to E, each of the features recipe's ten
    owners computed 8.7k rows for a batch of ~820; with its K it computes ~990. The server's
    secagg-max-records never lowers it: a review found that, set to 1, it left 16 rows, and an
    owner's batch above them (never cut) told its size by its time. A plan whose bound would not
    fit MAX_PADDED_BYTES is refused before the charge, by the plan's numbers alone."""
    from fedsd.secure import sum_bound

    expected = plan.expected_batch if max_records is None else min(plan.expected_batch,
                                                                   plan.sample_rate * max(1, max_records))
    planned = sum_bound.poisson_tail(expected, sum_bound.TAIL)
    if not planned * bytes_a_row <= MAX_PADDED_BYTES:  # refused before the charge (it would fail after it)
        raise _refused(f"distributed noise: the plan's expected batch {plan.expected_batch:.4g} pads each step past "
                       f"the {MAX_PADDED_BYTES >> 30} GiB of inputs an owner computes a step on")
    return math.ceil(planned)


def records_bound(side, own_records: int) -> int:
    """The count an owner's draw rate is set from (owner_rate): its node config's max-records, else
    the run's public secagg-max-records; never the records it holds. A rate set from the owner's
    own count moved with each record (at a server's M just under it, an owner of 19, 20 or 21
    records drew at 0.489, 0.465, 0.442), so a record changed the others' rate: a review computed
    ε 5.25-5.62 spent where 3.72 was charged (q = 0.5, 20 rounds, small owners). An owner whose
    own max-records is below its records is refused before the charge (its own setting, which
    nothing the server sends moves; the reason names no count: that it was refused is the one
    bit the server learns, the same in every round). An owner without one is padded to the
    federation's E (padded_rows) and draws at the rate a batch of M's records fits within it, at
    most q: a server's M only lowers its rate; its batch passes the pad only if it holds more than
    the federation's whole E / q records (deploy/README.md)."""
    own = side.node.max_records
    if own and own_records > own:
        log.warning("max-records=%d is below the %d training records of this owner's data: refused", own, own_records)
        raise _refused("this owner's max-records does not fit its data (its owner's log says how)")
    return own or max(1, side.fed.secagg_max_records)  # the server's M only ever lowers the rate (the pad is E's)


def owner_rate(plan, own_records: int, rows: int) -> float:
    """The rate this owner draws its records at, for a count of `own_records` (records_bound's, not
    the records it holds): the plan's q, unless a Poisson batch at q of that count
    could pass the padded `rows` (its records above the federation's B / q: a plan that
    understates E); then the largest rate whose batch stays within them but once in 1e9. Drawing
    at a lower rate than the ledger charges only spends less (a subsampled mechanism's Rényi
    divergence grows with q), and keeps the work, and its time, at the public `rows`."""
    from fedsd.secure import sum_bound

    fits = lambda q: sum_bound.poisson_tail(q * own_records, sum_bound.TAIL) <= rows  # noqa: E731
    if own_records == 0 or fits(plan.sample_rate):
        return plan.sample_rate
    low, high = 0.0, plan.sample_rate
    for _ in range(60):  # bisection on a monotone tail: 2^-60 of q
        low, high = ((low + high) / 2, high) if fits((low + high) / 2) else (low, (low + high) / 2)
    return low


def row_bytes(x) -> int:
    """What one input row of the padded step holds, in bytes."""
    return int(x[0].nbytes) if len(x) else 4


# The most input an owner's padded step holds: far above any step's batch (the papers' largest
# is 8192 for the whole federation), far below one that could not be allocated.
MAX_PADDED_BYTES = 4 << 30


def public_metrics(plan, rounds_taken: int, delta: float, client_unit: bool = False) -> dict:
    """All a service's masked reply says beside its vector under distributed noise: ε of the
    rounds it took part in, a function of the plan (public) and of its participation, which the
    server sees anyway; at client level also each single record's ε (at z_e / 2). No batch size,
    no step count, no loss, no time (deploy/README.md)."""
    from fedsd.secure import client_level

    metrics = {"epsilon": float(plan.epsilon(rounds_taken, delta))}
    if client_unit:
        metrics["record-epsilon"] = float(client_level.record_epsilon(plan, rounds_taken, delta))
    return metrics


def keep_input(owner: Owner, key: tuple, vector: np.ndarray) -> None:
    """The owner's copy of what it released into the round's sum (secagg-keep-inputs=true),
    written whole through the state folder's descriptor, never through a link."""
    name = kept_input_name(owner, key)
    state = owner.node.state()
    if state.exists(name):  # never over an earlier release's copy (masked_reply refused such a round before)
        raise StageRefused("secure aggregation refused: this client kept an input for this round already")
    buffer = io.BytesIO()
    np.save(buffer, vector)
    state.write_atomic(name, buffer.getvalue())


def kept_input_name(owner: Owner, key: tuple) -> str:
    return f"secagg/{key[1]}-{key[2]}-{key[3]}-{owner.id}.npy"


def kept_input_path(owner: Owner, key: tuple):
    """state-dir/secagg/<run>-<experiment>-<round>-<id>.npy: one file per round and owner id."""
    from fedsd.app.client.owner_checks import private_state_folder

    return private_state_folder(owner.node, "secagg") / kept_input_name(owner, key).split("/", 1)[1]


def confirm_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 3 (consistency): the round's survivors and dropped clients, the same list for every
    client; this client's signature of that view. Nothing revealed."""
    try:
        key, record, _ = _stage_fields(content, context)
        client = _session(key)
        signature = client.confirm(list(record.get("survivors", [])), list(record.get("dropped", [])))
    except (BadMessage, secagg.ProtocolError, ConfigError, TypeError) as e:
        raise _refused(e) from None
    return RecordDict({secure_sum.RECORD: ConfigRecord({"sig": signature})})


def unmask_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 4: the neighbours' signatures of the view; once enough of them signed this client's
    view, its shares of the survivors' self masks and of the dropped clients' keys, never both
    for one client."""
    try:
        key, record, _ = _stage_fields(content, context)
        client = _session(key)
        answer = client.unmask(read_map(record, "confirmations"))
    except (BadMessage, secagg.ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    out = ConfigRecord({})
    write_map(out, "b", answer["b"])
    write_map(out, "s", answer["s"])
    _SESSIONS.pop(key, None)  # the round is over for this client
    return RecordDict({secure_sum.RECORD: out})


HANDLERS = {secure_sum.KINDS["identify"]: identify_reply, secure_sum.KINDS["advertise"]: advertise_reply,
            secure_sum.KINDS["share"]: share_reply, secure_sum.KINDS["masked"]: masked_reply,
            secure_sum.KINDS["confirm"]: confirm_reply, secure_sum.KINDS["unmask"]: unmask_reply}
