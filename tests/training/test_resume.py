"""`fedsd train --resume DIR`: a central run stopped at any moment (an exception, Ctrl-C,
SIGKILL) goes on from its last completed epoch with its own saved settings, and ends with the
weights of a run that was never stopped, bit for bit (same thread count)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedsd.training import central
from fedsd.settings.run import TrainConfig
from fedsd.training.loop import DPTrainer
from fedsd.cli.main import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--dataset", "fmnist", "--epsilon", "3", "--subset", "1000", "--batch-size", "100", "--lr", "1",
        "--threads", "1", "--quiet"]


# a run whose features were normalised by released statistics: the same noise on resuming (the
# run's seed's), and its two releases kept at the head of the accountant's history
PRIVATE_NORM = "dpsgd on privately normalised features"


def config(method: str) -> TrainConfig:
    if method == PRIVATE_NORM:
        return TrainConfig(dataset="fmnist", method="dpsgd", features="scatter", feature_norm="private", epsilon=3,
                           subset=1000, batch_size=100, lr=4.0, epochs=4, threads=1)
    return TrainConfig(dataset="fmnist", method=method, epsilon=3, subset=1000, batch_size=100, lr=1.0, epochs=4,
                       threads=1, distill_warmup_epochs=1)


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("method", ["dpema", "dpkd", "dp3sd", PRIVATE_NORM])  # EMA, DPKD's two stages, a teacher
def test_a_run_stopped_after_an_epoch_resumes_to_the_same_weights(method, tmp_path, monkeypatch):
    require("fmnist")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    uninterrupted, _ = central.train(config(method), whole, progress=False)
    real = DPTrainer.local_update

    def stop_in_epoch_3(self, model, state, epochs, **kw):
        if epochs == [3]:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of epoch 3
        return real(self, model, state, epochs, **kw)
    monkeypatch.setattr(DPTrainer, "local_update", stop_in_epoch_3)
    with pytest.raises(KeyboardInterrupt):
        central.train(config(method), stopped, progress=False)
    note = json.loads((stopped / central.PROGRESS).read_text())
    assert note["finished"] is False and note["epochs_done"] == 2 and note["epochs"] == 4
    assert note["resume_with"] == f"fedsd train --resume {stopped}"
    assert not (stopped / "result.json").exists() and not (stopped / "model.pt").exists()
    monkeypatch.setattr(DPTrainer, "local_update", real)
    resumed, _ = central.train(None, stopped, resume=True, progress=False)
    assert same_weights(whole, stopped)
    assert sorted(p.name for p in stopped.iterdir()) == ["curve.png", "model.pt", "result.json", "tensorboard"]
    assert resumed["resumed"] is True and resumed["steps"] == uninterrupted["steps"]
    strip = lambda epochs: [{k: v for k, v in e.items() if k != "seconds"} for e in epochs]  # noqa: E731
    assert strip(resumed["epochs"]) == strip(uninterrupted["epochs"])
    assert resumed.get("feature_statistics") == uninterrupted.get("feature_statistics")


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_to_the_same_weights(tmp_path):
    """SIGKILL at a random moment of epoch 2 or later, through the command line."""
    require("fmnist")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    command = [sys.executable, "-m", "fedsd.cli.main", "train", "--method", "dp3sd", "--epochs", "6", *ARGS]
    subprocess.run([*command, "--out", str(whole)], check=True, timeout=600, cwd=ROOT)
    proc = subprocess.Popen([*command, "--out", str(killed)], cwd=ROOT, start_new_session=True)
    progress = killed / central.PROGRESS
    deadline = time.monotonic() + 300
    while not (progress.exists() and json.loads(progress.read_text())["epochs_done"] >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.05)
    time.sleep(0.3)  # somewhere inside the next epoch
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert central.unfinished(killed)
    done = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "train", "--resume", str(killed), "--quiet"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert same_weights(whole, killed)
    assert not central.unfinished(killed) and not (killed / central.CHECKPOINT).exists()


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    require("fmnist")
    finished = tmp_path / "finished"
    assert main(["train", "--method", "dpsgd", "--epochs", "1", *ARGS, "--out", str(finished)]) == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    torch.save({"format": 99}, foreign / central.CHECKPOINT)
    (tmp_path / "empty").mkdir()
    cases = [(["--resume", str(finished)], "is a finished run (it has result.json); nothing to resume"),
             (["--resume", str(tmp_path / "empty")], "holds no unfinished run (no checkpoint.pt)"),
             (["--resume", str(tmp_path / "missing")], "is not a folder"),
             (["--resume", str(foreign)], "is of format 99; this version of fedsd continues format 1 only"),
             (["--resume", str(foreign), "--epsilon", "2"], "with that run's own saved settings and folder; "
                                                            "leave out --epsilon"),
             (["--dataset", "fmnist"], "required: --epsilon, --out (or --resume DIR)")]
    for args, needle in cases:
        capsys.readouterr()
        assert main(["train", *args]) == 2, args
        assert needle in capsys.readouterr().err, args
    assert sorted(p.name for p in finished.iterdir()) == ["curve.png", "model.pt", "result.json",
                                                          "tensorboard"]  # untouched
