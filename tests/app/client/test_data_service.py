"""A client machine's data service (fedsd/app/client/owner_service.py), as a real process: as the warm
worker it answers as the ClientApp would in its own process (the same weights), serves round
after round from one process, and exits when idle or when its SuperNode does; as the owner's
service it answers with its own node config and says what code answered, and it answers only
the users it is told to, in Flower's records, never pickle. The deployment tests
(test_deploy.py) run both under real SuperNodes."""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedsd.app.client import owner_service as data_service, handler as local
from fedsd.app.client.node_config import NodeConfigError, parse
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig, client_config, to_flat
from fedsd.training.loop import initial_model
from fedsd.app.records import model_to_record, record_to_model
from tests.conftest import require

pytestmark = pytest.mark.slow


def own_data(tmp_path):
    from fedsd.simulation.client_folders import write_client_folders

    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", batch_size=64, subset=600, threads=1)
    fed = FedConfig(num_clients=2, rounds=2, client_data="own")
    write_client_folders(cfg, fed, tmp_path / "data", "npz", echo=lambda line: None)
    flat = {**to_flat(cfg, fed), "experiment-id": "worker-test"}
    return cfg, fed, flat


def context(tmp_path, name: str, **more) -> Context:
    # seeded noise (the owner's word given): the worker and this process must train the same weights
    node_config = {"partition-id": 0, "num-partitions": 2, "data": str(tmp_path / "data" / "client-0"),
                   "max-epsilon": float("inf"), "state-dir": str(tmp_path / name), "randomness": "seeded",
                   "trust-server-with-noise": True, "federated-evaluation": True, **more}
    return Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})


def message(model, flat, server_round: int) -> RecordDict:
    return RecordDict({"arrays": model_to_record(model),
                       "config": ConfigRecord({**flat, "server-round": server_round})})


def worker_pids(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"fedsd.app.client.owner_service --socket {marker}"], capture_output=True,
                         text=True).stdout
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
        theirs = data_service.ask_worker(node, "train", message(start, flat, server_round), there)
        a, b = record_to_model(mine["arrays"]), record_to_model(theirs["arrays"])
        assert all(torch.equal(a["student"][k], b["student"][k]) for k in a["student"])
        assert dict(mine["metrics"])["epsilon"] == dict(theirs["metrics"])["epsilon"] > 0
        assert not there.state.keys()  # the privacy state stays with the worker, on the owner's disk
        pids.append(worker_pids(str(tmp_path / "there")))
    assert len(pids[0]) == 1 and pids[0] == pids[1]  # round 2 was the same process's
    folder = tmp_path / "there" / "worker"
    assert folder.stat().st_mode & 0o777 == 0o700
    [sock] = folder.glob("*.sock")
    with socket.socket(socket.AF_UNIX) as raw:  # a peer that sends no records, then a pickle: ignored
        raw.connect(str(sock))
        raw.sendall(struct.pack("!Q", 4) + b"junk")
    reply = data_service.ask_worker(node, "evaluate", message(start, flat, 2), there)  # still serving after that
    assert 0 <= dict(reply["metrics"])["test-accuracy"] <= 1 and dict(reply["metrics"])["num-examples"] > 0
    os.kill(pids[0][0], signal.SIGTERM)
    assert wait_for(lambda: not worker_pids(str(tmp_path / "there")), 10)


def test_a_worker_exits_when_idle_and_when_its_supernode_does(tmp_path):
    cfg, fed, flat = own_data(tmp_path)
    start = initial_model(client_config(cfg, fed), 10)
    idle = context(tmp_path, "idle", **{"worker-idle-seconds": 1})
    data_service.ask_worker(parse(idle.node_config), "evaluate", message(start, flat, 1), idle)
    assert wait_for(lambda: not worker_pids(str(tmp_path / "idle")), 15)
    assert not list((tmp_path / "idle" / "worker").glob("*.sock"))  # and took its socket with it
    # A worker watches the process that started its ClientApp (the SuperNode's SuperExec).
    supernode = subprocess.Popen(["sleep", "600"])
    folder = tmp_path / "watched" / "worker"
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "fedsd.app.client.owner_service", "--socket",
                             str(folder / "w.sock"), "--watch-pid", str(supernode.pid), "--idle-seconds", "600"])
    try:
        assert wait_for(lambda: (folder / "w.sock").exists(), 120)
        supernode.kill()
        supernode.wait()
        proc.wait(timeout=10)
    finally:
        proc.kill()
        supernode.kill()


def test_a_starting_workers_socket_is_waited_for_not_removed_between_its_bind_and_its_listen(tmp_path):
    """A worker's socket file exists from its bind, before it listens. A connection refused in
    between must not be taken for a worker that has gone: the wait removed the file, the worker
    then listened at a path no longer there, and every start on a loaded machine waited out its
    120 s (two slow tests failed so in a CI run beside a deployment)."""
    address, log = tmp_path / "w.sock", tmp_path / "worker.log"
    log.write_text("")
    late = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); time.sleep(1.5); "
            "s.listen(1); c, _ = s.accept(); c.recv(1)")
    proc = subprocess.Popen([sys.executable, "-c", late, str(address)])
    try:
        sock = data_service._listening(proc, address, log, seconds=20)
        sock.close()
        assert address.is_socket()
    finally:
        proc.kill()
        proc.wait()


def test_only_flowers_per_message_process_uses_a_worker_and_never_for_a_refusing_node(tmp_path, monkeypatch):
    node = parse({"partition-id": 0, "max-epsilon": 3})
    assert not data_service.wanted(node)  # a test's (or a Ray actor's) process answers itself
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flwr-clientapp"])
    assert data_service.wanted(node)
    assert not data_service.wanted(parse({"partition-id": 0, "max-epsilon": 3, "worker": "off"}))
    (tmp_path / "data.npz").write_bytes(b"")
    assert not data_service.wanted(parse({"partition-id": 0, "data": str(tmp_path / "data.npz")}))  # no budget
    with pytest.raises(ValueError, match="worker='sometimes': choose one of auto, off"):
        parse({"partition-id": 0, "worker": "sometimes"})


def talk_as(uid: int, sock) -> bool:
    """Whether a process of user `uid` gets an answer from the service at `sock` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("another user's process needs root here")
    # a well-formed request (a header, an empty RecordDict), then whatever comes back
    probe = ("import socket, struct, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
             "h = sys.argv[2].encode(); s.sendall(struct.pack('!Q', len(h)) + h + struct.pack('!Q', 0)); "
             "print(len(s.recv(8)))")
    header = json.dumps({"kind": "evaluate", "run_id": 1, "node_id": 1})
    out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                          probe, str(sock), header], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() not in ("", "0")


def test_the_owners_service_answers_with_its_own_config_and_says_what_code_answered(tmp_path):
    """The SuperNode's ClientApp (the server's code) forwards; the service (the owner's code) reads
    the data under its own node config, whatever the forwarded message says."""
    cfg, fed, flat = own_data(tmp_path)
    start = initial_model(client_config(cfg, fed), 10)
    owner = context(tmp_path, "owner").node_config
    import tempfile

    passable = Path(tempfile.mkdtemp(prefix="fedsd-service-", dir="/tmp"))  # as /run/fedsd: others may pass
    passable.chmod(0o711)
    address = passable / "service.sock"
    node_config = " ".join(f"{k}={json.dumps(v) if not isinstance(v, float) or v != float('inf') else 'inf'}"
                           for k, v in owner.items())
    proc = subprocess.Popen([sys.executable, "-P", "-m", "fedsd.cli.main", "data-service", "--socket", str(address),
                             "--node-config", node_config, "--allow-uid", "65533"])
    try:
        assert wait_for(address.exists, 120)
        supernode = {"partition-id": 0, "service": str(address)}
        forwarded = Context(run_id=1, node_id=1, node_config=supernode, state=RecordDict(), run_config={})
        reply = data_service.ask_service(parse(supernode), "train", message(start, flat, 1), forwarded)
        assert dict(reply["metrics"])["num-examples"] == 300 and dict(reply["metrics"])["skipped"] == 0
        identity = dict(reply["service"])
        assert identity["code"] == data_service.code_hash() and identity["version"]
        assert list((tmp_path / "owner").glob("ledger-*.json"))  # charged on the owner's state folder
        assert not forwarded.state.keys()
        liar = {"partition-id": 1, "service": str(address)}
        with pytest.raises(data_service.ServiceError, match="partition-id=1 of the SuperNode"):
            data_service.ask_service(parse(liar), "train", message(start, flat, 1),
                                     Context(run_id=1, node_id=1, node_config=liar, state=RecordDict(), run_config={}))
        assert talk_as(65533, address)  # the SuperNode's user it was told to answer
        assert not talk_as(65534, address)  # anyone else: closed without a word
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(passable, ignore_errors=True)


def test_a_supernode_with_a_service_names_no_data_of_its_own(tmp_path):
    with pytest.raises(NodeConfigError, match="node-config data: with service=... it belongs in the data service"):
        parse({"partition-id": 0, "service": str(tmp_path / "s.sock"), "data": str(tmp_path)})
    supernode = {"partition-id": 0, "service": str(tmp_path / "nobody.sock")}
    with pytest.raises(data_service.ServiceUnavailable, match="no data service listens"):
        data_service.ask_service(parse(supernode), "train", RecordDict(),
                                 Context(run_id=1, node_id=1, node_config=supernode, state=RecordDict(), run_config={}))


def test_a_state_folder_too_deep_for_a_socket_path_still_gets_its_warm_worker(tmp_path):
    """A Unix socket's address is at most 107 bytes: a deeper state folder's worker listens in
    that folder all the same (reached through the folder's descriptor), where it had failed to
    start and every round was answered at the cold start's cost in the ClientApp's process."""
    cfg, fed, flat = own_data(tmp_path)
    start = initial_model(client_config(cfg, fed), 10)
    deep = "d" * 120
    there = context(tmp_path, deep, **{"worker-idle-seconds": 60})
    reply = data_service.ask_worker(parse(there.node_config), "train", message(start, flat, 1), there)
    assert dict(reply["metrics"])["epsilon"] > 0
    [sock] = (tmp_path / deep / "worker").glob("*.sock")
    assert len(os.fsencode(sock)) > data_service.SUN_PATH_MAX
    [pid] = worker_pids(str(tmp_path / deep))
    os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: not worker_pids(str(tmp_path / deep)), 10)



def test_the_owners_identity_is_made_once_in_its_state_folder_and_a_bad_node_config_is_said_plainly(tmp_path,
                                                                                                    capsys):
    """`fedsd data-service --identity`: the owner's public line, from a key made on first use in
    its state folder (0600, 32 bytes) and the same line after; the node config's secagg-roster is
    not read (the roster that will list this identity need not exist yet). A missing, malformed
    or wrong node config, or a key others can read, is one clear line and exit code 2."""
    from fedsd.secure.identity import parse_public
    from fedsd.cli.main import main

    def identity(*args) -> tuple[int, str, str]:
        umask = os.umask(0o022)
        try:  # the service sets its own umask (0077): this process's is put back
            code = main(["data-service", "--identity", *args])
        finally:
            os.umask(umask)
        said = capsys.readouterr()
        return code, said.out, said.err

    state = tmp_path / "state"
    owner = f"partition-id=0 state-dir='{state}' max-epsilon=3 secagg-roster='{tmp_path / 'not-yet'}'"
    code, line, err = identity("--node-config", owner)
    assert code == 0, err
    key = state / "identity.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == 32 and key.stat().st_uid == os.getuid()
    assert len(parse_public(line.strip())) == 32
    assert identity("--node-config", owner)[1] == line  # made once
    for args, said in (([], "--identity: needs --node-config with this owner's state-dir"),
                       (["--node-config", f"partition-id=0 state-dir='{state}' max-epsilon=three"],
                        "not 'k=v ...' pairs with TOML values"),
                       (["--node-config", str(tmp_path / "owner.toml")], "owner.toml': No such file"),
                       (["--node-config", f"partition-id=0 state-dir='{state}' max-epsilom=3"],
                        "node-config max-epsilom: not a key fedsd reads")):
        code, out, err = identity(*args)
        assert code == 2 and out == "" and err.startswith("fedsd data-service: error: ") and said in err, err
    key.chmod(0o644)
    code, _, err = identity("--node-config", owner)
    assert code == 2 and "identity.key in the state folder: must be a file of this user's alone (mode 0600)" in err
