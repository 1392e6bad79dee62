"""`fedsd reproduce --table features`: what the table chooses, on validation only,
and how it pairs each method with dpsgd, central and in a federation. Made-up results in the
real folders; the runs themselves are the slow tests of ScatterNet training."""
import json

import pytest

from fedsd.settings.run import TrainConfig
from fedsd.files.results import RunResult


def _write(folder, cfg, test, validation=None, device="cpu", device_name=None, **facts):
    folder.mkdir(parents=True)
    result = RunResult.of_run(cfg, epsilon_spent=3.0, test_accuracy=test, wall_seconds=120.0, device=device,
                              data_source="test", validation_accuracy=validation, **facts)
    result.device_name = device_name or result.device_name  # a GPU's card, where this machine has none
    result.write(folder / "result.json")


def _central(runs_dir, run, test, validation=None, device="cpu", device_name=None):
    _write(runs_dir / run.name, TrainConfig(**run.config(1, device, None)).resolved(), test, validation, device,
           device_name)


def _groupnorm_kept(runs_dir, dataset):
    """The normalisation stage done, GroupNorm kept: the private statistics' run does worse."""
    from simulations.features_table import norm_runs

    for run in norm_runs(runs_dir, [dataset]):
        if not (runs_dir / run.name).exists():
            _central(runs_dir, run, test=0.5, validation=0.1)


def _screen_done(runs_dir, dataset, best=0.6):
    """A data set's lr screen done, Tramèr & Boneh's lr the best (inside the grid), at `best` on
    validation."""
    from simulations.features_table import TB_SETTINGS, screen_runs

    tb_lrs = {tb["lr"] for tb in TB_SETTINGS[dataset]}
    for run in screen_runs(runs_dir, [dataset]):
        _central(runs_dir, run, test=0.5, validation=best if run.settings["lr"] in tb_lrs else best - 0.05)


def _federation(runs_dir, run, test, validation=None, missed=None):
    cfg, fed = run.settings("cpu", None)
    _write(runs_dir / run.name, cfg, test, validation, rounds=[dict(round=1)], missed=missed,
           federation=fed.__dict__)


def test_features_table_chooses_on_validation_and_pairs_each_method_with_dpsgd(tmp_path):
    from simulations.features_table import (FED_LR_SCALES, chosen, chosen_network, confirm_runs, fed_confirm_runs,
                                            fed_screen_runs, recipe, recipe_runs, screen_runs, write_features_table)

    runs_dir = tmp_path / "runs" / "features"
    screen = screen_runs(runs_dir, ["fmnist"])
    assert len(screen) == 6  # two networks, three lrs each
    assert chosen(runs_dir, "fmnist") is None and fed_screen_runs(runs_dir) == []  # the federation waits for it
    for k, run in enumerate(screen):  # each network's best inside its grid, the linear network's the best
        _central(runs_dir, run, test=0.99 if k == 0 else 0.80, validation={1: 0.86, 4: 0.855}.get(k, 0.85))
    assert screen_runs(runs_dir, ["fmnist"]) == screen
    best = screen[1].settings  # the best on validation, not the best on test (screen[0])
    assert chosen_network(runs_dir, "fmnist") == best
    assert chosen(runs_dir, "fmnist") is None and recipe_runs(runs_dir, ["fmnist"]) == []  # the normalisation next
    _groupnorm_kept(runs_dir, "fmnist")
    assert chosen(runs_dir, "fmnist") == best
    # the recipe: dpema's average of the iterates at the chosen setting, against dpsgd's last iterate
    (ema,) = recipe_runs(runs_dir, ["fmnist"])
    assert (ema.method, ema.settings, ema.validation) == ("dpema", best, 10_000) and recipe(runs_dir, "fmnist") is None
    _central(runs_dir, ema, test=0.5, validation=0.865)
    assert recipe(runs_dir, "fmnist") == dict(method="dpema", reading="papers",
                                              validation={"dpsgd": pytest.approx(86.0), "dpema": pytest.approx(86.5)})
    accuracy = {("dpsgd", 0): 0.89, ("dpsgd", 1): 0.90, ("dpdsd", 0): 0.88, ("dpdsd", 1): 0.885, ("dpema", 0): 0.9}
    for run in confirm_runs(runs_dir, ["fmnist"], seeds=2):
        assert run.settings == best
        if (run.method, run.seed) in accuracy:
            _central(runs_dir, run, accuracy[(run.method, run.seed)])

    # the federation's lr grid: Tramèr & Boneh's lr for the chosen network at B = 256, times each scale
    fed_screen = fed_screen_runs(runs_dir)
    base = best["lr"] * 256 / best["batch_size"]  # the chosen lr is theirs here
    assert [r.lr for r in fed_screen] == pytest.approx([base * s for s in FED_LR_SCALES])
    assert {(r.method, r.partition, r.network, r.validation) for r in fed_screen} == {
        ("dpsgd", "iid", best["model"], 10_000)}
    (runs_dir / fed_screen[0].name).mkdir(parents=True)  # diverged: done, with no accuracy
    (runs_dir / fed_screen[0].name / "diverged.json").write_text("{}")
    _federation(runs_dir, fed_screen[1], test=0.5, validation=0.81)
    # a run in which a client went missing does not count: the screen is not done
    _federation(runs_dir, fed_screen[-1], test=0.5, validation=0.99, missed={"3": [2]})
    assert fed_confirm_runs(runs_dir, seeds=2) == []
    import shutil

    shutil.rmtree(runs_dir / fed_screen[-1].name)
    _federation(runs_dir, fed_screen[-1], test=0.5, validation=0.70)
    confirm = fed_confirm_runs(runs_dir, seeds=2)
    assert {r.lr for r in confirm} == {fed_screen[1].lr}
    assert {(r.partition, r.method) for r in confirm} == {(p, m) for p in ("iid", "dirichlet0.5")
                                                           for m in ("dpsgd", "dp3sd", "dpdsd", "dpema")}
    fed_accuracy = {("iid", "dpsgd", 0): 0.85, ("iid", "dpsgd", 1): 0.86, ("iid", "dp3sd", 0): 0.80,
                    ("iid", "dp3sd", 1): 0.84}
    for run in confirm:
        if (run.partition, run.method, run.seed) in fed_accuracy:
            _federation(runs_dir, run, fed_accuracy[(run.partition, run.method, run.seed)])

    write_features_table(runs_dir, tmp_path, seeds=2)
    table = json.loads((tmp_path / "table-features.json").read_text())
    central = {r["method"]: r for r in table["confirmed"]}
    assert central["dpsgd"]["mean"] == pytest.approx(89.5) and central["dpdsd"]["seeds"] == [0, 1]
    assert central["dpdsd"]["gain_over_dpsgd"]["mean"] == pytest.approx(-1.25)
    assert [m for m, r in central.items() if r["recipe"]] == ["dpema"]
    assert table["recipes"]["fmnist"]["method"] == "dpema"
    fed = {(r["partition"], r["method"]): r for r in table["federated"]["rows"]}
    assert set(fed) == {("iid", "dpsgd"), ("iid", "dp3sd")}
    assert fed[("iid", "dp3sd")]["gain_over_dpsgd"]["mean"] == pytest.approx(-3.5)
    assert fed[("iid", "dp3sd")]["gain_over_dpsgd"]["se"] == pytest.approx(1.5)
    md = (tmp_path / "table-features.md").read_text()
    assert "| fmnist | **dpema** | " in md and "| fmnist | dpema | " + best["model"] in md  # its row, its screen run
    assert f"| {best['model']} | {fed_screen[0].lr:g} | diverged | |" in md
    assert f"| iid | dp3sd | {best['model']}, {fed_screen[1].lr:g} | 2 | 82.00 ± 2.00 | -3.50 ± 1.50 | 2.0 |" in md


def test_cifar10s_recipe_is_chosen_on_validation_too_and_a_gpus_minutes_are_marked(tmp_path):
    """CIFAR-10's settings are chosen as the others' are: its lr screened on validation, then
    its normalisation, then its recipe (dpema against dpsgd). A run that went to a GPU says so
    beside its minutes, by its card where result.json names it: they are not this CPU's."""
    from simulations.features_table import (chosen_network, confirm_runs, norm_runs, recipe, recipe_runs, screen_runs,
                                            write_features_table)

    runs_dir = tmp_path / "runs" / "features"
    screen = screen_runs(runs_dir, ["cifar10"])
    assert [r.settings["lr"] for r in screen] == [2.0, 4.0, 8.0]
    # Tramèr & Boneh's lr is the run this project made before CIFAR-10 was screened: it is kept
    assert screen[1].name == "cifar10-scatter-cnn-B8192-lr4-e85-dpsgd-val-seed0"
    assert norm_runs(runs_dir, ["cifar10"]) == [] and recipe_runs(runs_dir, ["cifar10"]) == []  # the screen first
    _screen_done(runs_dir, "cifar10")
    assert chosen_network(runs_dir, "cifar10") == screen[1].settings
    group, private = norm_runs(runs_dir, ["cifar10"])
    assert group == screen[1]  # the screen's run: not run again
    assert recipe_runs(runs_dir, ["cifar10"]) == []  # the normalisation first
    _central(runs_dir, private, test=0.5, validation=0.66)
    (ema,) = recipe_runs(runs_dir, ["cifar10"])
    assert (ema.method, ema.settings, ema.validation) == ("dpema", private.settings, 10_000)
    _central(runs_dir, ema, test=0.9, validation=0.655, device="cuda:0",  # better on test, worse on validation
             device_name="NVIDIA H200")
    assert recipe(runs_dir, "cifar10")["method"] == "dpsgd"
    for run in confirm_runs(runs_dir, ["cifar10"], seeds=2):
        if run.method in ("dpsgd", "dpema"):
            _central(runs_dir, run, test=0.68 if run.method == "dpsgd" else 0.685,
                     device="cpu" if run.method == "dpsgd" else "cuda:0")
        elif (run.method, run.reading) == ("dpdsd", "papers"):  # one seed here, one on an H200
            _central(runs_dir, run, test=0.67, device="cuda:0" if run.seed else "cpu",
                     device_name="NVIDIA H200" if run.seed else None)
    write_features_table(runs_dir, tmp_path, seeds=2)
    md = (tmp_path / "table-features.md").read_text()
    assert "| cifar10 | **dpsgd** | scatter-cnn, 8192, 4, 85, private statistics |" in md
    assert "| 2 | 68.50 ± 0.00 | +0.50 ± 0.00 | 2.0 (cuda) |" in md  # dpema's row
    assert "| 2 | 68.00 ± 0.00 |  | 2.0 |" in md  # dpsgd's, on the CPU
    assert "| 2 | 67.00 ± 0.00 | -1.00 ± 0.00 | 2.0, 2.0 (NVIDIA H200) |" in md  # dpdsd's: each device's own
    assert "| cifar10 | dpema | scatter-cnn | 8192 | 4 | 85 | private statistics | 65.50 | 2.0 (NVIDIA H200) |" in md


def test_the_screen_goes_past_the_edge_of_its_lr_grid_while_the_best_is_there(tmp_path):
    from simulations.features_table import (LR_SCALES, MAX_LR_STEPS, TB_SETTINGS, chosen_network, fed_screen_runs,
                                            screen_runs)

    runs_dir = tmp_path / "runs" / "features"
    linear, cnn = TB_SETTINGS["mnist"]
    lin, cnn_lr = linear["lr"], cnn["lr"]
    validation = {(linear["model"], 0.5 * lin): 0.980, (linear["model"], lin): 0.979,  # best at the low edge
                  (linear["model"], 2 * lin): 0.970,
                  (cnn["model"], 0.5 * cnn_lr): 0.960, (cnn["model"], cnn_lr): 0.975,  # best at the high edge
                  (cnn["model"], 2 * cnn_lr): 0.990}

    def finish(runs):
        for run in runs:
            if not (runs_dir / run.name).exists():
                _central(runs_dir, run, test=0.5, validation=validation[(run.settings["model"], run.settings["lr"])])

    def grid(model):
        return [r.settings["lr"] for r in screen_runs(runs_dir, ["mnist"]) if r.settings["model"] == model]

    finish(screen_runs(runs_dir, ["mnist"]))
    assert grid(linear["model"]) == [0.25 * lin, 0.5 * lin, lin, 2 * lin]
    assert grid(cnn["model"]) == [0.5 * cnn_lr, cnn_lr, 2 * cnn_lr, 4 * cnn_lr]
    assert chosen_network(runs_dir, "mnist") is None  # the extended grid has runs to do

    validation[(linear["model"], 0.25 * lin)] = 0.975  # the linear network's best now inside its grid
    validation[(cnn["model"], 4 * cnn_lr)] = 0.995  # the CNN's still at the edge: one step more, the last
    finish(screen_runs(runs_dir, ["mnist"]))
    screen = screen_runs(runs_dir, ["mnist"])
    assert len(screen) == 2 * len(LR_SCALES) + 1 + MAX_LR_STEPS
    validation[(cnn["model"], 8 * cnn_lr)] = 0.999
    finish(screen)
    assert screen_runs(runs_dir, ["mnist"]) == screen  # MAX_LR_STEPS past the grid, and no further
    assert chosen_network(runs_dir, "mnist") == {**cnn, "lr": 8 * cnn_lr}
    assert fed_screen_runs(runs_dir) == []  # the federation is on Fashion-MNIST


def test_a_method_runs_on_features_in_the_reading_the_readings_screen_chose_beside_the_papers(tmp_path):
    """Each self-distilling method in its best reading from the readings' screen once that screen
    has chosen one (the papers' until then), its lr scale applied to the features setting's lr,
    centrally and in the federation; dpsgd stays at its features setting."""
    from simulations.features_table import (TB_SETTINGS, FeatureRun, FedFeatureRun, confirm_runs, method_readings,
                                            screen_runs, write_features_table)
    from simulations.readings import screen_runs as readings_screen

    runs_dir = tmp_path / "runs" / "features"
    assert method_readings(runs_dir, "dp3sd") == ("papers",)  # no readings screen on disk
    for run in readings_screen():  # dp3sd's screen done: momentum 0 at three times the lr its best
        if run.method == "dp3sd":
            _write(tmp_path / "runs" / "readings" / run.name, TrainConfig(**run.config()).resolved(), 0.5,
                   0.97 if run.reading.name == "momentum0-lr3" else 0.95)
    assert method_readings(runs_dir, "dp3sd") == ("papers", "momentum0-lr3")
    assert method_readings(runs_dir, "dpdsd") == method_readings(runs_dir, "dpsgd") == ("papers",)

    linear = TB_SETTINGS["fmnist"][0]
    for k, run in enumerate(screen_runs(runs_dir, ["fmnist"])):
        _central(runs_dir, run, test=0.8, validation={1: 0.9, 4: 0.89}.get(k, 0.85))  # the linear network, their lr
    _groupnorm_kept(runs_dir, "fmnist")
    confirm = confirm_runs(runs_dir, ["fmnist"], seeds=1)
    assert {(r.method, r.reading) for r in confirm} == {("dpsgd", "papers"), ("dp3sd", "papers"),
                                                        ("dp3sd", "momentum0-lr3"), ("dpdsd", "papers"),
                                                        ("dpema", "papers")}
    reading = next(r for r in confirm if r.reading == "momentum0-lr3")
    config = reading.config(1, "cpu", None)
    assert (config["lr"], config["momentum"]) == (3 * linear["lr"], 0.0)
    assert reading.name.endswith("-dp3sd-momentum0-lr3-seed0")
    for run, test in ((FeatureRun("fmnist", linear, "dpsgd", 0), 0.89),
                      (FeatureRun("fmnist", linear, "dp3sd", 0), 0.85), (reading, 0.895)):
        _central(runs_dir, run, test)
    write_features_table(runs_dir, tmp_path, seeds=1)
    rows = {(r["method"], r["reading"]): r
            for r in json.loads((tmp_path / "table-features.json").read_text())["confirmed"]}
    assert rows[("dp3sd", "momentum0-lr3")]["gain_over_dpsgd"]["mean"] == pytest.approx(0.5)
    assert rows[("dp3sd", "papers")]["gain_over_dpsgd"]["mean"] == pytest.approx(-4.0)
    assert "| fmnist | dp3sd (momentum0-lr3) |" in (tmp_path / "table-features.md").read_text()

    fed = FedFeatureRun("iid", "dp3sd", 1.0, linear["model"], reading="momentum0-lr3")
    cfg, _ = fed.settings("cpu", None)
    assert (cfg.lr, cfg.momentum) == (3.0, 0.0)


def test_a_tie_on_validation_keeps_the_lr_nearer_tramer_and_bonehs(tmp_path):
    """Accuracy on 10,000 samples comes in steps of 0.01 %: a tie between the grid's edge and its
    inside neither extends the grid nor moves the choice away from the published lr."""
    from simulations.features_table import TB_SETTINGS, chosen_network, screen_runs

    runs_dir = tmp_path / "runs" / "features"
    linear = TB_SETTINGS["mnist"][0]["lr"]
    validation = {0.5 * linear: 0.985, linear: 0.985, 2 * linear: 0.98}  # the low edge ties the inside
    screen = screen_runs(runs_dir, ["mnist"])
    for run in screen:
        _central(runs_dir, run, test=0.5, validation=validation.get(run.settings["lr"], 0.9)
                 if run.settings["model"] == "scatter-linear" else 0.9)
    assert screen_runs(runs_dir, ["mnist"]) == screen
    assert chosen_network(runs_dir, "mnist")["lr"] == linear


def test_the_normalisation_is_chosen_on_validation_and_a_tie_keeps_groupnorm(tmp_path):
    """At the chosen network (here CIFAR-10's, Tramèr & Boneh's lr the best), dpsgd on validation under
    GroupNorm and under private statistics; the better is the setting every method confirms, a
    tie keeps GroupNorm (it spends no ε). Rows confirmed under the other stay in the table,
    marked as not chosen."""
    from simulations.features_table import (TB_SETTINGS, FeatureRun, chosen, confirm_runs, norm_runs,
                                            write_features_table)

    runs_dir = tmp_path / "runs" / "features"
    tb = TB_SETTINGS["cifar10"][0]
    _screen_done(runs_dir, "cifar10", best=0.66)  # the GroupNorm run at TB's lr is the screen's
    group, private = norm_runs(runs_dir, ["cifar10"])
    assert (group.settings, private.settings) == (tb, {**tb, "feature_norm": "private"})
    assert {group.validation, private.validation, group.seed, private.seed} == {10_000, 0}
    assert private.name == "cifar10-scatter-cnn-B8192-lr4-e85-private-norm-dpsgd-val-seed0"
    assert private.config(1, "cpu", None)["feature_norm"] == "private" \
        and "feature_norm" not in group.config(1, "cpu", None)
    assert chosen(runs_dir, "cifar10") is None and confirm_runs(runs_dir, ["cifar10"], 1) == []
    _central(runs_dir, private, test=0.5, validation=0.66)
    assert chosen(runs_dir, "cifar10") == tb  # a tie
    import shutil

    shutil.rmtree(runs_dir / private.name)
    _central(runs_dir, private, test=0.5, validation=0.68)
    assert chosen(runs_dir, "cifar10") == private.settings
    assert {r.settings["feature_norm"] for r in confirm_runs(runs_dir, ["cifar10"], 1)} == {"private"}
    _central(runs_dir, FeatureRun("cifar10", tb, "dpsgd", 0), 0.668)  # confirmed before the stage: kept, not chosen
    _central(runs_dir, FeatureRun("cifar10", private.settings, "dpsgd", 0), 0.69)
    write_features_table(runs_dir, tmp_path, seeds=1)
    rows = {r["feature_norm"]: r for r in json.loads((tmp_path / "table-features.json").read_text())["confirmed"]}
    assert (rows["private"]["chosen"], rows["group"]["chosen"]) == (True, False)
    assert rows["private"]["mean"] == pytest.approx(69.0)
    md = (tmp_path / "table-features.md").read_text()
    assert "| cifar10 | dpsgd | scatter-cnn, 8192, 4, 85, private statistics | validation |" in md
    assert "| cifar10 | dpsgd | scatter-cnn, 8192, 4, 85, GroupNorm | not chosen" in md
    assert "| cifar10 | dpsgd | scatter-cnn | 8192 | 4 | 85 | private statistics | 68.00 |" in md
