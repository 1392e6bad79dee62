"""A newcomer's second hour: what a user types is taken as typed or refused saying
why, a dry run checks what the real run would and writes nothing, and a run's result is easy
to see and to use."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedsd.cli.main import main
from tests.conftest import read_tensorboard, require, write_image_folder

ROOT = Path(__file__).resolve().parents[2]


def fedsd(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "fedsd.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or ROOT, timeout=600)


@pytest.mark.slow
def test_a_dry_run_of_split_data_writes_nothing(tmp_path):
    require("fmnist")
    proc = fedsd("split-data", "--dataset", "fmnist", "--clients", "2", "--subset", "1200", "--format", "imagefolder",
                 "--out", str(tmp_path / "parts"), env={"FEDSD_DRY_RUN": "1"})
    assert proc.returncode == 0 and "would write 2 client folders" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train"], ["simulate", "--clients", "2", "--rounds", "1"]])
def test_a_dry_run_refuses_what_the_run_would(tmp_path, capsys, monkeypatch, command):
    """fmnist (one grey channel) on cifar-cnn (three): refused by the dry run, as by the run, before any data or Ray."""
    require("fmnist")
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    assert main([*command, "--epsilon", "3", "--dataset", "fmnist", "--model", "cifar-cnn", "--out",
                 str(tmp_path / "o")]) == 2
    assert "--model: cifar-cnn takes 3 channels; the task has 1 channel(s) at 28×28" in capsys.readouterr().err


def test_a_data_dir_someone_typed_must_exist(tmp_path, capsys):
    require("fmnist")
    assert main(["train", "--epsilon", "3", "--dataset", "fmnist", "--data-dir", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--data-dir {tmp_path / 'nowhere'}: no such folder" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["train", "--verbos"], "unrecognized arguments: --verbos"),
    (["simulate", "--verbos"], "unrecognized arguments: --verbos; did you mean --verbose?"),
    (["train", "--method", "dp3dsd"], "invalid choice: 'dp3dsd'"),
    (["train", "--meth", "dpsgd"], "unrecognized arguments: --meth"),  # no abbreviations
])
def test_options_are_taken_as_typed_or_refused_with_the_nearest(args, needle):
    proc = fedsd(*args, "--epsilon", "3", "--out", "x")
    assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    if "dp3dsd" in args:
        assert "did you mean dpdsd?" in proc.stderr


def test_simulate_refuses_what_it_would_ignore(tmp_path, capsys):
    assert main(["simulate", "--epochs", "5", "--clients", "2", "--out", str(tmp_path / "o")]) == 2
    assert "--epochs: a federation's length is --rounds × --local-epochs" in capsys.readouterr().err
    assert main(["simulate", "--resume", str(tmp_path), "--rounds", "4"]) == 2
    assert "--resume DIR goes on with that run's own saved settings and folder; leave out --rounds" in \
        capsys.readouterr().err
    (tmp_path / "result.json").write_text("{}")
    assert main(["simulate", "--resume", str(tmp_path)]) == 2
    assert "is a finished run (it has result.json); nothing to resume. Its σ was calibrated so that its planned " \
        "rounds spend exactly its ε" in capsys.readouterr().err


@pytest.mark.slow
def test_version():
    from fedsd import __version__

    proc = fedsd("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fedsd {__version__}"


@pytest.mark.slow
def test_load_model_gives_what_the_run_released_ready_to_use(tmp_path, capsys):
    """fedsd.load_model: the network with the run's weights and normalisation, on raw images."""
    require("fmnist")
    import fedsd
    from fedsd.data import datasets as data_lib

    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--method", "dpsgd", "--subset", "2000", "--epochs", "2",
                 "--batch-size", "200", "--lr", "2", "--epsilon", "3", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[3].startswith("  settings       B = 200, lr 2, momentum 0.9, σ = ") \
        and summary[3].endswith(", 2 epochs")
    model = fedsd.load_model(out)
    images = data_lib.load("fmnist")
    with torch.no_grad():
        accuracy = (model(images.x_test).argmax(1) == images.y_test).float().mean().item()
    assert accuracy == pytest.approx(json.loads((out / "result.json").read_text())["test_accuracy"], abs=1e-3)
    assert not model.training


def test_own_images_train_centrally_their_task_read_from_the_files(tmp_path, capsys, monkeypatch):
    """`fedsd train --dataset custom --data-dir DIR`: classes, channels and size from the files,
    a stratified test split held out (and said), and the run learns (T-shirts from trousers)."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    data = write_image_folder(tmp_path / "mine", {"tshirt": 0, "trouser": 1}, per_class=150)
    out = tmp_path / "run"
    assert main(["train", "--dataset", "custom", "--data-dir", str(data), "--method", "dpsgd", "--epochs", "4",
                 "--batch-size", "40", "--lr", "0.5", "--epsilon", "8", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "(no test split: 60 of its 300 training samples, 20%, held out as the test split" in summary
    result = json.loads((out / "result.json").read_text())
    cfg = result["config"]
    assert (cfg["classes"], cfg["channels"], cfg["image_size"], cfg["model"]) == ("trouser,tshirt", 1, 28, "mnist-cnn")
    assert result["test_accuracy"] >= 0.85


def test_own_data_that_does_not_say_its_task_is_refused_with_the_option(tmp_path, capsys):
    from torchvision.io import write_png

    assert main(["train", "--dataset", "custom", "--epsilon", "3", "--out", str(tmp_path / "o")]) == 2
    assert "--data-dir: --dataset custom trains on files of your own; pass --data-dir with a folder" in \
        capsys.readouterr().err
    for name, size in (("a", 20), ("b", 24)):
        (tmp_path / "mixed" / "train" / name).mkdir(parents=True)
        write_png(torch.zeros(1, size, size, dtype=torch.uint8), str(tmp_path / "mixed" / "train" / name / "0.png"))
    assert main(["train", "--dataset", "custom", "--data-dir", str(tmp_path / "mixed"), "--epsilon", "3",
                 "--out", str(tmp_path / "o")]) == 2
    assert "--image-size: the images are not all one square size (20×20, 24×24); pass --image-size N" in \
        capsys.readouterr().err
    assert main(["train", "--dataset", "custom", "--data-dir", str(tmp_path / "mixed"), "--image-size", "32",
                 "--epsilon", "3", "--out", str(tmp_path / "o")]) == 2
    assert "--model: cifar-cnn takes 3 channels; the task has 1 channel(s) at 32×32; for your own images, pass " \
           "--model cifar-cnn --channels 3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_own_npz_data_simulates_as_a_federation(tmp_path):
    """`fedsd simulate --dataset custom --data-dir FILE.npz`: partitioned like a built-in set; its test split is its own."""  # noqa: E501
    import numpy as np

    from fedsd.data import datasets as data_lib

    require("fmnist")
    images = data_lib.load("fmnist")
    np.savez(tmp_path / "mine.npz", x_train=images.x_train[:2000, 0].numpy(), y_train=images.y_train[:2000].numpy(),
             x_test=images.x_test[:500, 0].numpy(), y_test=images.y_test[:500].numpy())
    proc = fedsd("simulate", "--dataset", "custom", "--data-dir", str(tmp_path / "mine.npz"), "--clients", "2",
                 "--rounds", "3", "--method", "dpsgd", "--batch-size", "100", "--lr", "1", "--epsilon", "8",
                 "--quiet", "--out", str(tmp_path / "sim"),
                 env={"FEDSD_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "sim" / "result.json").read_text())
    assert result["shard_sizes"] == [1000, 1000] and result["data_source"] == str(tmp_path / "mine.npz")
    assert result["config"]["classes"] == "0,1,2,3,4,5,6,7,8,9" and result["test_accuracy"] >= 0.45  # chance: 0.10


@pytest.mark.slow
def test_a_run_writes_a_tensorboard_log_that_tensorboard_reads(tmp_path):
    """Per epoch: test accuracy and loss, validation accuracy, ε, as result.json has them; the
    resolved settings as hparams. --log-dir off writes none."""
    require("fmnist")
    out = tmp_path / "run"
    assert main(["train", "--dataset", "fmnist", "--method", "dpsgd", "--subset", "1000", "--validation", "500",
                 "--epochs", "2", "--batch-size", "100", "--epsilon", "3", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    epochs = json.loads((out / "result.json").read_text())["epochs"]
    scalars, hparams = read_tensorboard(out / "tensorboard")
    for tag, key in (("test/accuracy", "test_accuracy"), ("test/loss", "test_loss"), ("privacy/epsilon", "epsilon"),
                     ("validation/accuracy", "validation_accuracy")):
        assert scalars[tag] == [(e["epoch"], pytest.approx(e[key], rel=1e-6)) for e in epochs], tag
    assert hparams["method"] == "dpsgd" and hparams["batch_size"] == 100 and hparams["epochs"] == 2
    assert main(["train", "--dataset", "fmnist", "--method", "dpsgd", "--subset", "1000", "--epochs", "1",
                 "--batch-size", "100", "--epsilon", "3", "--threads", "1", "--quiet", "--log-dir", "off",
                 "--out", str(tmp_path / "quiet")]) == 0
    assert not (tmp_path / "quiet" / "tensorboard").exists()


@pytest.mark.parametrize("args, needle", [
    (["--set", "momentum=0,0.9", "--grid", "ema-decay=0.99"], "--set: KEY=VALUE, one value (--grid sweeps several)"),
    (["--set", "ema-decay=0.9", "--grid", "ema-decay=0.99"], "--set: ema-decay is swept by --grid too"),
    (["--set", "seed=3", "--grid", "ema-decay=0.99"], "--set: 'seed' cannot be swept"),
])
def test_a_sweeps_fixed_settings_are_refused_when_they_cannot_be_one_value(args, needle, tmp_path, capsys):
    assert main(["sweep", "--dataset", "fmnist", "--method", "dpema", *args, "--out", str(tmp_path / "s")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_deploy_local_script_says_its_usage_before_the_venv_exists():
    proc = subprocess.run([str(ROOT / "scripts" / "deploy-local.sh"), "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "/nonexistent/python"}, timeout=30)
    assert proc.returncode == 0 and "scripts/deploy-local.sh --clients N --rounds R" in proc.stdout, proc.stderr


def test_train_help_says_epsilon_is_required_as_the_command_does(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--epsilon X privacy budget ε of the whole run (a client's, federated) (required, unless --resume or "
            "a recipe gives it)") in text
    assert main(["train", "--out", str(tmp_path / "o")]) == 2
    assert "the following arguments are required: --epsilon (or --resume DIR)" in capsys.readouterr().err


def test_colocated_nodes_share_the_machines_cores_unless_the_operator_says(tmp_path, monkeypatch):
    """deploy-local and `fedsd bench deploy`: each SuperNode (and its worker or data service, which
    inherit its environment) takes cores ÷ nodes threads, as Ray gives a simulated client its CPUs."""
    from fedsd.deployment.local_deployment import LocalDeployment, node_threads

    assert [node_threads(n, cores=16) for n in (1, 2, 3, 16, 40)] == [16, 8, 5, 1, 1]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    deployment = LocalDeployment(tmp_path / "a", 2)
    assert deployment.env["OMP_NUM_THREADS"] == str(node_threads(2)) and deployment.node_threads == node_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert LocalDeployment(tmp_path / "b", 2).node_threads == 3


def test_a_warm_supernode_starts_flower_supernode_in_process_isolation_at_its_runtime_address(tmp_path):
    """deploy-local's SuperNodes run as `python -P -m fedsd.deployment.warm_supernode <flower-supernode
    options>` (their ClientApps forked warm); `--clientapps cold` is Flower's own command. The warm
    SuperExec connects to the SuperNode's Runtime API where the SuperNode serves it."""
    from fedsd.deployment import warm_supernode
    from fedsd.deployment.local_deployment import LocalDeployment

    key, ca = tmp_path / "key", tmp_path / "ca"
    deployment = LocalDeployment(tmp_path / "a", 1)
    assert deployment.warm_clientapps and not LocalDeployment(tmp_path / "b", 1, warm_clientapps=False).warm_clientapps
    warm = deployment._supernode_cmd(key, ca, "partition-id=0", None)
    deployment.warm_clientapps = False
    cold = deployment._supernode_cmd(key, ca, "partition-id=0", None)
    assert warm[:5] == [sys.executable, "-P", "-m", "fedsd.deployment.warm_supernode", "--pull-interval=0.5"]
    assert cold[0] == "flower-supernode"
    port = warm[warm.index("--port") + 1]
    assert warm[5:] == [port if a == cold[cold.index("--port") + 1] else a for a in cold[1:]]  # the same options
    options = warm[4:]
    assert warm_supernode.pull_interval(options) == 0.5 \
        and warm_supernode.runtime_address(options) == f"127.0.0.1:{port}"
    # read as flower-supernode reads them: its own parser, its defaults, its abbreviations
    assert warm_supernode.runtime_address(["--po=9095"]) == "127.0.0.1:9095"
    assert warm_supernode.runtime_address(["--host", "10.0.0.2", "--port", "9094"]) == "10.0.0.2:9094"
    assert warm_supernode.runtime_address(["--host", "::1", "--port", "9094"]) == "[::1]:9094"
    for option in (["--ssl-certfile=c.pem"], ["--ssl-cert", "c.pem"], ["--superexec-auth", "s"],
                   ["--allow-runtime"], ["--isolation=subprocess"]):
        # the warm launcher would leave it out (reviews playing the attacker found it silently dropped)
        with pytest.raises(SystemExit, match="is not taken here|is its own"):
            warm_supernode.runtime_address(["--port", "9094", *option])


def test_a_deployment_stops_a_process_that_ends_on_sigterm_without_waiting_out_the_kill():
    """LocalDeployment.stop: once the process and its group are gone, it returns. An exited leader
    not yet reaped is a zombie, still in its group: the group looked alive, and every stop waited
    its grace and the kill's 5 s (2.5 min for ten isolated owners)."""
    import time
    from fedsd.deployment.local_deployment import LocalDeployment

    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    started = time.monotonic()
    LocalDeployment.stop(proc, grace=60)
    assert proc.returncode == -15 and time.monotonic() - started < 30


def test_a_deployments_stop_also_stops_a_child_that_left_its_process_group(tmp_path):
    """Flower's SuperLink starts its SuperExec in a session of its own, so a stop of the
    SuperLink's process group left the SuperExec running until it noticed its parent gone: on a
    loaded machine after the stop had returned (two slow tests found it still running). A stop
    now takes the process's descendants before its signal and stops those that outlive the group."""
    import time
    from fedsd.deployment.local_deployment import LocalDeployment

    pidfile = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, time\n"
                               "c = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                               f"open({str(pidfile)!r} + '.new', 'w').write(str(c.pid))\n"
                               f"os.replace({str(pidfile)!r} + '.new', {str(pidfile)!r})\n"
                               "time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert os.getpgid(child) != parent.pid  # outside the group that a stop signals
    LocalDeployment.stop(parent, grace=5)
    assert parent.returncode == -15
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX"  # gone, or dead unreaped


def test_a_deployments_stop_also_stops_what_a_process_that_died_on_its_own_left(tmp_path):
    """A SuperLink that crashed leaves its SuperExec (in a session of its own) to init: no longer
    its descendant, so a stop that looks only then finds nothing. The deployment notes each process's
    descendants once everything is up, and its stop stops those that still run."""
    import time
    from fedsd.deployment.local_deployment import LocalDeployment

    pidfile = tmp_path / "child"
    deployment = LocalDeployment(tmp_path / "work", 1)
    parent = deployment._start("parent", [
        sys.executable, "-c", "import os, subprocess, sys, time\n"
        "c = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"open({str(pidfile)!r} + '.new', 'w').write(str(c.pid))\n"
        f"os.replace({str(pidfile)!r} + '.new', {str(pidfile)!r})\n"
        "time.sleep(600)"])
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    deployment.remember_children()  # as start() does once every node is online
    os.kill(parent.pid, 9)  # it dies on its own: its child goes to init
    parent.wait(timeout=30)
    stat = Path(f"/proc/{child}/stat")
    assert stat.exists()
    deployment.stop_all()
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX"


def test_a_warm_supernodes_pull_interval_is_checked_and_taken_off_flowers_options(tmp_path, capsys):
    """`--pull-interval S` (first) caps the SuperNode's wait after a pull that found no message
    (Flower's: 3 s); from 0.1 s to Flower's 3 s, refused otherwise before anything starts, and
    refused with Flower's own SuperNode (`--clientapps cold`)."""
    from fedsd.deployment import warm_supernode
    from fedsd.deployment.deployed_distributed import main as deployed

    for given, seconds, rest in ((["--pull-interval", "0.25", "--port", "9"], 0.25, ["--port", "9"]),
                                 (["--pull-interval=3"], 3.0, []), (["--port", "9"], None, ["--port", "9"])):
        assert warm_supernode.pull_interval(given) == seconds and given == rest
    for bad in (["--pull-interval=0.05"], ["--pull-interval", "4"], ["--pull-interval=nan"], ["--pull-interval"]):
        with pytest.raises(SystemExit, match="--pull-interval .*: seconds from 0.1 to 3"):
            warm_supernode.pull_interval(bad)
    proc = subprocess.run([sys.executable, "-P", "-m", "fedsd.deployment.warm_supernode", "--pull-interval=9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "seconds from 0.1 to 3" in proc.stderr, proc.stderr
    work, out = tmp_path / "w", tmp_path / "o"
    for options, needle in ((["--pull-interval", "0.01"], "invalid seconds from 0.1 to 3 value"),
                            (["--clientapps", "cold", "--pull-interval", "1"], "only with --clientapps warm")):
        with pytest.raises(SystemExit) as refused:
            deployed([*options, "--work", str(work), "--out", str(out)])
        assert refused.value.code == 2 and needle in capsys.readouterr().err
        assert not work.exists() and not out.exists()


def test_the_device_is_cuda_where_present_else_the_cpu_by_default():
    from fedsd.runtime import resolve_device
    from fedsd.settings.run import TrainConfig

    assert TrainConfig().device == "auto"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


# A process's first lines that make Flower, flwr-datasets and Ray unimportable (as where they are not installed).
NO_FLOWER = ("import importlib.abc, sys\n"
             "class NoFlower(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name.split('.')[0] in ('flwr', 'flwr_datasets', 'ray'):\n"
             "            raise ImportError(f'No module named {name!r}')\n"
             "sys.meta_path.insert(0, NoFlower())\n")


def test_central_training_needs_no_flower(tmp_path):
    """Someone reproducing the papers centrally may have no Flower or Ray installed: `fedsd train`
    builds its parser and checks its run without importing either (the federated commands are
    left out, as when Flower is missing)."""
    require("fmnist")
    block = (NO_FLOWER +
             "from fedsd.cli.main import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", block, "train", "--dataset", "fmnist", "--epsilon", "3",
                           "--epochs", "1", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, "FEDSD_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "dry run: every check passed" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_the_node_configs_reading_needs_no_flower():
    """`fedsd ledger` reads an owner's record folder with the node config's module and no Flower:
    the ClientApp's forwarding, whose service-node form that module shares, loads Flower only to send."""
    block = (NO_FLOWER +
             "from fedsd.app.client.node_config import parse, record_root_of\n")
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_deployed_distributed_refuses_an_out_it_can_neither_start_nor_resume_before_anything_starts(tmp_path, capsys):
    """An --out that holds something but no checkpoint (a run stopped before its first round
    ended: its owners were charged for the round they released, so a new run in the same --work
    would find their budgets short of its plan) or a finished run's is refused before anything
    starts, saying what to do; a new folder starts and one with a checkpoint resumes. Before, the
    deployment started, ten owners' services with it, and the ServerApp then refused the folder."""
    from fedsd.app.server import checkpoint
    from fedsd.deployment.deployed_distributed import main as deployed, out_refusal

    work, stale, finished = tmp_path / "w", tmp_path / "stale", tmp_path / "done"
    (stale / "tensorboard").mkdir(parents=True)
    finished.mkdir()
    (finished / "result.json").write_text("{}")
    for out, needle in ((stale, "no checkpoint to resume from"), (finished, "holds a finished run")):
        with pytest.raises(SystemExit) as refused:
            deployed(["--work", str(work), "--out", str(out)])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and needle in err and "new --work and --out" in err, err
        assert not work.exists()
    resumable = tmp_path / "resumable"
    (resumable / "tensorboard").mkdir(parents=True)
    checkpoint.path_in(resumable).write_bytes(b"")
    assert out_refusal(tmp_path / "new", work) is None and out_refusal(resumable, work) is None
    # an --out still empty (no TensorBoard installed) while an owner was already charged for round 1
    from fedsd.privacy.lifetime_ledger import ledger_path, opened

    state = work / "deployment" / "nodes" / "3" / "state"
    state.mkdir(parents=True)
    with opened(state, "0", 3.0, 1e-5):
        pass  # an owner's ledger, opened and saved with nothing admitted
    assert out_refusal(tmp_path / "new", work) is None
    with opened(state, "0", 3.0, 1e-5) as ledger:
        ledger.spend(4.2, 0.14, 1)
    assert "no checkpoint to resume from" in out_refusal(tmp_path / "new", work)
    assert out_refusal(resumable, work) is None
    ledger_path(state, "0").write_text("{")  # a ledger that cannot be read is no proof that nobody was charged
    assert "no checkpoint to resume from" in out_refusal(tmp_path / "new", work)


def test_a_deployments_stop_signals_every_process_before_it_waits_for_any():
    """LocalDeployment.stop_all: twenty processes that take their grace to end on SIGTERM end
    within about one grace, where one after another took twenty (a hundred clients' stop took
    minutes)."""
    import time
    from fedsd.deployment.local_deployment import LocalDeployment

    slow = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(0))); " \
           "print(flush=True); time.sleep(600)"
    deployment = LocalDeployment.__new__(LocalDeployment)
    deployment._all = [subprocess.Popen([sys.executable, "-c", slow], stdout=subprocess.PIPE, start_new_session=True)
                       for _ in range(20)]
    deployment._children, deployment.isolation, deployment.shared_pages = {}, None, None
    for proc in deployment._all:
        proc.stdout.readline()  # its handler is set
    began = time.monotonic()
    deployment.stop_all()
    assert all(proc.returncode == 0 for proc in deployment._all)  # each ended on its own, within its grace
    assert time.monotonic() - began < 10


def test_a_warm_supernode_preloads_the_training_libraries_only_where_its_tasks_train():
    """A node without an owner's service trains in its tasks: its warm process imports torch,
    torchvision and opacus once, where each task imported them (about 5 s of CPU a task); a
    node whose tasks forward to the owner's service (--isolate) keeps a warm process of Flower
    alone."""
    from fedsd.deployment.warm_supernode import TRAINING_LIBRARIES, preloads

    assert TRAINING_LIBRARIES == ("torch", "torchvision", "opacus")
    assert preloads(["--superlink", "x:1", "--node-config", "partition-id=0 num-partitions=2"]) == TRAINING_LIBRARIES
    assert preloads(["--node-config=partition-id=0 num-partitions=2"]) == TRAINING_LIBRARIES
    assert preloads(["--node-config", "partition-id=0 num-partitions=2 service='/run/owner.sock'"]) == ()
    assert preloads(["--node-conf", "service='/run/owner.sock'"]) == ()  # read as flower-supernode reads it
