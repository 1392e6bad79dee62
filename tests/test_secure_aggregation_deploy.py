"""Secure aggregation on a real deployment: a SuperLink, four SuperNodes under --isolate, each
with its owner's data service (its own uid, data and ledger), `secure-aggregation = true` and
every owner keeping its inputs (secagg-keep-inputs=true), so the test can check the server's sums.

Round 1: client 3's service is killed once it has sent its masked input. In SecAgg a client
that sent its masked input is a survivor: its input is in the sum, and the round completes
from the unmask answers of the other three (the threshold for four is three). Round 2: client
3's service is gone before its masked input (its SuperNode still online, so it is in the
cohort and drops out): the sum is exactly the other three's inputs, mod 2^64.

Four, not three: with three clients the threshold is three (more than two thirds), so one
client gone before the unmask stage would leave the round below it."""
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from simulations.deployment.local_deployment import LocalDeployment
from task.secure_sum import secagg_id
from tests.test_deploy import RUN, isolated_client_data, processes_mentioning, wait_for

pytestmark = pytest.mark.slow
KILLED = 3


def kept_input(deployment: LocalDeployment, k: int, server_round: int) -> Path | None:
    # <run>-<experiment>-<round>-<node>.npy (clients/secure_aggregation.kept_input_path)
    found = sorted(p for p in (deployment.owner_dir(k) / "state" / "secagg").glob("*.npy")
                   if p.stem.rsplit("-", 2)[1] == str(server_round))
    return found[0] if found else None


def test_a_service_killed_after_its_masked_input_is_in_the_sum_and_one_gone_before_is_not(tmp_path):
    data, work, out = isolated_client_data(tmp_path, 4, 800), tmp_path / "work", tmp_path / "out"
    owners = "max-epsilon=3 secagg-min-clients=3 secagg-keep-inputs=true"
    with LocalDeployment(work, 4, client_data=data, node_config=owners, isolate=True) as deployment:
        deployment.start()
        run = deployment.submit({**RUN, "num-clients": 4, "num-server-rounds": 2, "client-data": "own",
                                 "epsilon": 3.0, "secure-aggregation": True, "out-dir": str(out)})
        service_log = deployment.logs / f"data-service-{KILLED}.log"
        wait_for(lambda: service_log.exists() and "answered a secagg-masked message" in service_log.read_text(),
                 600, "client 3's masked input")
        os.killpg(deployment.services[KILLED].pid, signal.SIGKILL)
        assert run.wait(timeout=900) == 0
        output = run.log.read_text(errors="replace")
        assert "ServerApp raised" not in output, output[-3000:]
        kept = {(k, r): kept_input(deployment, k, r) for k in range(4) for r in (1, 2)}
        node_ids = {k: secagg_id(n) for k, n in deployment.node_ids.items()}  # the protocol's ids
    records = json.loads((out / "secure-aggregation.json").read_text())
    assert [r["round"] for r in records] == [1, 2] and [r["abandoned"] for r in records] == [None, None]
    # Round 1: all four sent masked inputs (so all four are summed); three confirmed the
    # survivors and answered the unmask.
    assert records[0]["survivors"] == sorted(node_ids.values()) and records[0]["threshold"] == 3
    assert str(node_ids[KILLED]) in records[0]["stages"]["confirm"]["failed"]
    assert records[0]["stages"]["unmask"]["answered"] == sorted(node_ids[k] for k in range(3))
    total = np.load(out / "secagg-sum-1.npy")
    inputs = [np.load(kept[(k, 1)]) for k in range(4)]
    assert total.dtype == np.uint64 and len(total) > 1000
    assert np.array_equal(total, inputs[0] + inputs[1] + inputs[2] + inputs[3])
    assert not np.array_equal(total, inputs[0] + inputs[1] + inputs[2])
    # Round 2: client 3 gone before its masked input: the other three, exactly.
    assert kept[(KILLED, 2)] is None
    assert records[1]["survivors"] == sorted(node_ids[k] for k in range(3))
    total = np.load(out / "secagg-sum-2.npy")
    assert np.array_equal(total, sum(np.load(kept[(k, 2)]) for k in range(3)))
    assert all(r["bytes_sent"] > 8 * len(total) and r["bytes_received"] > 8 * len(total) and r["seconds"] > 0
               for r in records)
    result = json.loads((out / "result.json").read_text())
    assert [r["trained"] for r in result["rounds"]] == [[0, 1, 2, 3], [0, 1, 2]]
    assert result["rounds"][-1]["test_accuracy"] > 0.15  # the mean update learns (0.18-0.19 here); chance is 0.1
    assert processes_mentioning(str(work)) == []
