"""A deployed SuperNode's warm worker (clients/worker.py), as a real process: it answers as the
ClientApp would in its own process (the same weights, the same state), serves round after
round from one process, refuses a caller without the node's key, and exits when idle or when
its SuperNode does. The deployment tests (test_deploy.py) run it under real SuperNodes."""
import os
import signal
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

from clients import local, worker
from clients.node_config import parse
from fedsd.config import TrainConfig
from fedsd.federation import FedOptions, client_config, to_flat
from fedsd.training import initial_model
from task.records import model_to_record, record_to_model
from tests.conftest import require

pytestmark = pytest.mark.slow


def own_data(tmp_path):
    from simulations.split_data import write_client_folders

    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", batch_size=64, subset=600, threads=1)
    fed = FedOptions(num_clients=2, rounds=2, client_data="own")
    write_client_folders(cfg, fed, tmp_path / "data", "npz", echo=lambda line: None)
    flat = {**to_flat(cfg, fed), "experiment-id": "worker-test"}
    return cfg, fed, flat


def context(tmp_path, name: str, **more) -> Context:
    node_config = {"partition-id": 0, "num-partitions": 2, "data": str(tmp_path / "data" / "client-0"),
                   "max-epsilon": float("inf"), "state-dir": str(tmp_path / name), **more}
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def message(model, flat, server_round: int) -> RecordDict:
    return RecordDict({"arrays": model_to_record(model), "config": ConfigRecord({**flat, "server-round": server_round})})


def worker_pids(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"clients.worker --socket {marker}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_warm_worker_answers_as_the_clientapp_would_from_one_process(tmp_path):
    cfg, fed, flat = own_data(tmp_path)
    start = initial_model(client_config(cfg, fed), 10)
    here, there = context(tmp_path, "here"), context(tmp_path, "there", **{"worker-idle-seconds": 60})
    node = parse(there.node_config)
    pids = []
    for server_round in (1, 2):
        mine = local.train_reply(message(start, flat, server_round), here)
        theirs = worker.ask(node, "train", message(start, flat, server_round), there)
        a, b = record_to_model(mine["arrays"]), record_to_model(theirs["arrays"])
        assert all(torch.equal(a["student"][k], b["student"][k]) for k in a["student"])
        assert dict(mine["metrics"])["epsilon"] == dict(theirs["metrics"])["epsilon"] > 0
        assert sorted(there.state.keys()) == sorted(here.state.keys()) != []  # the state came back
        pids.append(worker_pids(str(tmp_path / "there")))
    assert len(pids[0]) == 1 and pids[0] == pids[1]  # round 2 was the same process's
    folder = tmp_path / "there" / "worker"
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / "key").stat().st_mode & 0o777 == 0o600
    [sock] = folder.glob("*.sock")
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client(str(sock), family="AF_UNIX", authkey=b"not the node's key").send(("train", None, None))
    reply = worker.ask(node, "evaluate", message(start, flat, 2), there)  # still serving after that
    assert 0 <= dict(reply["metrics"])["test-accuracy"] <= 1
    os.kill(pids[0][0], signal.SIGTERM)
    assert wait_for(lambda: not worker_pids(str(tmp_path / "there")), 10)


def test_a_worker_exits_when_idle_and_when_its_supernode_does(tmp_path):
    cfg, fed, flat = own_data(tmp_path)
    start = initial_model(client_config(cfg, fed), 10)
    idle = context(tmp_path, "idle", **{"worker-idle-seconds": 1})
    worker.ask(parse(idle.node_config), "evaluate", message(start, flat, 1), idle)
    assert wait_for(lambda: not worker_pids(str(tmp_path / "idle")), 15)
    assert not list((tmp_path / "idle" / "worker").glob("*.sock"))  # and took its socket with it
    # A worker watches the process that started its ClientApp (the SuperNode's SuperExec).
    supernode = subprocess.Popen(["sleep", "600"])
    folder = tmp_path / "watched" / "worker"
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-m", "clients.worker", "--socket", str(folder / "w.sock"),
                             "--watch-pid", str(supernode.pid), "--idle-seconds", "600"])
    try:
        assert wait_for(lambda: (folder / "w.sock").exists(), 120)
        supernode.kill()
        supernode.wait()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        supernode.kill()


def test_only_flowers_per_message_process_uses_a_worker_and_never_for_a_refusing_node(tmp_path, monkeypatch):
    node = parse({"partition-id": 0, "max-epsilon": 3})
    assert not worker.wanted(node)  # a test's (or a Ray actor's) process answers itself
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flwr-clientapp"])
    assert worker.wanted(node)
    assert not worker.wanted(parse({"partition-id": 0, "max-epsilon": 3, "worker": "off"}))
    (tmp_path / "data.npz").write_bytes(b"")
    assert not worker.wanted(parse({"partition-id": 0, "data": str(tmp_path / "data.npz")}))  # refuses: no budget
    with pytest.raises(ValueError, match="worker='sometimes': choose one of auto, off"):
        parse({"partition-id": 0, "worker": "sometimes"})
