"""The owner's data service at its start: its state folder against the owner's record kept
outside it (fedsd.privacy.owner_record). A folder older than its record (a restored copy: fewer
charges or less ε in a ledger, a lower round joined for a run) is refused, saying what was found
against the record and the ε that charging on from it would spend again, unless the owner
starts the service with --accept-restored-state: each ledger is then raised to its record (the
charges it lacks added back as one entry, so none is spent twice) and each run's rounds joined
to the record's, said in the owner's log. The record is never lowered.
"""
from __future__ import annotations

import logging

from fedsd.app.client.node_config import NodeConfig
from fedsd.errors import DataError, StateRolledBack
from fedsd.files.state_folder import StateFolder
from fedsd.privacy import lifetime_ledger as ledgers

log = logging.getLogger("fedsd.data_service")


def check_on_start(node: NodeConfig, state: StateFolder, accept: bool = False) -> None:
    """StateRolledBack naming every ledger and every run's rounds joined that is behind the
    owner's record, and the flag that accepts them; with `accept`, each raised to the record."""
    from fedsd.app.client.secure_owner import JOINED

    records = node.records()
    if records is None:  # no data of its own: no ledger of the owner's to roll back
        return
    refused = []
    for check in (lambda: ledgers.check_restored(state, records, node.max_epsilon, node.max_delta, accept),
                  lambda: check_joined(state, records, JOINED, accept)):
        try:
            check()
        except StateRolledBack as e:
            refused.append(str(e))
    for line in records.accepted:
        log.warning("%s", line)
    if refused:
        raise StateRolledBack("\n".join(refused))
    if accept and not records.accepted:
        log.info("--accept-restored-state: the state folder is not behind the owner's record; nothing to accept")


def check_joined(state: StateFolder, records, name: str, accept: bool = False) -> None:
    """The folder's last rounds joined (`name` in it) against the record (records.joined); with
    `accept`, raised to the record's and written back."""
    with state.lock(name + ".lock"):
        joined = state.read_json(name) or {}
        if not isinstance(joined, dict):
            raise DataError(f"{state.path / name}: the rounds this owner joined do not parse")
        before = dict(joined)
        with records.joined(state, joined, accept):
            pass
        if joined != before:
            state.write_json(name, joined)
