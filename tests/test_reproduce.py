"""`fedsd reproduce`: cells, resume, and the table files (tiny runs: the harness, not the numbers)."""
import json

import pytest

from simulations.cli import main
from simulations.reproduce import PAPER_TABLE1, table1_cells, table2_cells
from tests.conftest import require


def test_cells_cover_the_table():
    cells = table1_cells(["mnist", "fmnist", "cifar10"], ["dpsgd", "dpkd", "dpema", "dp3sd", "dpdsd"], [1, 2, 3])
    assert len(cells) == 45 and len({c.name for c in cells}) == 45
    assert {c.paper for c in cells if c.dataset == "fmnist" and c.epsilon == 3 and c.method == "dp3sd"} == {87.68}
    assert len(PAPER_TABLE1) == 15
    ablation = table2_cells()
    assert [c.overrides for c in ablation if c.method == "dp3sd"] == [{}, {"tau_s": 1.0}, {"tau_t": 1.0},
                                                                      {"tau_s": 1.0, "tau_t": 1.0}]


@pytest.mark.slow
def test_reproduce_runs_resumes_and_writes_tables(tmp_path):
    require("mnist")
    args = ["reproduce", "--table", "1", "--datasets", "mnist", "--methods", "dpsgd", "dp3sd", "--epsilons", "3",
            "--seeds", "2", "--epochs", "2", "--subset", "2500", "--jobs", "2", "--out", str(tmp_path), "--quiet"]
    assert main(args) == 0
    table = json.loads((tmp_path / "table1.json").read_text())
    assert [(c["method"], len(c["accuracies"])) for c in table["cells"]] == [("dpsgd", 2), ("dp3sd", 2)]
    assert all(0 < a <= 100 for c in table["cells"] for a in c["accuracies"])
    md = (tmp_path / "table1.md").read_text()
    assert "| mnist | dp3sd | 3 |" in md and "98.42" in md
    assert (tmp_path / "fig3-mnist.png").exists()
    stamp = (tmp_path / "runs" / "table1" / "mnist-dpsgd-eps3-seed0" / "result.json").stat().st_mtime_ns
    assert main(args) == 0  # resumes: nothing is run again
    assert (tmp_path / "runs" / "table1" / "mnist-dpsgd-eps3-seed0" / "result.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_sweep_chooses_on_validation_only(tmp_path, capsys):
    require("mnist")
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "mnist", "--method", "dpema", "--grid", "ema-decay=0.5,0.9", "--validation", "2000",
            "--subset", "1200", "--epochs", "1", "--out", str(out), "--quiet"]
    assert main(args) == 0
    summary = json.loads((out / "sweep.json").read_text())
    runs = summary["runs"]
    assert [r["settings"] for r in runs] == [{"ema_decay": 0.5}, {"ema_decay": 0.9}]
    best = max(runs, key=lambda r: r["validation_mean"])
    assert summary["choice"] == {"settings": best["settings"], "validation_accuracy": best["validation_mean"]}
    for r in runs:
        run = out / "runs" / f"emadecay{r['settings']['ema_decay']:g}-seed0"
        result = json.loads((run / "result.json").read_text())
        assert result["config"]["validation"] == 2000 and result["num_train"] == 1200
        assert 10 < r["validation_accuracy"][0] <= 100
    assert "chosen" in (out / "sweep.md").read_text()
    bad = ["sweep", "--dataset", "mnist", "--method", "dpema", "--grid", "color=1,2", "--out", str(tmp_path / "x")]
    assert main(bad) == 2
    assert "cannot be swept" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_setting_added_later_does_not_make_a_finished_run_stale(tmp_path):
    """A run made before a setting existed ran as that setting's default: it is not run again."""
    from fedsd.config import TrainConfig
    from simulations.reproduce import finished_with

    config = dict(dataset="mnist", method="dpsgd", epsilon=3.0, seed=0)
    saved = TrainConfig(**config).resolved().to_dict()
    del saved["classes"]  # as in a result.json written before custom tasks existed
    (tmp_path / "result.json").write_text(json.dumps({"config": saved}))
    assert finished_with(tmp_path, config)
    assert not finished_with(tmp_path, {**config, "epsilon": 2.0})  # a real change still counts
