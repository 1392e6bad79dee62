"""A method from another package (tests/plugins/fedsd-smooth), installed into an environment of
its own beside fedsd: it appears in `fedsd train --help` with its setting, trains, and is
checked like fedsd's own, with nothing in fedsd changed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "tests" / "plugins" / "fedsd-smooth"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The plugin installed (built as a wheel, with its entry point) into a folder of its own."""
    site = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("build") / PLUGIN.name  # built from a copy: nothing left in the tree
    shutil.copytree(PLUGIN, source)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert list(site.glob("fedsd_smooth-1.0.0.dist-info/entry_points.txt"))
    return site


def fedsd(site, *args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "fedsd.cli.main", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_a_plugin_method_is_an_option_of_fedsd_and_trains(site, tmp_path):
    require("fmnist")
    helped = fedsd(site, "train", "--help", cwd=tmp_path)
    text = " ".join(helped.stdout.split())
    assert "dpsmooth" in text and "--label-smoothing X dpsmooth: the cross-entropy's label smoothing (default: 0.1, " \
                                  "the plugin's)" in text
    out = tmp_path / "run"
    trained = fedsd(site, "train", "--method", "dpsmooth", "--dataset", "fmnist", "--subset", "2000", "--epochs", "2",
                    "--batch-size", "200", "--lr", "2", "--epsilon", "3", "--threads", "1", "--quiet",
                    "--out", str(out), cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["method"] == "dpsmooth" and result["config"]["label_smoothing"] == 0.1
    assert result["test_accuracy"] > 0.5, result["test_accuracy"]  # chance: 0.1
    refused = fedsd(site, "train", "--method", "dpsmooth", "--dataset", "fmnist", "--label-smoothing", "1.5",
                    "--epsilon", "3", "--out", str(tmp_path / "bad"), cwd=tmp_path)
    assert refused.returncode == 2 and "--label-smoothing: must be in [0, 1), got 1.5" in refused.stderr
    other = fedsd(site, "train", "--method", "dpsgd", "--dataset", "fmnist", "--label-smoothing", "0.2",
                  "--epsilon", "3", "--out", str(tmp_path / "bad"), cwd=tmp_path)
    assert other.returncode == 2 and "--label-smoothing: a setting of dpsmooth, not of --method dpsgd" in other.stderr
    without = subprocess.run([sys.executable, "-m", "fedsd.cli.main", "train", "--help"], capture_output=True,
                             text=True, cwd=ROOT)
    assert "dpsmooth" not in without.stdout  # fedsd itself is unchanged
