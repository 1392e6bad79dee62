"""A newcomer's second hour (issue 44): what a user types is taken as typed or refused saying
why, a dry run checks what the real run would and writes nothing, and a run's result is easy
to see and to use."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simulations.cli import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[1]


def fedsd(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "simulations.cli", *args], capture_output=True, text=True,
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
    """mnist (one grey channel) on cifar-cnn (three): refused by the dry run, as by the run, before any data or Ray."""
    require("mnist")
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    assert main([*command, "--epsilon", "3", "--dataset", "mnist", "--model", "cifar-cnn", "--out",
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
    assert "is a finished run (it has result.json); nothing to resume" in capsys.readouterr().err


@pytest.mark.slow
def test_version():
    from fedsd import __version__

    proc = fedsd("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"fedsd {__version__}"


@pytest.mark.slow
def test_load_model_gives_what_the_run_released_ready_to_use(tmp_path, capsys):
    """fedsd.load_model: the network with the run's weights and normalisation, on raw images."""
    require("mnist")
    import fedsd
    from fedsd import data as data_lib

    out = tmp_path / "run"
    assert main(["train", "--dataset", "mnist", "--method", "dpsgd", "--subset", "2000", "--epochs", "2",
                 "--batch-size", "200", "--lr", "2", "--epsilon", "3", "--threads", "1", "--quiet",
                 "--out", str(out)]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[3].startswith("  settings       B = 200, lr 2, momentum 0.9, σ = ") and summary[3].endswith(", 2 epochs")
    model = fedsd.load_model(out)
    images = data_lib.load("mnist")
    with torch.no_grad():
        accuracy = (model(images.x_test).argmax(1) == images.y_test).float().mean().item()
    assert accuracy == pytest.approx(json.loads((out / "result.json").read_text())["test_accuracy"], abs=1e-3)
    assert not model.training
