"""Each setting is declared once (fedsd.settings.declared); the command line, the flat form and the Flower
app's defaults are derived from, or checked against, that declaration."""
import argparse
import tomllib
from pathlib import Path

import pytest

from fedsd.settings.run import RENAMED, TrainConfig
from fedsd.errors import ConfigError
from fedsd.settings.federation import FLOWER_APP_DEFAULTS, FedConfig, from_flat, to_flat
from fedsd.settings.declared import add_options, flags_to_keys, from_args, settings_of

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_app_config_is_the_declared_defaults():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    declared = {**to_flat(TrainConfig(), FedConfig()), **FLOWER_APP_DEFAULTS}
    old = {k.replace("_", "-") for k in RENAMED}  # fedsd 0.1's names, unset: read with a note this release
    assert {k: app_config[k] for k in old} == {k: "" if k == "kl-reduction" else -1 for k in old}
    app_config = {k: v for k, v in app_config.items() if k not in old}
    assert set(app_config) == set(declared), set(app_config) ^ set(declared)
    differing = {k: (app_config[k], declared[k]) for k in declared if app_config[k] != declared[k]}
    assert not differing, f"pyproject.toml (left) disagrees with the declared default (right): {differing}"


def _other_value(s):
    """A valid value for setting `s` that is not its default."""
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.type is bool:
        return not s.default
    if s.type is int:
        return 7 if s.default in (None, 0) else s.default + 3
    if s.type is float:
        return 0.375 if s.default in (None, 0.0) else s.default * 2 + 0.125
    return "some/folder"


@pytest.mark.parametrize("cls", [TrainConfig, FedConfig])
def test_flat_form_round_trips_every_setting(cls):
    changed = cls(**{s.name: _other_value(s) for s in settings_of(cls)})
    other = FedConfig() if cls is TrainConfig else TrainConfig()
    pair = (changed, other) if cls is TrainConfig else (other, changed)
    flat = to_flat(*pair)
    assert all(v is not None for v in flat.values())  # TOML and Flower's records have no None
    assert from_flat(flat) == pair
    assert from_flat(to_flat(TrainConfig(), FedConfig())) == (TrainConfig(), FedConfig())


def test_flat_form_types_come_from_the_annotations():
    cfg, fed = from_flat({"batch-size": "64", "lr": "0.5", "download": "true", "num-server-rounds": "4"})
    assert (cfg.batch_size, cfg.lr, cfg.download, fed.rounds) == (64, 0.5, True, 4)
    assert type(cfg.batch_size) is int and type(cfg.lr) is float
    with pytest.raises(ConfigError, match="batch-size: expects int"):
        from_flat({"batch-size": "many"})


def test_command_line_options_are_derived_and_unset_ones_keep_the_declared_default():
    parser = argparse.ArgumentParser()
    add_options(parser, TrainConfig)
    add_options(parser, FedConfig)
    args = parser.parse_args(["--dp3sd-tau-s", "0.2", "--clients", "3", "--rounds", "4", "--download",
                              "--resume", "runs/x"])
    assert from_args(TrainConfig, args) == TrainConfig(dp3sd_tau_s=0.2, download=True)
    assert from_args(FedConfig, args) == FedConfig(num_clients=3, rounds=4, resume_dir="runs/x")
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    for cls in (TrainConfig, FedConfig):
        assert {s.flag for s in settings_of(cls) if s.cli} <= flags
    with pytest.raises(SystemExit):  # choices come from the declaration
        parser.parse_args(["--partition", "sorted"])


def test_help_says_what_and_the_default(capsys):
    from fedsd.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "per-sample clipping norm C (default: the paper's value for the data set: MNIST 0.1" in text
    assert "--grad-sample-mode" in text and "(default: 'auto')" in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--clients N clients in the federation" in text and "(default: 10)" in text


def test_errors_name_the_setting_as_the_user_typed_it():
    message = "--batch-size: must be >= 1, got 0; --rounds: must be >= 1; --dp3sd-tau-s: a temperature must be > 0"
    assert flags_to_keys(message, TrainConfig, FedConfig) == (
        "batch-size: must be >= 1, got 0; num-server-rounds: must be >= 1; dp3sd-tau-s: a temperature must be > 0")


def test_the_default_length_is_the_one_chosen_for_the_data_set_at_that_epsilon():
    """--epochs unset: the length chosen on validation for the data set at the largest swept ε at
    or below the run's (below them all, the smallest's); a smaller budget is spent in fewer
    epochs; --epochs given is kept."""
    from fedsd.settings.run import EPOCHS_BY_EPSILON

    for dataset, chosen in EPOCHS_BY_EPSILON.items():
        swept = sorted(chosen)
        for eps in swept:
            assert TrainConfig(dataset=dataset, epsilon=eps).resolved().epochs == chosen[eps]
            assert TrainConfig(dataset=dataset, epsilon=eps + 0.5).resolved().epochs == chosen[eps]
        assert TrainConfig(dataset=dataset, epsilon=swept[0] / 2).resolved().epochs == chosen[swept[0]]
        assert [chosen[e] for e in swept] == sorted(chosen[e] for e in swept)
        assert TrainConfig(dataset=dataset, epsilon=swept[0], epochs=7).resolved().epochs == 7
    assert EPOCHS_BY_EPSILON["fmnist"][1] < EPOCHS_BY_EPSILON["fmnist"][3]  # results/sweeps/fmnist-dpsgd-eps1-length
    assert EPOCHS_BY_EPSILON["cifar10"][1] < EPOCHS_BY_EPSILON["cifar10"][3]  # results/sweeps/cifar10-dpsgd-eps1-length


# -- fedsd 0.1's method-setting names (alpha and tau each mean one method's) ---------
@pytest.mark.parametrize("method,old,new", [("dp3sd", "alpha", "dp3sd_alpha"), ("dpdsd", "alpha", "dpdsd_alpha"),
                                            ("dpkd", "alpha", "dpkd_alpha"), ("dpkd", "tau", "dpkd_tau"),
                                            ("dpdsd", "tau", "dpdsd_tau"), ("dp3sd", "tau_s", "dp3sd_tau_s")])
def test_an_old_flag_and_an_old_key_reach_the_methods_own_setting_with_a_note(method, old, new, capsys):
    from fedsd.cli.train import add_train_options, config_from_args
    from fedsd.errors import FedsdNote

    p = argparse.ArgumentParser()
    add_train_options(p, epsilon_required=False, out_required=False)
    flag, key = "--" + old.replace("_", "-"), old.replace("_", "-")
    with pytest.warns(FedsdNote, match=f"{flag}: renamed --{new.replace('_', '-')} in fedsd 0.2"):
        cfg = config_from_args(p.parse_args(["--method", method, flag, "0.25"]))
    assert getattr(cfg, new) == 0.25 and cfg == TrainConfig(method=method, **{new: 0.25})
    with pytest.warns(FedsdNote, match=f"{key}: renamed {new.replace('_', '-')} in fedsd 0.2"):
        flat_cfg, _ = from_flat({"method": method, key: 0.25})
    assert flat_cfg == cfg
    assert TrainConfig.from_dict({"method": method, old: 0.25}) == cfg  # a run 0.1 saved: quietly


def test_an_old_name_given_with_its_new_one_or_to_a_method_without_it_is_refused():
    from fedsd.cli.train import add_train_options, config_from_args

    p = argparse.ArgumentParser()
    add_train_options(p, epsilon_required=False, out_required=False)
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="--dp3sd-alpha: given twice"):
        config_from_args(p.parse_args(["--alpha", "0.2", "--dp3sd-alpha", "0.3"]))
    with pytest.raises(ConfigError, match="tau: renamed in fedsd 0.2, by method: dpdsd-tau .dpdsd., dpkd-tau .dpkd.; "
                                          "--method dp3sd has none"):
        from_flat({"method": "dp3sd", "tau": 2.0})


def test_help_lists_each_methods_settings_under_its_name():
    from fedsd.cli.main import build_parser

    text = build_parser().commands["train"].format_help()
    for method, flags in {"dp3sd": ("--dp3sd-tau-s", "--dp3sd-alpha"), "dpdsd": ("--dpdsd-tau", "--dpdsd-alpha"),
                          "dpkd": ("--dpkd-tau", "--dpkd-alpha", "--dpkd-teacher-epochs")}.items():
        section = text.split(f"{method}'s settings (--method {method}):")[1].split("\n\n")[0]
        assert all(f in section for f in flags), (method, section)
    assert "--alpha" not in text.replace("-alpha", "")  # the old names are taken, not shown
