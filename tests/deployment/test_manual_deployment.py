"""The manual deployment the doors describe, run as a user would paste it: server/README.md's and
clients/README.md's "Three owners by hand" blocks, in their order, in one bash at the checkout's
root. Three owners, each with its identity on one roster, its data service and its SuperNode; a
real SuperLink with TLS and node authentication; secure aggregation with distributed noise. Each
round is summed by all three, each owner's ledger is charged, and the summary names the owners."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOORS = (ROOT / "server" / "README.md", ROOT / "clients" / "README.md")
FIRST_LINE = "export W=/tmp/fedsd-three PORT=9093 && mkdir -p $W"


def walkthrough_blocks() -> list[tuple[int, str]]:
    """(step, bash) of every block a `<!-- three-owners N -->` line marks, from both doors, in step order."""
    blocks = []
    for path in DOORS:
        blocks += [(int(n), code) for n, code in
                   re.findall(r"<!-- three-owners (\d+) -->\n```bash\n(.*?)```", path.read_text(), re.S)]
    return sorted(blocks)


def test_the_walkthrough_is_five_steps_split_between_the_doors():
    steps = walkthrough_blocks()
    assert [n for n, _ in steps] == [1, 2, 3, 4, 5]
    assert steps[0][1].splitlines()[1] == FIRST_LINE
    server = DOORS[0].read_text()
    assert "<!-- three-owners 1 -->" in server and "<!-- three-owners 4 -->" in server
    assert "noise='distributed'" in steps[3][1] and "secure-aggregation=true" in steps[3][1]


def free_ports() -> int:
    """A port P with P and P + 10 … P + 12 free (the SuperLink's and the three SuperNodes')."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 60000 and all(_free(port + d) for d in (10, 11, 12)):
            return port
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.slow
def test_three_owners_by_hand_with_secure_aggregation_and_distributed_noise(tmp_path):
    work, port = tmp_path / "three", free_ports()
    script = "\n".join(code for _, code in walkthrough_blocks())
    script = script.replace(FIRST_LINE, f"export W={work} PORT={port} && mkdir -p $W")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = tmp_path / "terminal.txt"  # a file, not a pipe: what the blocks leave running keeps no pipe open
    with log.open("w") as terminal:
        proc = subprocess.Popen(["bash", "-eu", "-c", script], cwd=ROOT, env=env, stdout=terminal,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=900)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # the SuperLink, the services and the SuperNodes it left running
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    roster = (work / "roster").read_text().splitlines()
    assert [line.split()[0] for line in roster] == ["owner-0", "owner-1", "owner-2"], roster
    assert all(line.split()[1].startswith("ed25519:") for line in roster), roster
    rounds = json.loads((work / "run" / "secure-aggregation.json").read_text())
    assert [r["round"] for r in rounds] == [1, 2], out[-4000:]
    assert all(len(r["survivors"]) == 3 and r["abandoned"] is None for r in rounds), rounds
    spent = [float(s) for s in re.findall(r"spent\s+ε = ([0-9.]+) of the owner's 10 over 2 steps", out)]
    assert len(spent) == 3 and all(0 < s <= 3.0 + 1e-6 for s in spent), out[-3000:]
    result = json.loads((work / "run" / "result.json").read_text())
    assert result["num_clients"] == 3 and len(result["rounds"]) == 2, result["rounds"]
    assert sorted(result["client_names"].values()) == ["owner-0", "owner-1", "owner-2"], result["client_names"]
    # the independent check (bash -e: it exited 0) found each owner's released rounds charged
    check = json.loads(out[out.rindex("\n{\n"):])
    assert check["problems"] == [] and len(check["clients"]) == 3, check
    assert all(c["charged_rounds"] == c["released_rounds"] == [1, 2] for c in check["clients"].values()), check
