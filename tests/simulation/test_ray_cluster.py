"""`fedsd simulate --ray-address`: a simulation attached to a running Ray cluster.

The cluster is real: `ray start --head` on this machine, in a private temp dir and on a free
port, as a user starts the head of a multi-node cluster (a Ray cluster on one machine is the
engine users run across many). It is stopped after the test, failed or not, by ending its
process group: `ray stop` in Ray 2.x takes no address and would stop every Ray instance on the
machine, another test's or the user's included.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedsd.cli.main import main
from tests.conftest import require

RAY = Path(sys.executable).parent / "ray"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """(HOST:PORT, temp dir) of a running 2-CPU Ray head, stopped afterwards whatever happens."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths have a length limit
    log = open(Path(temp) / "ray-start.log", "w")
    # The cluster's workers get their environment from here (FEDSD_DATA_DIR: where the data
    # is on this node), as on every node of a real cluster.
    head = subprocess.Popen([str(RAY), "start", "--head", "--num-cpus", "2", "--port", str(port), "--temp-dir", temp,
                             "--include-dashboard", "false", "--disable-usage-stats", "--block"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, (Path(temp) / "ray-start.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
                time.sleep(0.5)
        time.sleep(3)  # the raylet registers with the GCS just after the port opens
        yield f"127.0.0.1:{port}", Path(temp)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        time.sleep(1)  # the raylet's workers leave with it
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_simulation_runs_as_a_job_on_a_running_ray_cluster(ray_cluster, tmp_path):
    require("fmnist")
    address, temp = ray_cluster
    out = tmp_path / "run"
    assert main(["simulate", "--ray-address", address, "--dataset", "fmnist", "--subset", "2000", "--clients", "2",
                 "--rounds", "2", "--batch-size", "100", "--lr", "0.8", "--epsilon", "3", "--client-cpus", "1",
                 "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "result.json").read_text())
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    assert all(r["trained"] == [0, 1] for r in result["rounds"])
    assert all(2.9 < e <= 3.0 for e in result["rounds"][-1]["client_epsilon"].values())
    assert result["test_accuracy"] > 0.3  # 2 rounds of 10 steps on 2000 Fashion-MNIST images; chance is 0.1
    # This process was a driver of the cluster (its log is in the cluster's session, named by
    # pid) and the cluster's workers ran the clients: no private Ray instance was started.
    logs = temp / "session_latest" / "logs"
    assert list(logs.glob(f"python-core-driver-*_{os.getpid()}.log")), sorted(logs.iterdir())
    assert len(list(logs.glob("python-core-worker-*.log"))) >= 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("flwr", path=str(Path(sys.executable).parent)) is None, reason="no flwr CLI")
def test_flwr_run_attaches_through_ray_address(ray_cluster, flower_env, tmp_path):
    """Flower 1.41's simulation settings have no address: Ray's own RAY_ADDRESS, in the
    environment where flwr starts its local SuperLink, makes the simulation a job of the
    cluster (simulations/README.md). `flwr run .` with a run config: its result where out-dir
    says, every client's ε within the run's."""
    require("fmnist")
    address, temp = ray_cluster
    drivers = lambda: set((temp / "session_latest" / "logs").glob("python-core-driver-*.log"))
    before, out = drivers(), tmp_path / "flwr-run"
    proc = subprocess.run(["flwr", "run", ".", "--stream", "--federation-config", "num-supernodes=2", "--run-config",
                           "num-clients=2 num-server-rounds=1 dataset='fmnist' subset=2000 batch-size=100 lr=0.8 "
                           f"out-dir='{out}'"],
                          cwd=Path(__file__).resolve().parents[2], env={**flower_env, "RAY_ADDRESS": address},
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "fedsd round 1/1: test accuracy" in output, output[-3000:]
    assert len(drivers() - before) == 1, "the simulation did not run as a job of the cluster"
    result = json.loads((out / "result.json").read_text())
    assert len(result["rounds"]) == 1 and result["num_clients"] == 2
    assert sorted(result["rounds"][0]["client_epsilon"]) == ["0", "1"]
    assert all(0 < e <= 3.0 for e in result["rounds"][0]["client_epsilon"].values())


def test_a_ray_address_where_no_cluster_answers_is_refused_before_any_work(tmp_path, capsys):
    # The port held, bound and never listening, while fedsd asks it: a port only free when picked was
    # taken by a process of a test beside this one (make test's other worker) and answered on the
    # machine's address, to which Ray turns 127.0.0.1 (a fresh clone's make test failed so).
    with socket.socket() as held:
        held.bind(("", 0))
        port = held.getsockname()[1]
        code = main(["simulate", "--ray-address", f"127.0.0.1:{port}", "--dataset", "fmnist", "--subset", "600",
                     "--clients", "2", "--rounds", "1", "--batch-size", "100", "--epsilon", "3",
                     "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and f"--ray-address 127.0.0.1:{port}: no Ray cluster answers" in err, err
    assert "ray start --head" in err and not (tmp_path / "run").exists()
    code = main(["simulate", "--ray-address", "ray://head:10001", "--out", str(tmp_path / "run")])
    assert code == 2 and "Ray Client address" in capsys.readouterr().err
