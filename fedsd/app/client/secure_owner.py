"""Who an owner's data service is in secure aggregation (its stages: fedsd.app.client.secure_stages),
and what it keeps of the rounds in its state folder: `Owner`, its identity, its roster (None
without one) and its protocol id, the rounds it joined (JOINED: a round at or below the last
one it joined for a run and experiment is refused, under any node id and after a restart) and
the members named with checkable evidence of spoiling an earlier round (BARRED, checked with
fedsd.secure.secagg_primitives.verify_blame against its own roster); the copy of each input it
released, where the owner asks for one (`keep_input`, secagg-keep-inputs=true); and
`StageRefused`, the refusal every stage raises, with its reason and nothing of the data.
"""
from __future__ import annotations

import io
import logging

import numpy as np
from flwr.app import Context

from fedsd.secure.identity import load_identity, read_roster
from fedsd.secure.secagg import SecAggClient
from fedsd.secure.secagg_primitives import ProtocolError, verify_blame
from fedsd.app import secure_sum

from fedsd.app.client import node_config as node_configs

log = logging.getLogger("fedsd.secure_aggregation")
BARRED = "secagg-barred.json"  # in the state folder: members named with checkable evidence, per run and experiment
JOINED = "secagg-joined.json"  # in the state folder: each run and experiment's last round this owner joined
RECORD_REFUSED = ("node-config record-dir: this owner's record folder is not its owner's alone, or cannot be read; its "
                  "owner's log says why")


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
                raise ProtocolError("this owner's identity is not on its own roster (fedsd data-service "
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
                raise ProtocolError(f"{JOINED} in the state folder does not parse; its owner's log has why")
            try:
                with self._recorded(state, joined):
                    if int(joined.get(name, 0)) >= key[3]:
                        raise ProtocolError(f"round {key[3]} was advertised to this owner already, or a later "
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

    def client(self, round_id: bytes) -> SecAggClient:
        node = self.node
        return SecAggClient(self.id, round_id, min_cohort=node.secagg_min_clients,
                                   max_colluders=node.secagg_max_colluders, identity=self.identity, roster=self.roster)

    def refuse_spoilers(self, key: tuple, evidence: object, cohort: list) -> None:
        """A cohort holding a member named with checkable evidence of spoiling an earlier round of
        this run (fedsd.secure.verify_blame, against this owner's own roster) is refused
        before anything is drawn or charged. Evidence the server sends is checked here and kept
        in the state folder (BARRED), so a later round without it is refused all the same."""
        if self.roster is None:
            return  # without a roster no evidence can be checked: protected only against an honest server
        state, name = self.node.state(), f"{key[1]}|{key[2]}"
        with state.lock(BARRED + ".lock"):
            barred = state.read_json(BARRED) or {}
            if not isinstance(barred, dict):
                raise ProtocolError(f"{BARRED} in the state folder does not parse")
            known = {int(k): v for k, v in dict(barred.get(name, {})).items()}
            found = _checked_evidence(evidence, key, self.roster, known)
            if set(found) - set(known):
                barred[name] = {str(k): v for k, v in {**known, **found}.items()}
                state.write_json(BARRED, barred)
                known.update(found)
        spoilers = sorted(set(known) & {c for c in cohort if isinstance(c, int)})
        if spoilers:
            raise ProtocolError(f"the cohort holds {', '.join(self.roster.name(c) for c in spoilers)}, named "
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
                verify_blame(item, roster.key(dealer)):
            found[dealer] = item["round"]
    return found


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
