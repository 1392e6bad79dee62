"""`fedsd reproduce`: cells, resume, and the table files (tiny runs: the harness, not the numbers)."""
import json

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
