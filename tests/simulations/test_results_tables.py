"""The Table 1 files under results/ say what the kept runs say: table1.{json,md} are the ones
`fedsd reproduce` writes from results/runs/table1, results/README.md shows the same cells, and
the table holds every cell of the papers with the seeds the table promises."""
import json

import pytest
from pathlib import Path

from simulations.paper_tables import DATASETS, TABLE1_METHODS, table1_cells, table_cells, write_tables

RESULTS = Path(__file__).resolve().parents[2] / "results"


def _markdown_tables(text: str) -> list[str]:
    """Each Markdown table in `text`, its lines joined."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


def test_the_kept_table1_is_the_one_its_runs_give(tmp_path):
    """A run added or replaced without rewriting the table (or a table edited by hand) fails here."""
    runs = RESULTS / "runs" / "table1"
    write_tables(1, table_cells(1, [], runs), runs, tmp_path)
    assert json.loads((tmp_path / "table1.json").read_text()) == json.loads((RESULTS / "table1.json").read_text())
    assert (tmp_path / "table1.md").read_text() == (RESULTS / "table1.md").read_text()


def test_the_readme_shows_table1_as_the_runs_give_it():
    by_data_set = (RESULTS / "table1.md").read_text().split("## By data set, as in the papers")[1]
    expected = _markdown_tables(by_data_set)
    assert len(expected) == 5  # MNIST, FMNIST, CIFAR-10, the gains over dpsgd, the second protocol
    shown = _markdown_tables((RESULTS / "README.md").read_text())
    for table in expected:
        assert table in shown, f"results/README.md lacks, or shows other numbers in:\n{table}"


def test_table1_has_every_cell_of_the_papers_with_the_seeds_asked_for():
    """All 45 cells; three seeds in every ε = 3 cell and in every MNIST
    and Fashion-MNIST cell (CIFAR-10 at ε = 1 and 2: seed 0)."""
    rows = {(r["dataset"], r["method"], r["epsilon"]): r
            for r in json.loads((RESULTS / "table1.json").read_text())["cells"] if not r["variant"]}
    papers = {(c.dataset, c.method, c.epsilon) for c in table1_cells(DATASETS, TABLE1_METHODS, [1.0, 2.0, 3.0])}
    assert len(papers) == 45 and set(rows) == papers
    for (dataset, method, epsilon), row in rows.items():
        asked = {0, 1, 2} if epsilon == 3.0 or dataset != "cifar10" else {0}
        assert asked <= set(row["seeds"]), (dataset, method, epsilon, row["seeds"])
        assert len(row["accuracies"]) == len(row["seeds"]) and all(0 < a < 100 for a in row["accuracies"])


def test_readings_table_gives_each_method_its_own_length_and_its_gain_over_dpsgd(tmp_path):
    """The screen's table: a method's best over the lengths run, against dpsgd's best in the same
    setting; a gain is final only once both have every length."""
    from fedsd.settings.run import TrainConfig
    from fedsd.files.results import RunResult
    from simulations.readings import READINGS, ScreenRun, write_readings

    papers = READINGS[0]
    runs = [ScreenRun("mnist", "relu", 1.0, m, papers, n) for m in ("dpsgd", "dpdsd") for n in (15, 30, 60)]
    scores = {("dpsgd", 15): 0.90, ("dpsgd", 30): 0.94, ("dpsgd", 60): 0.92, ("dpdsd", 15): 0.955, ("dpdsd", 30): 0.96}
    for run in runs:
        if (run.method, run.epochs) in scores:
            cfg = TrainConfig(dataset="mnist", method=run.method, epsilon=1.0, epochs=run.epochs).resolved()
            (tmp_path / "runs" / run.name).mkdir(parents=True)
            RunResult.of_run(cfg, epsilon_spent=1.0, test_accuracy=0.9, wall_seconds=1.0, device="cpu",
                             data_source="test", validation_accuracy=scores[(run.method, run.epochs)]
                             ).write(tmp_path / "runs" / run.name / "result.json")
    write_readings(runs, tmp_path / "runs", tmp_path)
    rows = {r["method"]: r for r in json.loads((tmp_path / "table-readings.json").read_text())["screen"]}
    assert rows["dpsgd"]["chosen_epochs"] == 30 and rows["dpsgd"]["best"] == pytest.approx(94.0)
    assert rows["dpdsd"]["gain_over_dpsgd"] == pytest.approx(2.0) and rows["dpdsd"]["gain_final"] is False
    assert "| mnist | 1 | dpdsd | papers | 95.50 | 96.00 |  |  | 96.00 | +2.00* |" \
        in (tmp_path / "table-readings.md").read_text()


def test_a_reading_more_than_a_point_below_its_methods_papers_reading_in_two_settings_is_dropped():
    from simulations.readings import dropped

    def row(best, complete=True):
        return dict(best=best, chosen_epochs=30 if complete else None)

    rows = {("mnist", "relu", 1.0, "dp3sd", "papers"): row(94.5), ("mnist", "relu", 1.0, "dp3sd", "kl-mean"): row(93.0),
            ("mnist", "relu", 3.0, "dp3sd", "papers"): row(97.0), ("mnist", "relu", 3.0, "dp3sd", "kl-mean"): row(95.5),
            ("mnist", "relu", 1.0, "dpdsd", "papers"): row(95.8), ("mnist", "relu", 1.0, "dpdsd", "dkd"): row(94.0),
            ("mnist", "relu", 3.0, "dpdsd", "papers"): row(97.5),
            ("mnist", "relu", 3.0, "dpdsd", "dkd"): row(96.0, False),
            ("mnist", "relu", 1.0, "dpema", "papers"): row(94.3),
            ("mnist", "relu", 1.0, "dpema", "ema-no-warmup"): row(93.5),
            ("mnist", "relu", 3.0, "dpema", "papers"): row(97.0),
            ("mnist", "relu", 3.0, "dpema", "ema-no-warmup"): row(95.0)}
    # kl-mean: 1.5 below in both; dkd: its second setting not finished; ema-no-warmup: 0.8 below in one
    assert dropped(rows) == {("dp3sd", "kl-mean")}


def test_each_method_is_confirmed_at_its_best_reading_once_its_screen_is_done(tmp_path):
    """The confirmation: a method's reading is the best mean over the screening settings of its
    best validation accuracy (dropped readings out); a method with a reading not run at every
    length anywhere waits; a screened cell takes the screen's length, another the cell's own;
    a run Table 1 already made with the same settings is read from there, not run again; the
    gain over dpsgd is paired by seed."""
    from fedsd.settings.run import TrainConfig, default_epochs
    from fedsd.files.results import RunResult
    from simulations.readings import CONFIRM_CELLS, SCREEN_SETTINGS, chosen_readings, confirm_rows, confirm_runs

    def row(best, epochs=30):
        return dict(best=best, chosen_epochs=epochs)

    rows = {}
    for i, (d, a, e) in enumerate(SCREEN_SETTINGS):
        rows[(d, a, e, "dpsgd", "papers")] = row(94.0 + i)
        rows[(d, a, e, "dp3sd", "papers")] = row(94.5 + i)
        rows[(d, a, e, "dp3sd", "teacher-step")] = row(95.5 + i, epochs=15)  # best in every setting
        rows[(d, a, e, "dp3sd", "kl-mean")] = row(92.0 + i)  # dropped: over a point below in every setting
        rows[(d, a, e, "dpdsd", "papers")] = row(95.0 + i)
    rows[("mnist", "relu", 3.0, "dpdsd", "dkd")] = dict(best=99.0, chosen_epochs=None)  # not every length yet
    assert chosen_readings(rows) == {"dpsgd": "papers", "dp3sd": "teacher-step"}
    runs = confirm_runs(rows)
    assert {r.method for r in runs} == {"dpsgd", "dp3sd"}
    cells = sum(len({"dpsgd", "dp3sd"} & set(methods)) for *_, methods in CONFIRM_CELLS)
    assert len(runs) == 3 * cells
    lengths = {(r.dataset, r.activation, r.epsilon, r.method): r.epochs for r in runs}
    assert lengths[("mnist", "relu", 1.0, "dp3sd")] == 15  # screened: the screen's length
    assert lengths[("fmnist", "relu", 2.0, "dp3sd")] == default_epochs("fmnist", 2.0)  # not screened: the cell's

    runs_dir = tmp_path / "runs" / "readings"
    mnist1 = [r for r in runs if (r.dataset, r.epsilon) == ("mnist", 1.0)]
    accuracy = {("dpsgd", 0): 0.94, ("dpsgd", 1): 0.95, ("dp3sd", 0): 0.955, ("dp3sd", 1): 0.97}
    for run in mnist1:
        if (run.method, run.seed) not in accuracy:
            continue
        # dpsgd's papers reading at the cell's own length is Table 1's run: found there
        folder = tmp_path / "runs" / "table1" / run.table1_name if run.method == "dpsgd" else runs_dir / run.name
        folder.mkdir(parents=True)
        RunResult.of_run(TrainConfig(**run.config()).resolved(), epsilon_spent=1.0,
                         test_accuracy=accuracy[(run.method, run.seed)], wall_seconds=1.0, device="cpu",
                         data_source="test").write(folder / "result.json")
    table = {(r["dataset"], r["epsilon"], r["method"]): r for r in confirm_rows(runs, runs_dir)}
    dp3sd = table[("mnist", 1.0, "dp3sd")]
    assert dp3sd["reading"] == "teacher-step" and dp3sd["seeds"] == [0, 1]
    assert dp3sd["mean"] == pytest.approx(96.25)
    assert dp3sd["gain_over_dpsgd"]["mean"] == pytest.approx(1.75) and dp3sd["gain_over_dpsgd"]["seeds"] == 2
    assert table[("mnist", 2.0, "dp3sd")]["seeds"] == []


def test_table1_second_protocol_is_the_readings_confirmation_of_each_method_at_its_chosen_reading(tmp_path):
    """Table 1's second protocol: once a method's screen is done on disk, its chosen
    reading's test runs, paired with dpsgd's chosen reading by seed, beside the papers' gain."""
    from fedsd.settings.run import TrainConfig
    from fedsd.files.results import RunResult
    from simulations.readings import confirm_runs, screen_rows, screen_runs
    from simulations.paper_tables import second_protocol, second_protocol_md

    runs_dir = tmp_path / "runs" / "readings"

    def write(run, folder, test, validation=None):
        folder.mkdir(parents=True)
        RunResult.of_run(TrainConfig(**run.config()).resolved(), epsilon_spent=1.0, test_accuracy=test,
                         wall_seconds=1.0, device="cpu", data_source="test",
                         validation_accuracy=validation).write(folder / "result.json")

    # the screens of dpsgd and dpema done: dpsgd's best is its momentum0-lr3, dpema's its papers'
    best = {("dpsgd", "momentum0-lr3"), ("dpema", "papers")}
    for run in screen_runs():
        if run.method in ("dpsgd", "dpema"):
            write(run, runs_dir / run.name, 0.5, (0.95 if (run.method, run.reading.name) in best else 0.90)
                  + (0.001 if run.epochs == 30 else 0.0))  # each at its best length, 30
    assert all(r["seeds"] == [] and r["mean"] is None for r in second_protocol(tmp_path / "runs"))  # none on test yet
    confirm = confirm_runs(screen_rows(screen_runs(), runs_dir))
    assert {(r.method, r.reading.name) for r in confirm} == best
    accuracy = {("dpsgd", 0): 0.95, ("dpsgd", 1): 0.96, ("dpema", 0): 0.97, ("dpema", 1): 0.965}
    for run in confirm:
        if (run.dataset, run.epsilon) == ("mnist", 1.0) and (run.method, run.seed) in accuracy:
            write(run, run.folder(runs_dir), accuracy[(run.method, run.seed)])
    rows = {(r["dataset"], r["epsilon"], r["method"]): r for r in second_protocol(tmp_path / "runs")}
    dpema = rows[("mnist", 1.0, "dpema")]
    assert dpema["reading"] == "papers" and dpema["seeds"] == [0, 1]
    assert dpema["gain_over_dpsgd"]["mean"] == pytest.approx(1.25)
    assert dpema["paper"] == pytest.approx(96.63) and dpema["paper_gain_over_dpsgd"] == pytest.approx(96.63 - 95.51)
    md = "\n".join(second_protocol_md(list(rows.values())))
    assert "| mnist | 1 | dpema | papers, 30 | 96.75 ± 0.25 | 2 | 96.63 | +1.25 ± 0.75 (+1.12) |" in md
    assert "| mnist | 1 | dpsgd | momentum0-lr3, 30 | 95.50 ± 0.50 | 2 | 95.51 |  |" in md


def test_the_kept_warmup_table_is_the_one_its_runs_give():
    """results/table-warmup.{json,md} (DP3SD's warm-up, plain against sharpened CE) say what
    results/runs/warmup holds."""
    from simulations.warmup_table import OUT, markdown, table

    if not OUT.with_suffix(".json").exists():
        pytest.skip("the warm-up study has not been written yet (simulations/warmup-study.sh)")
    t = json.loads(json.dumps(table()))  # the seeds as JSON writes them (strings)
    assert t == json.loads(OUT.with_suffix(".json").read_text())
    assert markdown(table()) == OUT.with_suffix(".md").read_text()


def test_the_kept_distributed_table_is_the_one_its_runs_give(tmp_path):
    """results/table-distributed.{json,md}, simulated and deployed rows, as `fedsd reproduce --table
    distributed` writes them from the kept runs: a run added without rewriting the table fails here."""
    from simulations.distributed_table import write_table

    write_table(RESULTS, to=tmp_path)
    kept = json.loads((RESULTS / "table-distributed.json").read_text())
    assert json.loads((tmp_path / "table-distributed.json").read_text()) == kept
    assert (tmp_path / "table-distributed.md").read_text() == (RESULTS / "table-distributed.md").read_text()


def test_a_finished_deployed_run_is_a_row_beside_the_simulated_ones(tmp_path):
    """A deployed run's result (runs/deploy-distributed-400/<partition>/out/result.json) is a row
    with its command, against the central mean and the central run of its seed; its round time is
    the median of the rounds after the first (which builds each owner's features)."""
    from simulations.distributed_table import deployed_markdown, deployed_rows

    folder = tmp_path / "runs" / "deploy-distributed-400" / "iid"
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "result.json").write_text(json.dumps(dict(seed=0, test_accuracy=0.8912, epsilon_spent=3.0,
                                                                noise_multiplier={"1": 4.2215, "2": 4.2215})))
    (folder / "rounds.jsonl").write_text("".join(json.dumps(dict(line="", seconds=s)) + "\n" for s in (90, 30, 32, 31)))
    assert deployed_rows(tmp_path / "nothing", {0: 89.5}) == []
    [row] = deployed_rows(tmp_path, {0: 89.5, 1: 89.7})
    assert row["accuracy"] == pytest.approx(89.12) and row["paired"] == pytest.approx(-0.38)
    assert row["vs_central"] == pytest.approx(-0.48) and row["round_seconds"] == 31 and row["simulated"] is None
    text = "\n".join(deployed_markdown([row]))
    assert "| features | iid | per-round | 10 | 0 | 89.12 | -0.48 | -0.38 |  | 3.000 | 4.221 | 31.0 | 3 |" in text
    assert "python -m fedsd.deployment.deployed_distributed --partition iid --secure-sum protocol --work W" in text


def test_the_kept_adaptive_table_is_the_one_its_runs_give(tmp_path):
    """results/table-adaptive.{json,md} (adaptive clipping from 10× and 0.1× off the tuned C), as
    `fedsd reproduce --table adaptive` writes them from the kept runs."""
    from simulations.adaptive_table import TABLE_NAME, write_table

    if not (RESULTS / f"{TABLE_NAME}.json").exists():
        pytest.skip("the adaptive clipping table has not been written yet")
    write_table(RESULTS, to=tmp_path)
    assert json.loads((tmp_path / f"{TABLE_NAME}.json").read_text()) == \
        json.loads((RESULTS / f"{TABLE_NAME}.json").read_text())
    assert (tmp_path / f"{TABLE_NAME}.md").read_text() == (RESULTS / f"{TABLE_NAME}.md").read_text()


def test_the_adaptive_screen_chooses_the_best_worse_of_two_starts_and_a_diverged_run_scores_zero(tmp_path,
                                                                                                 monkeypatch):
    """The quantile is chosen on validation by the worse of its two starts (a user does not know on
    which side of the tuned C they start); a diverged run scores 0; a tie keeps the quantile nearer
    0.5; none is chosen while a screen run is missing."""
    from simulations import adaptive_table as at

    def put(q, start, accuracy):
        run = tmp_path / "runs" / "adaptive" / at.AdaptiveRun("r", q, start, 0, at.VALIDATION).name
        run.mkdir(parents=True)
        if accuracy is None:
            (run / "diverged.json").write_text("{}")
        else:
            (run / "result.json").write_text(json.dumps({"validation_accuracy": accuracy}))

    monkeypatch.setattr(at, "_result", lambda out, run: type("Result", (), json.loads(
        (out / "runs" / "adaptive" / run.name / "result.json").read_text()))()
        if (out / "runs" / "adaptive" / run.name / "result.json").exists() else None)
    scores = {0.3: (0.80, 0.70), 0.5: (0.90, 0.75), 0.7: (0.95, 0.75), 0.9: (0.99, None)}
    for q, (high, low) in scores.items():
        put(q, 10.0, high)
        if q != 0.9:
            put(q, 0.1, low)
    assert at.chosen_quantile(tmp_path, "r") is None  # 0.9 from 0.1× not run yet
    put(0.9, 0.1, None)
    assert at.chosen_quantile(tmp_path, "r") == 0.5  # 0.5 and 0.7 tie at 75: the nearer the middle
