"""Every command in the README, run exactly as written, so the README cannot drift from what
works. Long commands (a 60-epoch run, the papers' tables) run under FEDSD_DRY_RUN=1: every check
they make before their first step (options, data, σ for every client, the result folder), then
a stop. `make run` and the `flwr run .` line (tests/simulation/test_federated.py) run for real; `make test`
and `make test-fast` are what CI runs (.ci/run)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedsd import cache_root
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def readme_commands() -> list[str]:
    """The shell lines of the README's ```bash blocks, continuations joined, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_the_readme_lists_the_commands_this_file_runs():
    """A command added to the README without a way to run it here fails this test."""
    commands = readme_commands()
    assert commands, "no ```bash block found in README.md"
    for line in commands:
        runs_here = (line.startswith(("fedsd ", "scripts/deploy-local.sh ", "flwr run . ", "source .venv/bin/activate"))
                     or line in ("make run", "make test", "make test-fast", "flwr run ."))
        assert runs_here, f"README command not covered by tests/project/test_readme.py: {line!r}"


DRY = [line for line in readme_commands() if line.startswith(("fedsd ", "scripts/deploy-local.sh "))]


MY_NET = """from torch import nn


def make(num_classes, channels, image_size):
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * image_size ** 2, num_classes))
"""


@pytest.mark.parametrize("line", DRY, ids=[" ".join(shlex.split(d)[:4]) for d in DRY])
def test_readme_command_passes_every_check_as_written(line, tmp_path, data_root):
    """In a fresh folder, as a new user types it: every check passes and nothing is written."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    if "my_net:" in line:  # the README's own network, ./my_net.py, as the user has it
        (tmp_path / "my_net.py").write_text(MY_NET)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "FEDSD_DRY_RUN": "1", "PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT), "FEDSD_DATA_DIR": str(data_root), "HOME": str(data_root / "home"),
           "FEDSD_CACHE_DIR": str(cache_root())}  # the σ already calibrated on this machine, though HOME moved
    proc = subprocess.run(shlex.split(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "dry run: every check passed; would " in proc.stdout, proc.stdout[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "my_net.py") == ["scripts"], "a dry run wrote files"


@pytest.mark.slow
def test_make_run_as_written_trains_the_default_federation(tmp_path):
    """`make run`: the default federated simulation ends with a useful model and every client's
    ε at its target (result files in a private folder: RUN_OUT, so a user's runs/ is left alone)."""
    require("fmnist")
    import json

    out = tmp_path / "default"
    env = {**os.environ, "RUN_OUT": str(out)}
    proc = subprocess.run(["make", "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["num_clients"] == 10 and len(result["rounds"]) == 10
    assert result["test_accuracy"] > 0.74, result["test_accuracy"]
    assert all(2.9 < e <= 3.0 for e in result["rounds"][-1]["client_epsilon"].values())
    assert "test accuracy" in proc.stdout and "files" in proc.stdout
