"""Authenticated secure aggregation with distributed noise on a real deployment: a SuperLink and
five SuperNodes under --isolate, each with its owner's data service (its own uid, data, ledger
and state folder), `secure-aggregation = true`, `noise = distributed` (each round one DP-SGD
step of the federation, every owner adding its Skellam share, the plan t = 3), every owner
keeping its inputs (secagg-keep-inputs=true) so the test can check the server's sums. The
round's settings, the plan among them, cross Flower's wire at the advertise and masked-input
stages, and each owner's signed digest of them must agree. Local noise under secure
aggregation runs the same exchange; its service side runs in tests/app/client/test_secure_aggregation.py.

Each owner makes its Ed25519 identity itself (`fedsd data-service --identity`, as its uid, in
its state folder: LocalDeployment.identities). Owners 0-3 are the federation: one roster lists
them (owner-0 … owner-3; root's, 0644, readable by every owner and writable by none), each names
it in its node config (secagg-roster), and the server has the same roster (run config
secagg-roster). Owner 4 is a stranger: a registered SuperNode with a data service whose roster is
the four and itself (it would take part gladly; only the others' rosters say otherwise). The
server leaves it out at the identify stage of every round and names it, by its protocol id, in
the round's `culprits`; the run takes num-clients=5 (every SuperNode is a client of the
federation, 0 would say the same), and the stranger trains in no round.

Round 1: the four, all in the sum. Round 2: client 3's service is killed once it has sent its
masked input. A client that sent its masked input is a survivor: its input is in the sum, and
the round completes from the unmask answers of the other three (the threshold for four is
three). Round 3: client 3's service is gone (its SuperNode still online), so it does not answer
identify and the cohort is the other three (threshold three): the sum is exactly their inputs,
mod 2^64.

This one test also covers what the earlier unauthenticated deployed test did (a service killed
after its masked input, one gone before): a second deployment for the no-roster path would
double the slow tier's minutes; that path is the same server exchange, and its service side runs
in tests/app/client/test_secure_aggregation.py."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedsd.secure.identity import parse_public, protocol_id
from fedsd.deployment.local_deployment import LocalDeployment
from fedsd.app.secure_sum import secagg_id
from tests.deployment.test_deploy import RUN, isolated_client_data, processes_mentioning, wait_for

pytestmark = pytest.mark.slow
KILLED, KILLED_ROUND, STRANGER = 3, 2, 4
MEMBERS = range(4)


def kept_input(deployment: LocalDeployment, k: int, server_round: int) -> Path | None:
    # <run>-<experiment>-<round>-<protocol id>.npy (fedsd/app/client/secure_owner.py, kept_input_path)
    found = sorted(p for p in (deployment.owner_dir(k) / "state" / "secagg").glob("*.npy")
                   if p.stem.rsplit("-", 2)[1] == str(server_round))
    assert len(found) <= 1, found
    return found[0] if found else None


def masked_inputs_sent(deployment: LocalDeployment, k: int) -> int:
    log = deployment.logs / f"data-service-{k}.log"
    return log.read_text(errors="replace").count("answered a secagg-masked message") if log.exists() else 0


def ledger(state: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "ledger", "--state-dir", str(state), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_owners_on_a_roster_sum_three_rounds_a_stranger_is_named_and_a_killed_service_stays_in_its_sum(tmp_path):
    data, work, out = isolated_client_data(tmp_path, 5, 1000), tmp_path / "work", tmp_path / "out"
    with LocalDeployment(work, 5, client_data=data, isolate=True) as deployment:
        roster, theirs = deployment.shared_dir() / "roster", deployment.shared_dir() / "stranger-roster"
        owners = "max-epsilon=3 secagg-min-clients=3 secagg-keep-inputs=true secagg-roster='{}'"
        deployment.node_config = [owners.format(roster)] * 4 + [owners.format(theirs)]
        lines = deployment.identities()  # each made by its owner, before any roster lists it
        members = "".join(f"owner-{k} {lines[k]}\n" for k in MEMBERS)
        assert deployment.write_shared("roster", "# the federation\n" + members) == roster
        assert deployment.write_shared("stranger-roster", members + f"stranger {lines[STRANGER]}\n") == theirs
        deployment.start()
        run = deployment.submit({**RUN, "num-clients": 5, "num-server-rounds": 3, "client-data": "own",
                                 "epsilon": 3.0, "secure-aggregation": True, "secagg-roster": str(roster),
                                 "noise": "distributed", "sample-rate": RUN["batch-size"] / 4000,
                                 "honest-clients": 3, "out-dir": str(out)})
        wait_for(lambda: masked_inputs_sent(deployment, KILLED) >= KILLED_ROUND, 900,
                 f"client {KILLED}'s masked input in round {KILLED_ROUND}")
        os.killpg(deployment.services[KILLED].pid, signal.SIGKILL)
        assert run.wait(timeout=900) == 0
        output = run.log.read_text(errors="replace")
        assert "ServerApp raised" not in output, output[-3000:]
        kept = {(k, r): kept_input(deployment, k, r) for k in range(5) for r in (1, 2, 3)}
        books = {k: ledger(deployment.owner_dir(k) / "state") for k in range(5)}
        keys = {k: deployment.owner_dir(k) / "state" / "identity.key" for k in range(5)}
        node_ids = dict(deployment.node_ids)
    # Each owner's identity is its own: a 32-byte key, 0600, of its uid; its protocol id is its key's.
    assert len(set(lines.values())) == 5
    assert all(p.stat().st_uid == 47000 + k and p.stat().st_mode & 0o777 == 0o600 and p.stat().st_size == 32
               for k, p in keys.items())
    ids = {k: protocol_id(parse_public(line)) for k, line in lines.items()}
    assert (roster.stat().st_uid, roster.stat().st_mode & 0o777) == (0, 0o644)

    records = json.loads((out / "secure-aggregation.json").read_text())
    assert [r["round"] for r in records] == [1, 2, 3] and [r["abandoned"] for r in records] == [None] * 3
    assert [r["threshold"] for r in records] == [3, 3, 3]
    assert all(r["nodes_without_roster"] == [] for r in records)
    # The stranger answers identify each round, is left out and named: its protocol id, its node, its key.
    for r in records:
        assert r["culprits"] == {str(ids[STRANGER]): f"node {node_ids[STRANGER]}: a key not on the server's "
                                                     f"roster ({lines[STRANGER]})"}, r["culprits"]
        assert ids[STRANGER] not in r["cohort"] and ids[STRANGER] not in r["survivors"]
    assert output.count(f"left out node {node_ids[STRANGER]}: a key not on the server's roster") == 3
    assert output.count(f"client {ids[STRANGER]} named: node {node_ids[STRANGER]}") == 3
    members_ids = sorted(ids[k] for k in MEMBERS)
    # Round 1: the four, in the sum.
    assert records[0]["cohort"] == records[0]["survivors"] == members_ids
    assert records[0]["stages"]["unmask"]["answered"] == members_ids
    # Round 2: client 3 sent its masked input and then its service was killed: in the sum, from
    # the other three's unmask answers.
    assert records[1]["cohort"] == records[1]["survivors"] == members_ids
    assert str(ids[KILLED]) in records[1]["stages"]["confirm"]["failed"]
    assert records[1]["stages"]["unmask"]["answered"] == sorted(ids[k] for k in range(3))
    # Round 3: client 3's service gone. Its node told who it is in round 1 and answered round 2's
    # advertise stage, so it is not asked again (identify is asked once a run, and only of the
    # stranger here): in the cohort, it fails at advertise, and the other three are summed.
    assert "identify" not in records[2]["stages"] or str(secagg_id(node_ids[KILLED])) not in \
        records[2]["stages"]["identify"]["asked"]
    assert records[2]["cohort"] == members_ids and str(ids[KILLED]) in records[2]["stages"]["advertise"]["failed"]
    assert records[2]["survivors"] == sorted(ids[k] for k in range(3))
    assert kept[(KILLED, 3)] is None and all(kept[(STRANGER, r)] is None for r in (1, 2, 3))
    # Every kept input is named by its owner's protocol id, and each sum is exactly the kept inputs (mod 2^64).
    assert all(p.stem.rsplit("-", 1)[1] == str(ids[k]) for (k, _), p in kept.items() if p is not None)
    for server_round, summed in ((1, MEMBERS), (2, MEMBERS), (3, range(3))):
        total = np.load(out / f"secagg-sum-{server_round}.npy")
        inputs = [np.load(kept[(k, server_round)]) for k in summed]
        assert total.dtype == np.uint64 and len(total) > 1000 and all(x.shape == total.shape for x in inputs)
        assert np.array_equal(total, sum(inputs[1:], inputs[0])), server_round
    total = np.load(out / "secagg-sum-2.npy")
    assert not np.array_equal(total, sum(np.load(kept[(k, 2)]) for k in range(3)))  # client 3's input is in it
    assert all(r["bytes_sent"] > 8 * len(total) and r["bytes_received"] > 8 * len(total) and r["seconds"] > 0
               for r in records)
    # Distributed noise: each sum within what honest owners send, decoded into the server's step;
    # each summed owner's ε (its masked reply's only metric) kept by its protocol id.
    assert all(r["sum_norm"] <= r["honest_bound"] for r in records)
    assert [r["epsilon"] for r in records] == sorted(r["epsilon"] for r in records) and 0 < records[-1]["epsilon"] <= 3
    result = json.loads((out / "result.json").read_text())
    assert [r["trained"] for r in result["rounds"]] == [members_ids, members_ids, sorted(ids[k] for k in range(3))]
    assert set(result["rounds"][-1]["client_epsilon"]) == {str(i) for i in members_ids}
    # Each owner's ledger is charged once a round it trained in; the stranger's holds nothing.
    for k in range(5):
        charges = [e["charges"] for book in books[k] for e in book["experiments"]]
        assert charges == ([] if k == STRANGER else [2] if k == KILLED else [3]), (k, books[k])
    print("secure aggregation rounds:", [dict(round=r["round"], seconds=round(r["seconds"], 1),
                                              bytes_sent=r["bytes_sent"], bytes_received=r["bytes_received"])
                                         for r in records],
          "accuracy:", [r["test_accuracy"] for r in result["rounds"]])
    assert processes_mentioning(str(work)) == []
