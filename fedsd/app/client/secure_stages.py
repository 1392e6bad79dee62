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

Who the owner is in the protocol and what it keeps of the rounds (`Owner`, `StageRefused`) are
fedsd.app.client.secure_owner; the vector it contributes at the masked-input stage, and what
admits and charges it, fedsd.app.client.secure_contribution (its padded step sized by
fedsd.app.client.step_padding). With `secagg-keep-inputs=true` the owner keeps each round's
vector, as released into the sum, in state-dir/secagg/<run>-<experiment>-<round>-<id>.npy.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from fedsd.errors import ConfigError
from fedsd.settings.federation import EXPERIMENT_ID
from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import ProtocolError, identify_message
from fedsd.app import secure_sum
from fedsd.app.secure_sum import KEY_FIELDS, BadMessage, read_map, write_map

from fedsd.app.client import node_config as node_configs
from fedsd.app.client.secure_contribution import admitted_at_advertise, contribution, distributed_contribution
from fedsd.app.client.secure_owner import Owner, _refused, keep_input, kept_input_path

log = logging.getLogger("fedsd.secure_aggregation")
MAX_SESSIONS = 8  # rounds a service keeps state for; an older one is dropped (its round cannot go on)
_SESSIONS: "OrderedDict[tuple, SecAggClient]" = OrderedDict()
UNAUTHENTICATED = ("secure aggregation without a roster (secagg-roster): this node protects its update only against "
                   "a server that follows the protocol")


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


def _session(key: tuple) -> SecAggClient:
    if key not in _SESSIONS:
        raise BadMessage(f"round {key[3]} of this run was not advertised to this client (or was dropped)")
    return _SESSIONS[key]


def identify_reply(content: RecordDict, context: Context) -> RecordDict:
    """Before stage 0: this service's id in the protocol and its identity's public key (empty
    without a roster), which the server needs to name the cohort, signed for this round and the
    node it answers for (so that no member can tell another owner's). Nothing secret, nothing kept."""
    try:
        key, _, owner = _stage_fields(content, context)
    except (BadMessage, ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    if owner.roster is None:
        log.warning(UNAUTHENTICATED)
        return RecordDict({secure_sum.RECORD: ConfigRecord({"id": owner.id, "v": b"", "sig": b"",
                                                            "authenticated": False})})
    signature = owner.identity.sign(identify_message(_round_id(key), context.node_id))
    return RecordDict({secure_sum.RECORD: ConfigRecord({"id": owner.id, "v": owner.identity.public, "sig": signature,
                                                        "authenticated": True})})


def advertise_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 0: the cohort, this client's neighbours, the threshold and the round's settings
    (checked at the masked input); its public keys, signed with the settings' digest, so that a
    neighbour given other settings fails every other client's check at share-keys."""
    try:
        key, record, owner = _stage_fields(content, context)
        if key in _SESSIONS:
            raise ProtocolError(f"round {key[3]} was advertised to this owner already (under any node id, "
                                       f"it takes part in a round once)")
        owner.refuse_spoilers(key, record.get("evidence"), list(record.get("cohort", [])))
        admitted_at_advertise(content, context, owner)
        client = owner.client(_round_id(key))
        keys = client.advertise(list(record.get("cohort", [])), list(record.get("neighbours", [])),
                                record.get("threshold"), secure_sum.settings_digest(content.get("config")),
                                _graph(record.get("graph")))
        owner.join(key)  # a refused round leaves nothing behind; a joined one is remembered, on disk
    except (BadMessage, ProtocolError, ConfigError, TypeError) as e:
        raise _refused(e) from None
    _SESSIONS[key] = client
    while len(_SESSIONS) > MAX_SESSIONS:
        _SESSIONS.popitem(last=False)
    return RecordDict({secure_sum.RECORD: ConfigRecord(keys)})


def _graph(value: object) -> dict | None:
    """Stage 0's "graph": none for the complete graph, else a ring's [k, t, F] (checked by the
    protocol against this owner's own, and its neighbourhood derived: SecAggClient._ring)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3:
        raise BadMessage("graph: a ring's [k, t, F], three integers, or none for the complete graph")
    return dict(zip(("k", "honest", "colluders"), value))


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
    except (BadMessage, ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    out = ConfigRecord({"dealing": dealt["dealing"], "digest": dealt["digest"]})
    write_map(out, "shares", dealt["shares"])
    write_map(out, "commits", dealt["commits"])
    return RecordDict({secure_sum.RECORD: out})


def masked_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 2: the shares sent to this client with their dealers' commitments, and the round's
    model and settings; its vector, masked (the ledger charged by `contribution`, after every
    check), and on a ring its signed M, the neighbours it masked with."""
    try:
        key, record, owner = _stage_fields(content, context)
        client = _session(key)
        ciphertexts, commits = read_map(record, "shares"), read_map(record, "commits")
        client.check_masked_input(ciphertexts, commits)  # before the vector is computed and charged
        config = content.get("config")
        if isinstance(config, ConfigRecord) and (config.get("experiment-id"), config.get("server-round")) != key[2:4]:
            raise BadMessage("the round's settings name another experiment or round than its stage record")
        if secure_sum.settings_digest(config) != client.context or not client.context:
            raise ProtocolError("the round's settings are not those it was advertised with (every client "
                                       "signed those; other settings now would differ from its neighbours')")
        if owner.node.secagg_keep_inputs and kept_input_path(owner, key).exists():
            raise ProtocolError("this client kept an input for this round already; it sends no other")
    except (BadMessage, ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    distributed = isinstance(content.get("config"), ConfigRecord) and content["config"].get("noise") == "distributed"
    vector, metrics = (distributed_contribution if distributed else contribution)(content, context, owner)
    masked = client.masked_input(ciphertexts, commits, vector)
    if owner.node.secagg_keep_inputs:
        keep_input(owner, key, vector)
    log.info("secure aggregation: round %d's masked input (%d values) sent", key[3], len(vector))
    reply = RecordDict({secure_sum.RECORD: ArrayRecord({"masked": Array(masked)}), "metrics": metrics})
    if client.degree:  # on a ring: the neighbours it masked with, signed (the server relays them at unmask)
        reply[secure_sum.MASKED_SET] = ConfigRecord({"set": secure_sum.packed_set(client.masked_set())})
    return reply


def confirm_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 3 (consistency): the round's survivors and dropped clients, the same list for every
    client; this client's signature of that view. Nothing revealed."""
    try:
        key, record, _ = _stage_fields(content, context)
        client = _session(key)
        signature = client.confirm(list(record.get("survivors", [])), list(record.get("dropped", [])))
    except (BadMessage, ProtocolError, ConfigError, TypeError) as e:
        raise _refused(e) from None
    return RecordDict({secure_sum.RECORD: ConfigRecord({"sig": signature})})


def unmask_reply(content: RecordDict, context: Context) -> RecordDict:
    """Stage 4: the neighbours' signatures of the view (and on a ring their signed M); once enough
    of them signed this client's view, its shares of the survivors' self masks (on a ring only of
    those whose M names it) and of the dropped clients' keys, never both for one client."""
    try:
        key, record, _ = _stage_fields(content, context)
        client = _session(key)
        sets = {j: secure_sum.unpacked_set(v) for j, v in read_map(record, "masked-sets").items()}
        answer = client.unmask(read_map(record, "confirmations"), sets if client.degree else None)
    except (BadMessage, ProtocolError, ConfigError) as e:
        raise _refused(e) from None
    out = ConfigRecord({})
    write_map(out, "b", answer["b"])
    write_map(out, "s", answer["s"])
    _SESSIONS.pop(key, None)  # the round is over for this client
    return RecordDict({secure_sum.RECORD: out})


HANDLERS = {secure_sum.KINDS["identify"]: identify_reply, secure_sum.KINDS["advertise"]: advertise_reply,
            secure_sum.KINDS["share"]: share_reply, secure_sum.KINDS["masked"]: masked_reply,
            secure_sum.KINDS["confirm"]: confirm_reply, secure_sum.KINDS["unmask"]: unmask_reply}
