"""Secure aggregation in the owner's data service: the five stages of SecAgg+ (fedsd.secagg),
answered by the process that holds the data, the ledger and the secret randomness.

The service keeps one `SecAggClient` per (run, experiment, round, node) in memory, the last
MAX_SESSIONS of them; its private keys and its self-mask seed never leave it. Every stage
message is hostile until checked: its fields (task.secure_sum.read_map), its round (the round
id is derived here from the run, the experiment and the round number, never taken from the
message), the order of the stages (a replayed or early one is refused), the owner's
`secagg-min-clients` and the protocol's own checks. A refusal is a `StageRefused` with its reason,
and comes before the ledger is charged: only the masked-input stage charges it, and only once
its shares have been checked (`SecAggClient.check_masked_input`).

The vector a client contributes (`contribution`) is for now its ordinary training update (the
model delta after local training, which charges the ledger as a train round does), in fixed
point; with `secagg-keep-inputs=true` the owner keeps each round's vector, as released into the
sum, in state-dir/secagg/<run>-<experiment>-<round>-<node>.npy.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from fedsd import secagg
from fedsd.fed_settings import EXPERIMENT_ID
from task import secure_sum
from task.secure_sum import BadMessage, read_map, write_map

from clients import node_config as node_configs

log = logging.getLogger("fedsd.secure_aggregation")
MAX_SESSIONS = 8  # (round, node) states a service keeps state for; an older one is dropped (its round cannot go on)
_SESSIONS: "OrderedDict[tuple, secagg.SecAggClient]" = OrderedDict()


class StageRefused(ValueError):
    """A stage message this service does not answer; the text says why, nothing of the data
    (the data service passes it on to the server as it is)."""


def _refused(e: object) -> StageRefused:
    return StageRefused(f"secure aggregation refused: {e}")


def _stage_fields(content: RecordDict, context: Context) -> tuple[tuple, ConfigRecord, node_configs.NodeConfig]:
    """The session key, the stage's own record and the owner's node config, checked."""
    record = content.get(secure_sum.RECORD) if secure_sum.RECORD in content else None
    if not isinstance(record, ConfigRecord):
        raise BadMessage(f"a '{secure_sum.RECORD}' config record was expected")
    experiment, server_round = record.get("experiment-id"), record.get("server-round")
    if not isinstance(experiment, str) or EXPERIMENT_ID.fullmatch(experiment) is None:
        raise BadMessage("experiment-id: letters, digits, '.', '_' and '-', at most 64")
    if not isinstance(server_round, int) or isinstance(server_round, bool) or not 1 <= server_round <= 1 << 31:
        raise BadMessage("server-round: a positive integer")
    node = node_configs.parse(context.node_config)
    return (int(context.run_id), experiment, server_round, secure_sum.secagg_id(context.node_id)), record, node


def _session(key: tuple, context: Context, node, create: bool = False) -> secagg.SecAggClient:
    if key in _SESSIONS:
        return _SESSIONS[key]
    if not create:
        raise BadMessage(f"round {key[2]} of this run was not advertised to this client (or was dropped)")
    client = secagg.SecAggClient(key[3], secure_sum.round_id(*key[:3]), min_cohort=node.secagg_min_clients,
                                 max_colluders=node.secagg_max_colluders)
    _SESSIONS[key] = client
    while len(_SESSIONS) > MAX_SESSIONS:
        _SESSIONS.popitem(last=False)
    return client


def advertise_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 0: the cohort, this client's neighbours and the threshold; its two public keys."""
    try:
        key, record, node = _stage_fields(content, context)
        fresh = key not in _SESSIONS
        client = _session(key, context, node, create=True)
        try:
            keys = client.advertise(list(record.get("cohort", [])), list(record.get("neighbours", [])),
                                    record.get("threshold"))
        except secagg.ProtocolError:
            if fresh:  # a refused round leaves nothing behind
                _SESSIONS.pop(key, None)
            raise
    except (BadMessage, secagg.ProtocolError, TypeError) as e:
        raise _refused(e) from None
    return RecordDict({secure_sum.RECORD: ConfigRecord({"c": keys["c"], "s": keys["s"]})})


def share_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 1: the neighbours' public keys; this client's encrypted shares for each."""
    try:
        key, record, node = _stage_fields(content, context)
        client = _session(key, context, node)
        cs, ss = read_map(record, "keys-c"), read_map(record, "keys-s")
        if set(cs) != set(ss):
            raise BadMessage("keys-c and keys-s name different clients")
        shares = client.share_keys({j: {"c": cs[j], "s": ss[j]} for j in cs})
    except (BadMessage, secagg.ProtocolError) as e:
        raise _refused(e) from None
    out = ConfigRecord({})
    write_map(out, "shares", shares)
    return RecordDict({secure_sum.RECORD: out})


def masked_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 2: the shares sent to this client, and the round's model and settings; its vector,
    masked (the ledger charged by `contribution`, after every check)."""
    try:
        key, record, node = _stage_fields(content, context)
        client = _session(key, context, node)
        ciphertexts = read_map(record, "shares")
        client.check_masked_input(ciphertexts)  # before the vector is computed and charged
        if node.secagg_keep_inputs and kept_input_path(node, key).exists():
            raise secagg.ProtocolError("this client kept an input for this round already; it sends no other")
    except (BadMessage, secagg.ProtocolError) as e:
        raise _refused(e) from None
    vector, metrics = contribution(content, context)
    masked = client.masked_input(ciphertexts, vector)
    if node.secagg_keep_inputs:
        keep_input(node, key, vector)
    log.info("secure aggregation: round %d's masked input (%d values) sent", key[2], len(vector))
    return RecordDict({secure_sum.RECORD: ArrayRecord({"masked": Array(masked)}), "metrics": metrics})


def contribution(content: RecordDict, context: Context) -> tuple[np.ndarray, MetricRecord]:
    """This client's uint64 vector for the round and its metrics: its training update (the model
    delta after one round of local DP training, which charges the owner's ledger as a train
    round does), in fixed point. A refused round raises StageRefused with its reason."""
    from clients import local

    round_content = RecordDict({"arrays": content["arrays"], "config": content["config"]})
    reply = local.train_reply(round_content, context, into_sum=True)
    for record in ("refusal", "divergence"):
        if record in reply:
            raise _refused(reply[record]["reason"])
    if "arrays" not in reply:
        raise _refused("this client did not train this round (its run's budget is spent)")
    if int(reply["metrics"].get("replayed", 0)):
        # The round's update went into a sum already. Sent into a second sum, over another cohort,
        # the same vector would come out of the difference of the two: one update, one sum.
        raise _refused("this round's update went into a sum already; it goes into no other")
    return secure_sum.update_vector(content["arrays"], reply["arrays"]), reply["metrics"]


def keep_input(node, key: tuple, vector: np.ndarray) -> None:
    """The owner's copy of what it released into the round's sum (secagg-keep-inputs=true)."""
    path = kept_input_path(node, key)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.save(f, vector)
    if path.exists():  # never over an earlier release's copy (masked_reply refused such a round before)
        raise StageRefused("secure aggregation refused: this client kept an input for this round already")
    tmp.rename(path)


def kept_input_path(node, key: tuple):
    """state-dir/secagg/<run>-<experiment>-<round>-<node>.npy: one file per session key."""
    from clients.local import private_state_folder

    return private_state_folder(node, "secagg") / f"{key[0]}-{key[1]}-{key[2]}-{key[3]}.npy"


def confirm_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 3 (consistency): the round's survivors and dropped clients, the same list for every
    client; a MAC of that view for each of this client's surviving neighbours. Nothing revealed."""
    try:
        key, record, node = _stage_fields(content, context)
        client = _session(key, context, node)
        tags = client.confirm(list(record.get("survivors", [])), list(record.get("dropped", [])))
    except (BadMessage, secagg.ProtocolError, TypeError) as e:
        raise _refused(e) from None
    out = ConfigRecord({})
    write_map(out, "tags", tags)
    return RecordDict({secure_sum.RECORD: out})


def unmask_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 4: the neighbours' confirmations of the view; once t of them agree with this
    client's, its shares of the survivors' self masks and of the dropped clients' keys, never
    both for one client."""
    try:
        key, record, node = _stage_fields(content, context)
        client = _session(key, context, node)
        answer = client.unmask(read_map(record, "confirmations"))
    except (BadMessage, secagg.ProtocolError) as e:
        raise _refused(e) from None
    out = ConfigRecord({})
    write_map(out, "b", answer["b"])
    write_map(out, "s", answer["s"])
    _SESSIONS.pop(key, None)  # the round is over for this client
    return RecordDict({secure_sum.RECORD: out})


HANDLERS = {secure_sum.KINDS["advertise"]: advertise_reply, secure_sum.KINDS["share"]: share_reply,
            secure_sum.KINDS["masked"]: masked_reply, secure_sum.KINDS["confirm"]: confirm_reply,
            secure_sum.KINDS["unmask"]: unmask_reply}
