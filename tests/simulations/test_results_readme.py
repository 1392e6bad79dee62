"""Every command in results/README.md, dry-run as written (FEDSD_DRY_RUN=1): each passes every
check its real run makes; a train or simulate command resolves to the epochs, B, lr, momentum
and σ that the line under it states (`# → …`); and a sweep or reproduce command finds every run
it would make already in its folder, finished with exactly these settings (nothing to run), so
the text cannot drift from what the command now does (a command that said 60 epochs
trained 30, with another momentum)."""
import re
import shlex
from pathlib import Path

import pytest

from fedsd.cli.main import main
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
# What a train or simulate command's dry run says it would run, and the `# → …` line that states it.
WOULD = re.compile(r"(\d+) epochs.*? at B = (\d+), lr ([\d.e+-]+), momentum ([\d.]+), σ=([\d.–]+)")
STATED = re.compile(r"# → (\d+) epochs, B = (\d+), lr ([\d.e+-]+), momentum ([\d.]+), σ = ([\d.–]+)$")


def results_commands() -> list[tuple[str, str | None]]:
    """(command, its stated resolution or None): each `fedsd` line of results/README.md's code
    (indented or fenced), continuations joined, a leading `OMP_NUM_THREADS=1 nice -n 19` and a
    trailing comment dropped."""
    lines = (ROOT / "results" / "README.md").read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        line = re.sub(r"^(OMP_NUM_THREADS=\d+ )?(nice -n \d+ )?", "", lines[i].strip())
        if line.startswith("fedsd ") and (lines[i].startswith("    ") or "`" not in lines[i]):
            while line.endswith("\\"):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            stated = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].strip().startswith("# →") else None
            found.append((line.split("  #")[0].strip(), stated))
        i += 1
    return found


COMMANDS = results_commands()


def test_every_train_and_simulate_command_states_what_it_resolves_to():
    assert len(COMMANDS) >= 30
    for command, stated in COMMANDS:
        if command.split()[1] in ("train", "simulate"):
            assert stated is not None and STATED.search(stated), f"no '# → …' line under {command!r}"


@pytest.mark.slow
@pytest.mark.parametrize("command, stated", COMMANDS, ids=[" ".join(c.split()[1:5]) for c, _ in COMMANDS])
def test_results_command_passes_its_checks_and_resolves_as_stated(command, stated, tmp_path, monkeypatch, capsys,
                                                                  data_root):
    """Where MNIST or CIFAR-10 is not on this machine, against stand-ins of their shapes and sizes
    (conftest's data_root): a dry run checks the data's sizes and the σ they give, not its pixels."""
    from fedsd.data import datasets as data_lib

    require("fmnist")
    args = shlex.split(command)[1:]
    if data_lib.locate("mnist") is None or data_lib.locate("cifar10") is None:
        monkeypatch.setenv("FEDSD_DATA_DIR", str(data_root))
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    if args[0] in ("train", "simulate") and "--out" in args:  # its folder in results/ holds the finished run
        args[args.index("--out") + 1] = str(tmp_path / "run")
    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "dry run: every check passed; would " in out.out, out.out[-2000:]
    if stated is not None:
        assert WOULD.search(out.out).groups() == STATED.search(stated).groups(), (out.out, stated)
    elif args[0] in ("sweep", "reproduce"):
        assert re.search(r"would (run|simulate) 0 of \d+ ", out.out), out.out  # every run in its folder, as written


def test_the_python_in_results_readme_prints_what_its_last_comment_says(capsys, monkeypatch):
    """results/README.md's Python blocks (the anchors' ε with every step charged; the recipes'
    best epochs, read from their runs) run as written and print the numbers their last line
    states (`# a / b / c`: each printed line, in order), so the README cannot drift from the
    computation it shows."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "results" / "README.md").read_text(), re.S)
    assert len(blocks) >= 2, "results/README.md's Python blocks are gone"
    monkeypatch.chdir(ROOT)  # they read results/runs/ as a reader at the repository's root would
    for block in blocks:
        stated = block.strip().splitlines()[-1]
        assert stated.startswith("# "), f"a Python block's last line states its output: {stated!r}"
        exec(compile(block, "results/README.md", "exec"), {})
        printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert printed == [part.strip() for part in stated[2:].split(" / ")]
