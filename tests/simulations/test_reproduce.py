"""`fedsd reproduce`: cells, resume, and the table files (tiny runs: the harness, not the numbers)."""
import json

import pytest

from fedsd.cli.main import main
from simulations.paper_tables import PAPER_TABLE1, table1_cells, table2_cells
from tests.conftest import require


def test_cells_cover_the_table():
    cells = table1_cells(["mnist", "fmnist", "cifar10"], ["dpsgd", "dpkd", "dpema", "dp3sd", "dpdsd"], [1, 2, 3])
    assert len(cells) == 45 and len({c.name for c in cells}) == 45
    assert {c.paper for c in cells if c.dataset == "fmnist" and c.epsilon == 3 and c.method == "dp3sd"} == {87.68}
    assert len(PAPER_TABLE1) == 15
    ablation = table2_cells()
    assert [c.overrides for c in ablation if c.method == "dp3sd"] == [{}, {"dp3sd_tau_s": 1.0}, {"dp3sd_tau_t": 1.0},
                                                                      {"dp3sd_tau_s": 1.0, "dp3sd_tau_t": 1.0}]


@pytest.mark.slow
def test_reproduce_runs_resumes_and_writes_tables(tmp_path):
    require("fmnist")
    args = ["reproduce", "--table", "1", "--datasets", "fmnist", "--methods", "dpsgd", "dp3sd", "--epsilons", "3",
            "--seeds", "2", "--epochs", "2", "--subset", "2500", "--jobs", "2", "--out", str(tmp_path), "--quiet"]
    assert main(args) == 0
    table = json.loads((tmp_path / "table1.json").read_text())
    assert [(c["method"], len(c["accuracies"])) for c in table["cells"]] == [("dpsgd", 2), ("dp3sd", 2)]
    assert all(0 < a <= 100 for c in table["cells"] for a in c["accuracies"])
    md = (tmp_path / "table1.md").read_text()
    assert "| fmnist | dp3sd | 3 |" in md and "87.68" in md
    assert (tmp_path / "fig3-fmnist.png").exists()
    stamp = (tmp_path / "runs" / "table1" / "fmnist-dpsgd-eps3-seed0" / "result.json").stat().st_mtime_ns
    assert main(args) == 0  # resumes: nothing is run again
    assert (tmp_path / "runs" / "table1" / "fmnist-dpsgd-eps3-seed0" / "result.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_sweep_chooses_on_validation_only(tmp_path, capsys):
    require("fmnist")
    out = tmp_path / "sweep"
    args = ["sweep", "--dataset", "fmnist", "--method", "dpema", "--grid", "ema-decay=0.5,0.9", "--validation", "2000",
            "--subset", "3200", "--epochs", "1", "--out", str(out), "--quiet"]  # B = 1600: two steps
    assert main(args) == 0
    summary = json.loads((out / "sweep.json").read_text())
    runs = summary["runs"]
    assert [r["settings"] for r in runs] == [{"ema_decay": 0.5}, {"ema_decay": 0.9}]
    best = max(runs, key=lambda r: r["validation_mean"])
    assert summary["choice"] == {"settings": best["settings"], "validation_accuracy": best["validation_mean"]}
    for r in runs:
        run = out / "runs" / f"emadecay{r['settings']['ema_decay']:g}-seed0"
        result = json.loads((run / "result.json").read_text())
        assert result["config"]["validation"] == 2000 and result["num_train"] == 3200
        assert 10 < r["validation_accuracy"][0] <= 100
    assert "chosen" in (out / "sweep.md").read_text()
    bad = ["sweep", "--dataset", "fmnist", "--method", "dpema", "--grid", "color=1,2", "--out", str(tmp_path / "x")]
    assert main(bad) == 2
    assert "cannot be swept" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_setting_added_later_does_not_make_a_finished_run_stale(tmp_path):
    """A run made before a setting existed ran as that setting's default: it is not run again."""
    from fedsd.settings.run import TrainConfig
    from fedsd.simulation.sweeps import finished_with

    config = dict(dataset="fmnist", method="dpsgd", epsilon=3.0, seed=0)
    saved = TrainConfig(**config).resolved().to_dict()
    del saved["classes"]  # as in a result.json written before custom tasks existed
    (tmp_path / "result.json").write_text(json.dumps(dict(_result_fields(0.9), config=saved)))
    assert finished_with(tmp_path, config)
    assert not finished_with(tmp_path, {**config, "epsilon": 2.0})  # a real change still counts


def _result_fields(accuracy):
    """What every result.json has (fedsd.files.results.RunResult), here with made-up values."""
    return dict(dataset="fmnist", method="dpsgd", epsilon_target=3.0, epsilon_spent=3.0, delta=1e-5,
                test_accuracy=accuracy, seed=0, wall_seconds=1.0, device="cpu", data_source="made up", config={},
                noise_multiplier=1.0, epochs=[dict(test_accuracy=accuracy)])


def _fake_run(runs_dir, name, seed, accuracy):
    """A finished Table-1 run's result.json (the fields the table reads are the ones that matter)."""
    run = runs_dir / f"{name}-seed{seed}"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps(_result_fields(accuracy)))


def test_a_partial_reproduce_keeps_the_other_cells_and_gains_use_the_same_seeds(tmp_path):
    from simulations.paper_tables import table_cells, write_tables

    runs = tmp_path / "runs" / "table1"
    _fake_run(runs, "mnist-dpsgd-eps3", 0, 0.90)
    _fake_run(runs, "mnist-dpsgd-eps3", 1, 0.80)
    _fake_run(runs, "mnist-dp3sd-eps3", 1, 0.84)  # seed 1 only: its gain is against dpsgd's seed 1
    _fake_run(runs, "fmnist-dpsgd-eps1", 0, 0.70)
    asked = table1_cells(["mnist"], ["dp3sd"], [3.0])  # as `reproduce --methods dp3sd --epsilons 3`
    write_tables(1, table_cells(1, asked, runs), runs, tmp_path)
    rows = {(c["dataset"], c["method"], c["epsilon"]): c
            for c in json.loads((tmp_path / "table1.json").read_text())["cells"]}
    assert set(rows) == {("mnist", "dpsgd", 3.0), ("mnist", "dp3sd", 3.0), ("fmnist", "dpsgd", 1.0)}
    assert rows[("mnist", "dpsgd", 3.0)]["seeds"] == [0, 1]
    assert rows[("mnist", "dp3sd", 3.0)]["gain_over_dpsgd"] == pytest.approx(4.0)
    assert "| mnist | dp3sd | 3 | 1 | 84.00 ± 0.00 | 1 | 98.42 | -14.42 | +4.00 |" \
        in (tmp_path / "table1.md").read_text()


def test_a_variants_rows_stand_beside_the_papers_and_gain_against_dpsgd_of_the_same_variant(tmp_path):
    """`--variant tanh`: its cells run with the variant's setting, under their own names, and
    are kept in the table with the papers' rows (made by any later reproduce); their gain is
    against dpsgd with the same variant, never against the papers' set-up."""
    from simulations.paper_tables import table_cells, write_tables

    cells = table1_cells(["fmnist"], ["dpsgd", "dpdsd"], [3.0], "tanh")
    assert [(c.name, c.overrides) for c in cells] == [("fmnist-dpsgd-tanh-eps3", {"activation": "tanh"}),
                                                      ("fmnist-dpdsd-tanh-eps3", {"activation": "tanh"})]
    runs = tmp_path / "runs" / "table1"
    _fake_run(runs, "fmnist-dpsgd-eps3", 0, 0.80)
    _fake_run(runs, "fmnist-dpsgd-tanh-eps3", 0, 0.85)
    _fake_run(runs, "fmnist-dpdsd-tanh-eps3", 0, 0.86)
    write_tables(1, table_cells(1, table1_cells(["fmnist"], ["dpsgd"], [3.0]), runs), runs, tmp_path)
    rows = {(c["method"], c["variant"]): c for c in json.loads((tmp_path / "table1.json").read_text())["cells"]}
    assert set(rows) == {("dpsgd", ""), ("dpsgd", "tanh"), ("dpdsd", "tanh")}
    assert rows[("dpdsd", "tanh")]["gain_over_dpsgd"] == pytest.approx(1.0)
    assert "| fmnist | dpdsd (tanh, a variant) | 3 | 1 | 86.00 ± 0.00 | 1 | 87.68 | -1.68 | +1.00 |" in (
        tmp_path / "table1.md").read_text()
    assert main(["reproduce", "--table", "2", "--variant", "tanh", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, says", [
    (["--table", "fed", "--datasets", "mnist"], "--datasets: Table fed is Fashion-MNIST's only"),
    (["--table", "fed", "--methods", "dpkd"], "--methods: the federated table has dpsgd, dpema, dp3sd, dpdsd"),
    (["--table", "fed", "--seeds", "0"], "--seeds: must be >= 1"),
    (["--table", "fed", "--partitions", "dirichlet0.1", "--subset", "3000"], "fewer than --batch-size 256"),
])
def test_the_federated_table_refuses_bad_input_before_any_run(tmp_path, capsys, bad, says):
    if "--subset" in bad:
        require("fmnist")
    assert main(["reproduce", *bad, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_federated_table_runs_resumes_and_writes_its_files(tmp_path):
    require("fmnist")
    args = ["reproduce", "--table", "fed", "--partitions", "iid", "--methods", "dpsgd", "dp3sd", "--epochs", "2",
            "--subset", "3000", "--jobs", "2", "--out", str(tmp_path), "--quiet"]
    assert main(args) == 0
    table = json.loads((tmp_path / "table-fed.json").read_text())
    rows = {(c["method"], c["teacher"]): c for c in table["cells"]}
    # dp3sd is also run with its global-ema teacher (simulations.federated_table.TEACHER_VARIANTS)
    assert set(rows) == {("dpsgd", "round-start"), ("dp3sd", "round-start"), ("dp3sd", "global-ema")}
    assert table["settings"]["num_clients"] == 10
    for row in rows.values():
        assert len(row["curves"][0]) == 2 and row["shard_sizes"] == [300] * 10
        assert 15 < row["final"][0] <= 100  # two rounds on 3,000 samples: well above chance (10 %)
        assert 2.9 < row["client_epsilon"][0] <= row["client_epsilon"][1] <= 3.0
        assert row["best_accuracy"] == max(row["curves"][0])
    dp3sd, dpsgd = rows["dp3sd", "round-start"], rows["dpsgd", "round-start"]
    assert dp3sd["gain_over_dpsgd"] == pytest.approx(dp3sd["final"][0] - dpsgd["final"][0])
    assert "| iid | dp3sd | round-start |" in (tmp_path / "table-fed.md").read_text()
    assert (tmp_path / "fig-fed-iid.png").stat().st_size > 10_000
    runs = tmp_path / "runs" / "table-fed"
    done = runs / "fmnist-iid-dpsgd-eps3-seed0" / "result.json"
    stamp = done.stat().st_mtime_ns
    stopped = runs / "fmnist-iid-dp3sd-eps3-seed0" / "result.json"
    stopped.unlink()  # as if stopped after its last checkpoint: it goes on from there, not from round 1
    assert main(args) == 0
    assert done.stat().st_mtime_ns == stamp  # a finished run is not run again
    again = json.loads(stopped.read_text())
    assert 100 * again["test_accuracy"] == pytest.approx(dp3sd["final"][0])
    # a run in which a client went missing (here: as if its worker had been killed) is run again
    from simulations.federated_table import FedCell, cell_settings, run_state

    settings = cell_settings(FedCell("iid", "dpsgd"), 0, rounds=2, subset=3000)
    assert run_state(done.parent, *settings) == "done"
    written = json.loads(done.read_text())
    done.write_text(json.dumps({**written, "missed": {"2": [{"client": 3, "reason": "OutOfMemoryError"}]}}))
    assert run_state(done.parent, *settings) == "fresh"
    # and so is one in which a client sat a round out with its budget spent (a round charged twice)
    last = {**written["rounds"][-1], "skipped": [3]}
    done.write_text(json.dumps({**written, "rounds": [*written["rounds"][:-1], last]}))
    assert run_state(done.parent, *settings) == "fresh"
    # and one in which a client's ε fell (its accountant started again: its state folder was lost)
    first = written["rounds"][0]
    last = {**written["rounds"][-1], "client_epsilon": {**written["rounds"][-1]["client_epsilon"],
                                                        "3": first["client_epsilon"]["3"] / 2}}
    done.write_text(json.dumps({**written, "rounds": [*written["rounds"][:-1], last]}))
    assert run_state(done.parent, *settings) == "fresh"
    said = {**written["rounds"][-1], "epsilon_fell_from": {"3": first["client_epsilon"]["3"]}}  # the server's word
    done.write_text(json.dumps({**written, "rounds": [*written["rounds"][:-1], said]}))
    assert run_state(done.parent, *settings) == "fresh"
    done.write_text(json.dumps(written))
    assert run_state(done.parent, *settings) == "done"
    done.write_text(json.dumps({**written, "rounds": [*written["rounds"][:-1], last]}))
    from simulations.federated_table import fed_cells, write_fed_table

    write_fed_table(fed_cells(["iid"], ["dpsgd", "dp3sd"]), runs, tmp_path)  # and the table leaves it out
    rows = {(c["method"], c["teacher"]): c for c in json.loads((tmp_path / "table-fed.json").read_text())["cells"]}
    assert ("dpsgd", "round-start") not in rows and rows["dp3sd", "round-start"]["vs_dpsgd"] is None


def test_the_federated_table_runs_dpdsd_with_dpemas_release_and_keeps_the_runs_made_before_it():
    """The row of dpdsd with the decay schedule and the EMA released (--release ema) is in every
    partition with its own folder; a run finished before --release existed (its saved settings
    lack the key) is still a finished run of its row."""
    from fedsd.settings.run import TrainConfig
    from simulations.federated_table import FedCell, _settings, cell_settings, fed_cells

    cells = {c.name: c for c in fed_cells()}
    for partition in ("iid", "dirichlet0.5", "dirichlet0.1"):
        cell = cells[f"fmnist-{partition}-dpdsd-decay-release-ema-eps3"]
        cfg, _ = cell_settings(cell, 0)
        assert (cfg.release, cfg.distill_schedule, cfg.ema_decay) == ("ema", "decay", 0.995)
        assert cell.variant == "round-start, decay, ema released" and not cell.is_baseline
    assert FedCell.of_row(cells["fmnist-iid-dpema-eps3"].labels()).is_baseline
    cfg, fed = cell_settings(FedCell("dirichlet0.1", "dpdsd"), 0)
    saved = cfg.to_dict()
    del saved["release"]
    assert _settings(TrainConfig.from_dict(saved), fed) == _settings(cfg, fed)


def test_a_diverged_federation_is_a_row_of_the_table_and_not_run_again(tmp_path):
    """A federated run stopped by a client's divergence is recorded (diverged.json with its
    settings and reason) and shown as such; the table goes on and a reproduce does not run it
    again."""
    import dataclasses

    from simulations.federated_table import FedCell, cell_settings, run_state, write_fed_table

    runs = tmp_path / "runs" / "table-fed"
    cell = FedCell("dirichlet0.1", "dpdsd", "local-previous")
    cfg, fed = cell_settings(cell, 0)
    run = runs / f"{cell.name}-seed0"
    run.mkdir(parents=True)
    (run / "diverged.json").write_text(json.dumps(dict(
        config=cfg.to_dict(), federation=dataclasses.asdict(fed),
        reason="round 2, client 5: training diverged in epoch 2: the mean loss ...")))
    assert run_state(run, cfg, fed) == "done"
    assert run_state(run, *cell_settings(cell, 0, rounds=5)) == "fresh"  # other settings: made again
    write_fed_table([cell], runs, tmp_path)
    row = json.loads((tmp_path / "table-fed.json").read_text())["cells"][0]
    assert row["diverged"] and row["final"] == [] and row["gain_over_dpsgd"] is None
    assert "| dirichlet0.1 | dpdsd | local-previous | diverged (round 2, client 5) | 0 |" in \
        (tmp_path / "table-fed.md").read_text()


def test_a_grid_sweeps_a_named_choice_and_refuses_one_not_offered():
    """The activation (relu, tanh) and the input normalisation are swept like numbers, and a
    run's folder names them; a value outside a setting's choices is refused before any run."""
    from fedsd.errors import ConfigError
    from fedsd.cli.sweep import parse_grid, slug

    grid = parse_grid(["activation=relu,tanh", "lr=1.5,3"])
    assert grid == {"activation": ["relu", "tanh"], "lr": [1.5, 3.0]}
    assert slug({"lr": 3.0, "activation": "tanh"}) == "lr3-activationtanh"
    with pytest.raises(ConfigError, match="activation takes relu, tanh; got 'sigmoid'"):
        parse_grid(["activation=relu,sigmoid"])


def test_the_federated_table_pairs_seeds_and_marks_differences_beyond_two_standard_errors():
    """vs dpsgd / dpema: seed-by-seed differences over the seeds both rows ran, their mean and
    standard error; 'beyond two standard errors' only with more than one seed."""
    from fedsd.simulation.sweeps import paired_difference

    base = dict(seeds=[0, 1, 2], final=[80.0, 81.0, 79.0])
    steady = dict(seeds=[0, 1, 2], final=[81.0, 82.2, 79.8])  # +1.0, +1.2, +0.8
    d = paired_difference(steady, base, "final")
    assert d["mean"] == pytest.approx(1.0) and d["se"] == pytest.approx(0.2 / 3 ** 0.5) and d["beyond_2se"]
    noisy = dict(seeds=[0, 1, 2], final=[82.0, 80.0, 79.5])  # +2.0, −1.0, +0.5
    d = paired_difference(noisy, base, "final")
    assert d["mean"] == pytest.approx(0.5) and not d["beyond_2se"]
    d = paired_difference(dict(seeds=[1, 5], final=[83.0, 90.0]), base, "final")  # only seed 1 is shared
    assert d == dict(mean=pytest.approx(2.0), se=None, seeds=1, beyond_2se=False)
    assert paired_difference(base, base, "final") is None and paired_difference(steady, None, "final") is None


def test_the_gain_over_dpsgd_pairs_only_runs_of_the_same_length():
    """A cell made before its data set's default length changed at that ε is not compared with
    dpsgd rerun at the new length: their difference would measure the length, not the method."""
    from simulations.paper_tables import gain_over_dpsgd

    dpsgd = dict(method="dpsgd", dataset="fmnist", epsilon=1.0, seeds=[0, 1], accuracies=[81.0, 82.0], epochs=[15])
    fresh = dict(method="dpema", dataset="fmnist", epsilon=1.0, seeds=[0, 1], accuracies=[82.0, 82.5], epochs=[15])
    stale = dict(method="dp3sd", dataset="fmnist", epsilon=1.0, seeds=[0], accuracies=[72.0], epochs=[60])
    rows = [dpsgd, fresh, stale]
    assert gain_over_dpsgd(fresh, rows, ("dataset", "epsilon")) == pytest.approx(0.75)
    assert gain_over_dpsgd(stale, rows, ("dataset", "epsilon")) is None
