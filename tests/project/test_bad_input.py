"""Every bad option gives one clear error naming it, before any work, and writes nothing."""
import pytest
from torch import nn

from fedsd.training.central import train
from fedsd.settings.run import TrainConfig
from fedsd.models.networks import check_private_trainable
from fedsd.errors import FedsdNote, ModelNotPrivateError
from fedsd.cli.main import main
from tests.conftest import require

BASE = ["train", "--dataset", "fmnist", "--method", "dp3sd", "--epochs", "1", "--subset", "1000", "--batch-size", "100"]


@pytest.mark.parametrize("extra,needle", [
    (["--epsilon", "0"], "--epsilon"),
    (["--epsilon", "-1"], "--epsilon"),
    (["--epsilon", "3", "--delta", "0"], "--delta"),
    (["--epsilon", "3", "--delta", "0.001"], "--delta"),  # ≥ 1/n for n = 1000
    (["--epsilon", "3", "--dp3sd-tau-s", "0"], "--dp3sd-tau-s"),
    (["--epsilon", "3", "--dp3sd-tau-t", "-2"], "--dp3sd-tau-t"),
    (["--epsilon", "3", "--dp3sd-alpha", "-0.1"], "--dp3sd-alpha"),
    (["--epsilon", "3", "--dp3sd-alpha", "1.5"], "--dp3sd-alpha"),  # dp3sd: α ∈ [0, 1]
    (["--epsilon", "3", "--batch-size", "5000"], "--batch-size"),
    (["--epsilon", "3", "--lr", "0"], "--lr"),
    (["--epsilon", "3", "--subset", "0"], "--subset"),
    (["--epsilon", "0.00001", "--epochs", "50"], "--epsilon"),  # no σ fits: refused, not cut short
])
def test_bad_option_is_named_and_nothing_written(tmp_path, capsys, extra, needle):
    require("fmnist")
    out = tmp_path / "out"
    assert main(BASE + extra + ["--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra,needle", [
    (["--method", "dpdsd", "--dpdsd-beta", "-1"], "--dpdsd-beta"),
    (["--method", "dpdsd", "--dpdsd-tau", "0"], "--dpdsd-tau"),
])
def test_bad_dpdsd_options(tmp_path, capsys, extra, needle):
    require("fmnist")
    args = ["train", "--dataset", "fmnist", "--epsilon", "3", "--subset", "1000", "--batch-size", "100"] + extra
    assert main(args + ["--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("extra,reason", [
    (["--method", "dpkd", "--release", "ema"], "dpkd releases its student"),
    (["--method", "dpema", "--release", "student"], "use --method dpsgd"),
    (["--method", "dpdsd", "--release", "ema", "--ema-decay", "1"], "must be in [0, 1)"),
])
def test_a_release_a_method_cannot_take_is_refused_with_the_reason(tmp_path, capsys, extra, reason):
    require("fmnist")
    args = ["train", "--dataset", "fmnist", "--epsilon", "3", "--epochs", "2", "--subset", "1000",
            "--batch-size", "100"] + extra
    assert main(args + ["--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert reason in err and ("--release" in err or "--ema-decay" in err) and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,value", [("--dataset", "svhn"), ("--method", "dpfoo"), ("--accountant", "gdp")])
def test_unknown_choices(tmp_path, capsys, flag, value):
    args = ["train", "--epsilon", "3", "--out", str(tmp_path / "o"), flag, value]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_unknown_dataset_in_the_library():
    with pytest.raises(ValueError, match="--dataset"):
        train(TrainConfig(dataset="svhn"))


@pytest.mark.slow
def test_non_empty_out_is_refused_unless_overwrite(tmp_path, capsys):
    require("fmnist")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(BASE + ["--epsilon", "3", "--out", str(out), "--quiet"]) == 2
    assert "--out" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(BASE + ["--epsilon", "3", "--out", str(out), "--quiet", "--overwrite", "--batch-size", "500"]) == 0
    assert not (out / "keep.txt").exists() and (out / "result.json").exists()


def test_batchnorm_model_is_refused_or_fixed():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ModelNotPrivateError, match="BatchNorm"):
        check_private_trainable(model)
    with pytest.warns(FedsdNote, match=r"replaced 1 layer\(s\) \(BatchNorm2d → GroupNorm: 1\)"):
        fixed = check_private_trainable(model, fix=True)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fixed.modules())


def test_a_bug_keeps_its_traceback_and_bad_input_is_one_line(monkeypatch, capsys):
    """The CLI prints a UserError (what the user can fix) as one line and exit code 2; any other
    exception is a bug and reaches the user whole, with its traceback, even a ValueError."""
    import fedsd.cli.main as cli
    from fedsd.errors import ConfigError

    def raising(error):
        def command(args):
            raise error
        return command

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    action = next(a for a in parser._subparsers._group_actions if a.choices)
    train_parser = action.choices["train"]
    train_parser.set_defaults(func=raising(ConfigError("--lr: must be > 0, got 0")))
    assert cli.main(["train", "--epsilon", "3", "--out", "x"]) == 2
    assert capsys.readouterr().err.strip() == "fedsd train: error: --lr: must be > 0, got 0"
    train_parser.set_defaults(func=raising(ValueError("a bug's message")))
    with pytest.raises(ValueError, match="a bug's message"):
        cli.main(["train", "--epsilon", "3", "--out", "x"])


@pytest.mark.parametrize("extra,needle", [
    (["--method", "dp3sd", "--dpdsd-loss", "dkd"], "--dpdsd-loss: a setting of dpdsd, not of --method dp3sd"),
    (["--method", "dpsgd", "--teacher-every", "step"], "--teacher-every: a setting of dp3sd and dpdsd, not of "
                                                      "--method dpsgd"),
    (["--method", "dpdsd", "--dp3sd-kl-reduction", "mean"], "--dp3sd-kl-reduction: a setting of dp3sd, not of "
                                                            "--method dpdsd"),
    (["--method", "dpsgd", "--dpkd-alpha", "0.3"], "--dpkd-alpha: a setting of dpkd, not of --method dpsgd"),
    (["--method", "dpsgd", "--alpha", "0.3"], "--alpha: renamed in fedsd 0.2, by method: --dp3sd-alpha (dp3sd), "
                                              "--dpdsd-alpha (dpdsd), --dpkd-alpha (dpkd); --method dpsgd has none"),
    (["--method", "dpsgd", "--ema-warmup", "off"], "--ema-warmup: the released EMA's setting; this run releases its "
                                                  "student (use --method dpema or --release ema)"),
    (["--method", "dp3sd", "--ema-decay", "0.9"], "--ema-decay: the released EMA's setting"),
])
def test_a_reading_that_does_not_apply_to_the_method_is_refused_with_both_named(tmp_path, capsys, extra, needle):
    require("fmnist")
    out = tmp_path / "out"
    assert main(BASE[:3] + BASE[5:] + ["--epsilon", "3"] + extra + ["--out", str(out), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert needle in err and "Traceback" not in err
    assert not out.exists()
