"""The Flower app on the simulation engine (Ray): single-client identity, per-client privacy
across rounds, budget exhaustion, learning, bad input, and `flwr run .`."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedsd.training.central import train
from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig
from fedsd.cli.main import main
from fedsd.simulation.engine import simulate
from tests.conftest import require

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("method,release", [("dp3sd", None), ("dpdsd", None), ("dpema", None), ("dpdsd", "ema")])
def test_single_client_reproduces_central_training(method, release):
    """--clients 1 --rounds K --local-epochs 1 gives the weights of `fedsd train --epochs K`."""
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method=method, release=release, epsilon=3, batch_size=200, subset=2000,
                      seed=5, threads=1, ema_decay=0.9 if "ema" in (method[2:], release) else None)
    fed, fed_weights = simulate(cfg, FedConfig(num_clients=1, rounds=3, local_epochs=1), progress=False)
    central, weights = train(dataclasses.replace(cfg, epochs=3), progress=False)
    diff = max((fed_weights[k] - weights[k]).abs().max().item() for k in weights)
    assert diff <= 1e-6
    assert [r["test_accuracy"] for r in fed["rounds"]] == [e["test_accuracy"] for e in central["epochs"]]
    assert fed["rounds"][-1]["client_epsilon"]["0"] == pytest.approx(central["epsilon_spent"], rel=1e-12)


def test_three_clients_learn_and_account_per_client(tmp_path):
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", epsilon=3, batch_size=256, lr=3.0, subset=12000, seed=0)
    result, _ = simulate(cfg, FedConfig(num_clients=3, rounds=3, local_epochs=1, federated_evaluation=True),
                      out=tmp_path / "run", progress=False)
    assert result["test_accuracy"] >= 0.6
    for r in result["rounds"]:  # the clients' shares of the test split, weighted, are the whole split
        federated = r["federated_evaluation"]
        assert federated["num_examples"] == 10000 and sorted(federated["clients"]) == ["0", "1", "2"]
        assert federated["test_accuracy"] == pytest.approx(r["test_accuracy"], abs=1e-12)
    assert result["shard_sizes"] == [4000, 4000, 4000]
    for client in ("0", "1", "2"):
        eps = [r["client_epsilon"][client] for r in result["rounds"]]
        assert all(a < b for a, b in zip(eps, eps[1:])), eps  # one accountant, growing every round
        assert 0.9 * 3 <= eps[-1] <= 3.0
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [r["round"] for r in written["rounds"]] == [1, 2, 3]
    assert (tmp_path / "run" / "model.pt").exists() and (tmp_path / "run" / "curve.png").exists()


def test_a_simulation_with_validation_scores_every_round_on_the_held_out_split():
    """--validation holds samples out of every shard, and the server scores each round's global
    model on them too (to choose settings without the test split): the number is the held-out
    split's accuracy of the released weights."""
    require("fmnist")
    from fedsd.data import datasets as data_lib
    from fedsd.training.loop import evaluate
    from fedsd.models.networks import build_model

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=256, lr=3.0, subset=4000,
                      validation=2000, seed=0, threads=1)
    result, weights = simulate(cfg, FedConfig(num_clients=2, rounds=2), progress=False)
    assert sum(result["shard_sizes"]) == 4000
    images = data_lib.load("fmnist", None)
    held_out = data_lib.validation_indices(images, 2000)
    assert not set(held_out.tolist()) & set(data_lib.training_indices(images, 4000, 0, 2000).tolist())
    net = build_model("mnist-cnn", 10)
    net.load_state_dict(weights)
    accuracy, _ = evaluate(net, images.normalised(images.x_train[held_out]), images.y_train[held_out])
    assert result["rounds"][-1]["validation_accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert result["validation_accuracy"] == result["rounds"][-1]["validation_accuracy"] >= 0.5
    assert all(r["validation_accuracy"] is not None for r in result["rounds"])


def test_client_over_budget_is_skipped_not_crashed():
    """Clients calibrated for 2 rounds are asked for 3: round 3 is refused by every client,
    the server logs it and finishes, and the model stays that of round 2."""
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=2, batch_size=100, subset=1000, seed=0)
    result, _ = simulate(cfg, FedConfig(num_clients=2, rounds=3, budget_rounds=2), progress=False)
    r1, r2, r3 = result["rounds"]
    assert r1["trained"] == [0, 1] and r2["trained"] == [0, 1]
    assert r3["trained"] == [] and r3["skipped"] == [0, 1]
    assert r3["client_epsilon"] == r2["client_epsilon"]
    assert all(0.9 * 2 <= e <= 2.0 for e in r3["client_epsilon"].values())
    assert r3["test_accuracy"] == r2["test_accuracy"]


@pytest.mark.parametrize("args,needle", [
    (["--clients", "0"], "--clients"),
    (["--clients", "5000"], "--clients"),
    (["--rounds", "0"], "--rounds"),
    (["--fraction-train", "0"], "--fraction-train"),
    (["--fraction-train", "1.5"], "--fraction-train"),
    (["--partition", "dirichlet", "--dirichlet-alpha", "0"], "--dirichlet-alpha"),
    (["--clients", "20", "--batch-size", "200"], "client 0's shard has 150 samples"),
])
def test_bad_simulation_input_fails_before_ray(tmp_path, capsys, args, needle):
    require("fmnist")
    out = tmp_path / "out"
    code = main(["simulate", "--dataset", "fmnist", "--subset", "3000", "--batch-size", "100", *args,
                 "--out", str(out), "--quiet"])
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not out.exists()


def test_unknown_strategy_or_partition_is_refused(capsys):
    for flag, value in (("--strategy", "fedfoo"), ("--partition", "bycity")):
        with pytest.raises(SystemExit):
            main(["simulate", flag, value, "--out", "x"])
        assert flag in capsys.readouterr().err


def test_server_side_dp_adds_the_noise_it_promises():
    """Flower's server-side fixed clipping on top: clipped client updates averaged, plus
    N(0, (z·c/n)²) per coordinate. With z = 0.5, c = 1, n = 2 that noise (std 0.25) dwarfs the
    clipped updates, so the global model's change from its start shows it."""
    require("fmnist")
    from fedsd.training.loop import initial_model

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=100, subset=1000, seed=0)
    result, weights = simulate(cfg, FedConfig(num_clients=2, rounds=1, server_dp_noise=0.5, server_dp_clip=1.0),
                           progress=False)
    start = initial_model(TrainConfig(**{**cfg.__dict__, "epochs": 1}).resolved(), 10)["student"]
    change = torch.cat([(weights[k] - start[k]).flatten() for k in start])
    assert change.std().item() == pytest.approx(0.25, rel=0.05)


@pytest.mark.parametrize("strategy", ["fedadam", "fedprox"])
def test_other_strategies_learn(strategy):
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dp3sd", epsilon=3, batch_size=100, lr=0.8, subset=2000, seed=0)
    result, _ = simulate(cfg, FedConfig(num_clients=2, rounds=3, strategy=strategy, server_lr=0.05, proximal_mu=0.1),
                      progress=False)
    accuracies = [r["test_accuracy"] for r in result["rounds"]]
    # 3 short rounds of 10 noisy steps: learning shows as a rise every round, well above chance (0.1).
    assert all(a < b for a, b in zip(accuracies, accuracies[1:])) and accuracies[-1] > 0.22, accuracies


def test_simulate_killed_after_a_round_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """`fedsd simulate` SIGKILLed once round 1 is checkpointed; `--resume DIR` goes on from
    there, with the folder moved and another cache (another machine). Rounds already done are
    kept as they were, and every client's accountant goes on from its state in the run's folder:
    at the end each has spent its whole plan (about ε = 3), where a fresh accountant would show
    the ε of the remaining rounds only."""
    require("fmnist")
    monkeypatch.delenv("FEDSD_CLIENT_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "first-machine"))
    out = tmp_path / "run"
    proc = subprocess.Popen([str(Path(os.sys.executable).parent / "fedsd"), "simulate", "--dataset", "fmnist",
                             "--subset", "2000", "--batch-size", "100", "--clients", "2", "--rounds", "3",
                             "--threads", "1", "--quiet", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoint.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sorted(p.name for p in (out / "client-state").rglob("client-?.pt")) == ["client-0.pt", "client-1.pt"]
    moved = tmp_path / "elsewhere" / "run"
    moved.parent.mkdir()
    shutil.move(out, moved)
    out = moved
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "second-machine"))
    before = torch.load(out / "checkpoint.pt", weights_only=True)
    assert not (out / "result.json").exists()
    assert main(["simulate", "--resume", str(out), "--quiet"]) == 0
    assert not (out / "client-state").exists()  # a finished run's clients' ε is in result.json
    result = json.loads((out / "result.json").read_text())
    assert result["resumed_after_round"] == before["round"] and [r["round"] for r in result["rounds"]] == [1, 2, 3]
    assert result["rounds"][:before["round"]] == before["book"]["rounds"]
    assert all(r["trained"] == [0, 1] for r in result["rounds"])  # no round charged twice, none sat out
    for pid, eps in result["rounds"][-1]["client_epsilon"].items():
        assert 2.9 < eps <= 3.0, (pid, eps)
    assert main(["simulate", "--resume", str(tmp_path / "nowhere"), "--quiet"]) == 2


@pytest.mark.skipif(shutil.which("flwr", path=str(Path(os.sys.executable).parent)) is None, reason="no flwr CLI")
def test_readme_flwr_run_command_runs_as_written(flower_env):
    """The README's `flwr run .` line, exactly as written, ends with every round done."""
    require("fmnist")
    import shlex

    line = next(s for s in (ROOT / "README.md").read_text().splitlines()
                if s.startswith("flwr run . ") and "--stream" in s)
    proc = subprocess.run(shlex.split(line), cwd=ROOT, env=flower_env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Exit Code" not in output, output[-3000:]
    assert "fedsd round 3/3: test accuracy" in output, output[-3000:]


@pytest.mark.skipif(shutil.which("flwr", path=str(Path(os.sys.executable).parent)) is None, reason="no flwr CLI")
def test_flwr_run_with_too_few_supernodes_stops_with_both_numbers(tmp_path, flower_env):
    """Flower's default local federation has 2 SuperNodes; a run config asks for 10. The run
    stops within seconds and says how to fix either number, instead of waiting forever."""
    require("fmnist")
    started = time.monotonic()
    proc = subprocess.run(["flwr", "run", ".", "--stream", "--run-config",
                           "num-server-rounds=1 batch-size=256 num-clients=10"],
                          cwd=ROOT, env=flower_env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert "the federation has 2 SuperNode(s) connected but the run has num-clients=10" in output, output[-3000:]
    assert 'num-supernodes=10' in output and 'num-clients=2' in output
    assert time.monotonic() - started < 180


@pytest.mark.skipif(shutil.which("flwr", path=str(Path(os.sys.executable).parent)) is None, reason="no flwr CLI")
def test_plain_flwr_run_finishes_on_a_fresh_flower_home_and_says_where_its_result_is(tmp_path, flower_env):
    """`flwr run .` with nothing after it: Flower's default federation (2 SuperNodes) and the
    app's defaults (num-clients=0: one client per SuperNode; 5 rounds of the whole FMNIST) finish,
    and the run's log ends with fedsd's summary, which names the result folder."""
    require("fmnist")
    flwr = lambda *args: subprocess.run(["flwr", *args], cwd=tmp_path, env=flower_env, capture_output=True,  # noqa: E731
                                        text=True, timeout=120)
    started = flwr("run", str(ROOT))
    assert started.returncode == 0 and "Successfully started run" in started.stdout, started.stdout + started.stderr
    run_id = started.stdout.split("Successfully started run ")[1].split()[0]
    deadline = time.monotonic() + 840
    while True:
        status = json.loads(flwr("ls", "--format", "json").stdout)["runs"][0]["status"]
        if status.startswith("finished") or time.monotonic() > deadline:
            break
        time.sleep(5)
    log = flwr("log", run_id, "--show").stdout
    assert status == "finished:completed", log[-3000:]
    assert "FutureWarning" not in log and log.count("'dataset': fmnist") == 0  # no Ray notice, no 60-key config
    assert "fedsd: 2 clients, one per SuperNode of the federation (num-clients=0)" in log
    folder = Path(log.split("files          ")[1].split("/ (result.json")[0])
    result = json.loads((folder / "result.json").read_text())
    assert folder.is_absolute() and result["num_clients"] == 2 and len(result["rounds"]) == 5
    assert result["test_accuracy"] > 0.6


def test_simulate_prints_a_bar_and_a_summary_and_no_library_noise(tmp_path):
    """The terminal of a default run: no Flower line twice, no notice that is not news to the
    user (deprecations of the API fedsd calls, Opacus' order warning), and a short summary."""
    require("fmnist")
    proc = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "simulate", "--dataset", "fmnist", "--subset", "600",
                           "--clients", "2", "--rounds", "1", "--batch-size", "100", "--epsilon", "3",
                           "--out", str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for noise in ("DEPRECATED", "Optimal order", "warnings.warn", "INFO", "WARNING", "ClientAppActor"):
        assert noise not in output, output[-3000:]
    assert "fmnist dp3sd 2 clients: 100%" in proc.stderr
    summary = proc.stdout.splitlines()
    assert summary[0].startswith("fedsd: fmnist dp3sd, 2 clients finished, ") and len(summary) == 5
    assert "test accuracy" in summary[1] and "across the 2 clients that trained (target 3" in summary[2]
    assert summary[3].startswith("  settings       B = 100, lr 0.1875, momentum 0.9, σ = ") and \
        summary[3].endswith(", 1 rounds × 1 local epoch(s)")
    # Its TensorBoard log: the round's accuracy and each client's ε, as result.json has them.
    from tests.conftest import read_tensorboard

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    scalars, hparams = read_tensorboard(tmp_path / "run" / "tensorboard")
    assert scalars["test/accuracy"] == [(1, pytest.approx(result["rounds"][0]["test_accuracy"], rel=1e-6))]
    for client, epsilon in result["rounds"][0]["client_epsilon"].items():
        assert scalars[f"privacy/epsilon_client/{client}"] == [(1, pytest.approx(epsilon, rel=1e-6))]
    assert hparams["num-clients"] == 2 and hparams["method"] == "dp3sd"
