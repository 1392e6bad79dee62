"""The validated recipes (fedsd/recipes/*.toml), `fedsd train --recipe NAME`, `fedsd simulate --recipe NAME` and
`fedsd recipes`: a recipe's values reach the run's settings exactly, through the declared settings
(fedsd.settings.declared.typed_values), flags take their place, and a bad file is refused naming
the file and the key. No training: the runs are planned under FEDSD_DRY_RUN."""
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedsd.settings import recipe_files
from fedsd.cli.main import build_parser, main
from fedsd.cli.train import config_from_args
from fedsd.errors import ConfigError
from fedsd.settings.declared import settings_of
from fedsd.settings.federation import FedConfig
from fedsd.settings.run import TrainConfig, check_method_settings, validate
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "fedsd" / "recipes").glob("*.toml"))
FEATURES_FMNIST_RUN = ROOT / "results/runs/features/fmnist-scatter-linear-B8192-lr8-e50-dpsgd-seed0/result.json"
# The settings of a machine, not of a recipe: the committed runs were given --device cpu and
# --threads 1 by their driver (simulations/features_table.py, paper_tables), a recipe
# leaves them to the machine (auto: the CPU where there is no GPU; 0: torch's threads). The
# clipping route (grad_sample_mode, memory_format) gives the same weights to float rounding and
# was chosen per machine by older versions (a mnist dpkd run recorded bk); seed and data_dir are
# the command line's.
MACHINE = {"device", "threads", "grad_sample_mode", "memory_format", "data_dir", "seed"}


def recipe_args(*argv: str):
    """The parsed command line with the recipe's values filled in (what cmd_train/cmd_simulate see)."""
    args = build_parser().parse_args(list(argv))
    recipe_files.with_recipe(args, argv[0])
    return args


def differing(a: TrainConfig, b: TrainConfig) -> dict:
    return {s.name: (getattr(a, s.name), getattr(b, s.name)) for s in settings_of(TrainConfig)
            if getattr(a, s.name) != getattr(b, s.name)}


def test_there_are_the_recipes_the_tables_validated():
    assert {"features-mnist", "features-fmnist", "features-cifar10", "distributed-features",
            "distributed-cnn"} <= set(RECIPES)
    assert {f"table1-{d}-{m}" for d in ("mnist", "fmnist", "cifar10")
            for m in ("dpsgd", "dpkd", "dpema", "dp3sd", "dpdsd")} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_reads_validates_and_says_where_it_was_validated(name):
    path = ROOT / "fedsd" / "recipes" / f"{name}.toml"
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert set(tomllib.loads(path.read_text())) <= set(app_config)  # keys exactly as Flower's run config has them
    recipe = recipe_files.read_recipe(path)
    assert recipe.about and recipe.validated
    results_file = recipe.validated.split(",")[0]
    assert (ROOT / results_file).is_file(), f"{name}: validated in {results_file}, which is not there"
    for run_glob in [w.strip("()\"") for w in recipe.validated.split() if w.startswith("(results/runs/")]:
        assert list(ROOT.glob(run_glob.rstrip(")"))), f"{name}: no committed run {run_glob}"
    values = {n: v for n, (s, v) in recipe.values.items()}
    cfg = TrainConfig(**{k: v for k, v in values.items() if hasattr(TrainConfig, k)}, **(
        {} if "epsilon" in values else {"epsilon": 3.0})).resolved()
    validate(cfg, num_train=50_000)
    check_method_settings(cfg)
    FedConfig(**{k: v for k, v in values.items() if k in {s.name for s in settings_of(FedConfig)}}).validate()


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_plans_its_run(name, tmp_path, monkeypatch, capsys):
    """The dry-run machinery: every check the command makes before its first step, on the data."""
    recipe = recipe_files.read_recipe(ROOT / "fedsd" / "recipes" / f"{name}.toml")
    require(recipe.values["dataset"][1])
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    epsilon = [] if "epsilon" in recipe.values else ["--epsilon", "1"]
    assert main([recipe.command, "--recipe", name, *epsilon, "--out", str(tmp_path / "run")]) == 0
    assert "dry run: every check passed" in capsys.readouterr().out


def test_features_fmnist_reaches_the_settings_of_the_committed_seed0_run():
    """The issue's done-when: `--recipe features-fmnist --seed 0` is the committed run (89.62)."""
    saved = json.loads(FEATURES_FMNIST_RUN.read_text())
    assert saved["test_accuracy"] == 0.8962 and saved["seed"] == 0
    committed = TrainConfig.from_dict(saved["config"])
    ours = config_from_args(recipe_args("train", "--recipe", "features-fmnist", "--seed", "0", "--out", "x"))
    assert differing(ours, committed) == {"device": ("auto", "cpu"), "threads": (0, 1)}
    assert differing(ours.resolved(), committed.resolved()) == {"device": ("auto", "cpu"), "threads": (0, 1)}


@pytest.mark.parametrize("name, run", [
    ("features-mnist", "mnist-scatter-linear-B4096-lr4-e55-private-norm-dpema-seed0"),
    ("features-cifar10", "cifar10-scatter-cnn-B8192-lr4-e85-private-norm-dpsgd-seed0"),
])
def test_features_recipes_are_their_committed_runs(name, run):
    committed = TrainConfig.from_dict(
        json.loads((ROOT / "results/runs/features" / run / "result.json").read_text())["config"])
    ours = config_from_args(recipe_args("train", "--recipe", name, "--seed", "0", "--out", "x"))
    assert set(differing(ours.resolved(), committed.resolved())) <= MACHINE


def test_the_adaptive_recipe_is_its_tables_committed_run():
    """features-fmnist-adaptive: the adaptive table's normalized arm from 10× C (a quantile in place
    of a tuned C), its committed seed-0 run's settings but the machine's."""
    run = ROOT / "results/runs/adaptive/features-fmnist-q0.7-from10x-normalized-seed0/result.json"
    committed = TrainConfig.from_dict(json.loads(run.read_text())["config"])
    ours = config_from_args(recipe_args("train", "--recipe", "features-fmnist-adaptive", "--seed", "0", "--out", "x"))
    assert set(differing(ours.resolved(), committed.resolved())) <= MACHINE
    assert ours.clip_quantile == 0.7 and ours.clip_normalize


@pytest.mark.parametrize("name", [n for n in RECIPES if n.startswith("table1-")])
@pytest.mark.parametrize("epsilon", ["1", "2", "3"])
def test_table1_recipes_are_the_tables_runs_at_each_epsilon(name, epsilon):
    dataset, method = name.split("-")[1:]
    saved = ROOT / "results/runs/table1" / f"{dataset}-{method}-eps{epsilon}-seed0" / "result.json"
    committed = TrainConfig.from_dict(json.loads(saved.read_text())["config"])
    ours = config_from_args(recipe_args("train", "--recipe", name, "--epsilon", epsilon, "--out", "x"))
    assert set(differing(ours.resolved(), committed.resolved())) <= MACHINE


@pytest.mark.parametrize("name", ["distributed-features", "distributed-cnn"])
def test_distributed_recipes_are_the_tables_runs(name):
    run = {"distributed-features": "fmnist-iid-t10-seed0", "distributed-cnn": "fmnist-cnn-iid-t10-seed0"}[name]
    saved = json.loads((ROOT / "results/runs/distributed" / run / "result.json").read_text())
    args = recipe_args("simulate", "--recipe", name, "--out", "x")
    ours = config_from_args(args)
    committed = TrainConfig.from_dict(saved["config"])
    # a federation's epochs are derived from its rounds (the saved config holds the derived length)
    assert set(differing(ours.resolved(), committed.resolved())) <= MACHINE | {"epochs"}
    fed = FedConfig(**{s.name: getattr(args, s.name) for s in settings_of(FedConfig) if hasattr(args, s.name)})
    assert fed == FedConfig.from_dict(saved["federation"])


def test_flags_take_the_place_of_the_recipes_values():
    args = recipe_args("train", "--recipe", "features-fmnist", "--seed", "3", "--lr", "2", "--epochs", "5",
                       "--out", "elsewhere")
    cfg = config_from_args(args)
    assert (cfg.seed, cfg.lr, cfg.epochs, args.out) == (3, 2.0, 5, "elsewhere")
    assert (cfg.batch_size, cfg.model, cfg.features, cfg.momentum) == (8192, "scatter-linear", "scatter", 0.9)
    assert set(args.from_recipe) == {"dataset", "method", "epsilon", "features", "model", "feature_norm",
                                     "batch_size", "clip", "momentum"}


def test_a_recipe_may_be_a_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('dataset = "mnist"\nmethod = "dpsgd"\nepsilon = 2\n')
    cfg = config_from_args(recipe_args("train", "--recipe", str(path), "--out", "x"))
    assert (cfg.dataset, cfg.method, cfg.epsilon) == ("mnist", "dpsgd", 2.0) and type(cfg.epsilon) is float


@pytest.mark.parametrize("text, says", [
    ('batch-sise = 64\n', "batch-sise: not a setting; did you mean batch-size?"),
    ('lr = "fast"\n', "lr: expects a number, got 'fast'"),
    ('batch-size = 64.5\n', "batch-size: expects an integer, got 64.5"),
    ('download = "yes"\n', "download: expects true or false"),
    ('method = "dpfoo"\n', "method: unknown value 'dpfoo'; choose one of"),
    ('lr = nan\n', "lr: expects a finite number"),
    ('out-dir = "x"\n', "out-dir: not given by a command or a recipe"),
    ('num-clients = 4\nclients = 5\n', "clients: given twice"),
    ('resume-dir = "x"\n', "resume-dir: a recipe starts a run"),
    ('[train]\nlr = 3.0\n', "[train]: a recipe holds settings only"),
    ('lr = \n', "not a TOML file"),
])
def test_a_bad_recipe_is_refused_naming_the_file_and_the_key(tmp_path, capsys, text, says):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--recipe", str(path), "--epsilon", "3", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and says in err, err


def test_a_value_the_settings_checks_refuse_names_the_file_and_the_key(tmp_path, capsys, monkeypatch):
    require("fmnist")
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    path = tmp_path / "bad.toml"
    path.write_text('dataset = "fmnist"\nmethod = "dpsgd"\nepsilon = 3.0\nlr = -1.0\nbatch-size = 100000\n')
    assert main(["train", "--recipe", str(path), "--lr", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: batch-size: must not exceed the 60000 training samples" in err, err
    # the same value given as a flag is the flag's
    assert main(["train", "--recipe", str(path), "--lr", "-1", "--batch-size", "10", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "error: --lr: must be a finite number > 0" in err and str(path) not in err, err


def test_a_missing_recipe_names_where_it_looked(tmp_path, capsys, monkeypatch):
    assert main(["train", "--recipe", "features-fmnsit", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"no recipe {ROOT / 'fedsd' / 'recipes' / 'features-fmnsit.toml'}; did you mean features-fmnist?" in err, err
    assert main(["train", "--recipe", str(tmp_path / "none.toml"), "--out", str(tmp_path / "r")]) == 2
    assert f"--recipe {tmp_path / 'none.toml'}: no such file" in capsys.readouterr().err
    # an installation that lacks its package data
    monkeypatch.setattr(recipe_files, "RECIPES_DIR", tmp_path / "site-packages" / "recipes")
    assert main(["train", "--recipe", "features-fmnist", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"no recipes folder at {tmp_path / 'site-packages' / 'recipes'}" in err and "path of a .toml" in err, err
    assert main(["recipes"]) == 2


def test_a_federated_recipe_is_refused_by_train(tmp_path, capsys):
    assert main(["train", "--recipe", "distributed-cnn", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "distributed-cnn.toml: num-clients, num-server-rounds, partition, secure-aggregation, noise, " \
           "honest-clients: a federation's settings" in err and "fedsd simulate --recipe distributed-cnn" in err, err


def test_a_recipe_does_not_resume(tmp_path, capsys):
    assert main(["train", "--recipe", "features-fmnist", "--resume", str(tmp_path)]) == 2
    assert "--recipe starts a run; --resume DIR goes on with one" in capsys.readouterr().err


def test_fedsd_recipes_lists_every_file(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{len(RECIPES)} recipes in {ROOT / 'fedsd' / 'recipes'}")
    listed = [line.split()[0] for line in out[1:]]
    assert listed == RECIPES
    for line in out[1:]:
        name, command = line.split()[:2]
        assert command == ("simulate" if name.startswith("distributed-") else "train") \
            and "; validated: results/" in line


def test_the_recipe_option_is_in_the_help():
    for command in ("train", "simulate"):
        assert "--recipe NAME" in build_parser().commands[command].format_help()


def test_typed_values_read_a_file_as_the_flags_are_read():
    from fedsd.settings.declared import typed_values

    got = typed_values({"lr": 3, "clients": 4, "secure-aggregation": True}, TrainConfig, FedConfig)
    assert {n: v for n, (s, v) in got.items()} == {"lr": 3.0, "num_clients": 4, "secure_aggregation": True}
    assert type(got["lr"][1]) is float
    with pytest.raises(ConfigError, match="num-server-rounds: expects an integer, got '4'"):
        typed_values({"num-server-rounds": "4"}, FedConfig)


def test_the_recipes_committed_run_is_the_features_run():
    """results/recipes.md: `fedsd train --recipe features-fmnist --seed 0` run here and committed
    (results/runs/recipes/features-fmnist-seed0) lands on the committed features run's 89.62."""
    ours = json.loads((ROOT / "results/runs/recipes/features-fmnist-seed0/result.json").read_text())
    theirs = json.loads(FEATURES_FMNIST_RUN.read_text())
    assert abs(ours["test_accuracy"] - theirs["test_accuracy"]) <= 0.001
    assert differing(TrainConfig.from_dict(ours["config"]), TrainConfig.from_dict(theirs["config"])) == \
        {"device": ("auto", "cpu"), "threads": (0, 1)}


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_lists_the_recipes_and_runs_one(tmp_path):
    """A wheel built from the checkout holds the package alone, its recipes and the conv kernel's
    C as package data; installed into a fresh environment (the project's for its dependencies,
    never this checkout), `fedsd recipes` lists every recipe from the installed package and
    `fedsd train --recipe` runs one (as a dry run: every check, no training)."""
    import sysconfig
    import zipfile

    source = tmp_path / "source"  # a copy: building in the checkout would leave its build/ there
    for folder in ("fedsd", "simulations"):  # the studies have an __init__ too, and stay out of the wheel
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("fedsd-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"fedsd",
                                                f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert {f"fedsd/recipes/{r}.toml" for r in RECIPES} <= set(names) and "fedsd/clipping/conv_kernel.c" in names
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies from the project's environment: a path a .pth names is not a site folder,
    # so that environment's own .pth files (this checkout's editable install) are not read
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    with zipfile.ZipFile(wheel) as archive:  # a pure-Python wheel installed as pip would lay it out
        archive.extractall(site)
    python, env = venv / "bin" / "python", {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([python, "-c", "import fedsd; print(fedsd.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(site / "fedsd" / "__init__.py"), where.stdout + where.stderr[-2000:]
    listed = subprocess.run([python, "-m", "fedsd.cli.main", "recipes"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.splitlines()[0].startswith(f"{len(RECIPES)} recipes in {site / 'fedsd' / 'recipes'}")
    dry = subprocess.run([python, "-m", "fedsd.cli.main", "train", "--recipe", "features-fmnist", "--out",
                          str(tmp_path / "run")], cwd=tmp_path, env={**env, "FEDSD_DRY_RUN": "1"},
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0 and "dry run" in (dry.stdout + dry.stderr).lower(), (dry.stdout + dry.stderr)[-3000:]
    assert not (tmp_path / "run").exists()
    studies = subprocess.run([python, "-m", "fedsd.cli.main", "reproduce", "--table", "1"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
    assert studies.returncode != 0 and "a checkout's simulations/" in studies.stderr, studies.stderr[-2000:]
