"""result.json has one type, fedsd.files.results.RunResult, that writes it and reads it back: every
run kept under results/, written by any version of fedsd, still reads, with settings this
version can use."""
import json
from pathlib import Path

import pytest
import torch

from fedsd.settings.run import TrainConfig
from fedsd.errors import DataError
from fedsd.settings.federation import FedConfig
from fedsd.files.results import RESULT_FORMAT, RunResult

RESULTS = Path(__file__).resolve().parents[2] / "results"
RUNS = sorted(RESULTS.glob("**/result.json"))


def test_there_are_runs_to_read():
    assert len(RUNS) >= 100


@pytest.mark.parametrize("path", RUNS, ids=[str(p.parent.relative_to(RESULTS)) for p in RUNS])
def test_every_kept_run_reads(path):
    written = json.loads(path.read_text())
    result = RunResult.read(path)
    assert result.test_accuracy == written["test_accuracy"] and result.dataset == written["dataset"]
    assert result.federated == ("rounds" in written) and len(result.curve) >= 1
    cfg = TrainConfig.from_dict(result.config).resolved()  # an old run's settings, in this version's type
    assert (cfg.method, cfg.epsilon) == (result.method, result.epsilon_target)
    if result.federated:
        assert FedConfig.from_dict(result.federation).num_clients == result.num_clients
    # written back the same (a null and an absent key mean the same: the writer leaves nulls out)
    same = lambda d: {k: v for k, v in d.items() if k != "format" and v is not None}  # noqa: E731
    assert same(result.to_dict()) == same(written)


def test_every_kept_central_run_is_finished_or_says_it_is_not():
    """The run folder's contract (fedsd.training.central): a finished central run has result.json and
    model.pt and no resume state; an unfinished one has its checkpoint and a progress.json that
    says so. (A federated run keeps its checkpoint.pt when finished: `fedsd simulate --resume`.)"""
    central = [p.parent for p in RESULTS.glob("**/progress.json")] + [p.parent for p in RUNS]
    for run in sorted(set(central)):
        if (run / "result.json").exists() and not RunResult.read(run / "result.json").federated:
            assert (run / "model.pt").exists() and not (run / "progress.json").exists(), run
            assert not (run / "checkpoint.pt").exists(), run
        elif (run / "progress.json").exists():
            assert json.loads((run / "progress.json").read_text())["finished"] is False, run
            assert (run / "checkpoint.pt").exists() and not (run / "result.json").exists(), run


def test_a_result_round_trips_and_a_newer_or_foreign_file_is_refused(tmp_path):
    result = RunResult(dataset="fmnist", method="dpsgd", epsilon_target=3.0, epsilon_spent=2.99, delta=1e-5,
                       test_accuracy=0.8, seed=0, wall_seconds=1.0, device="cpu", data_source="x", config={"lr": 3.0},
                       epochs=[{"epoch": 1, "test_accuracy": 0.8}], extra={"note": "kept"})
    result.write(tmp_path / "result.json")
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["format"] == RESULT_FORMAT and saved["note"] == "kept" and "rounds" not in saved
    assert RunResult.read(tmp_path / "result.json") == result
    (tmp_path / "newer.json").write_text(json.dumps({**saved, "format": RESULT_FORMAT + 1}))
    with pytest.raises(DataError, match="result format"):
        RunResult.read(tmp_path / "newer.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"accuracy": 0.9}))
    with pytest.raises(DataError, match="not a readable fedsd result"):
        RunResult.read(tmp_path / "foreign.json")


def test_a_result_names_its_gpu_and_a_cpu_run_names_none(tmp_path):
    """device_name: the card a run went to (torch.cuda.get_device_name), absent for the CPU and from
    results written before it was recorded."""
    from fedsd.files.results import gpu_name

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3).resolved()
    cpu = RunResult.of_run(cfg, epsilon_spent=3.0, test_accuracy=0.8, wall_seconds=1.0, device="cpu", data_source="x")
    cpu.write(tmp_path / "result.json")
    assert gpu_name("cpu") is None and "device_name" not in json.loads((tmp_path / "result.json").read_text())
    if torch.cuda.is_available():
        gpu = RunResult.of_run(cfg, epsilon_spent=3.0, test_accuracy=0.8, wall_seconds=1.0, device="cuda:0",
                               data_source="x")
        assert gpu.device_name == torch.cuda.get_device_name(0)
    else:
        assert gpu_name("cuda:0") is None  # a run that says cuda where there is none names no card


def test_settings_saved_before_a_setting_was_removed_still_load():
    old = {**TrainConfig().to_dict(), "a_setting_since_removed": 1}
    assert TrainConfig.from_dict(old) == TrainConfig()
    assert FedConfig.from_dict({**FedConfig().__dict__, "gone": True}) == FedConfig()
