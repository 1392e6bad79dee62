"""deployed_distributed's --floor-rounds: Flower's floor on the run's own deployment, reported beside
the deployed rounds (the run itself: results/deploy-distributed.md; a whole run is too long for the
suite, so these check what the command reads and says)."""
import json

import pytest

from fedsd.deployment import deployed_distributed as dd


def test_the_floor_report_takes_the_medians_of_rounds_two_on(tmp_path, capsys):
    log = tmp_path / "rounds.jsonl"
    # round 1 builds each owner's features and sets the run up: never timed
    log.write_text("".join(json.dumps({"line": f"fedsd round {r}/5", "seconds": s, "at": r}) + "\n"
                           for r, s in enumerate([84.0, 3.1, 2.9, 2.7, 3.5], start=1)))
    report = dd.floor_report(log, [4.0, 1.2, 1.0, 1.1], dd.STEADY_EXCHANGES["multi-round"])
    assert report["floor_exchange_seconds"] == 1.1 and report["deployed_round_seconds"] == 3.0
    assert report["floor_round_seconds"] == [4.0, 1.2, 1.0, 1.1]
    said = capsys.readouterr().out
    assert "1.10 s an exchange (median of rounds 2–4)" in said and "a deployed round: 3.00 s" in said
    assert "2 exchanges each after the first" in said
    assert dd.floor_report(log, [], 2) == {}  # no floor asked for: deployment.json as before


@pytest.mark.parametrize("rounds", ["1", "-2"])
def test_a_floor_of_fewer_than_two_rounds_is_refused_before_anything_starts(tmp_path, capsys, rounds):
    with pytest.raises(SystemExit) as stop:
        dd.main(["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--floor-rounds", rounds])
    assert stop.value.code == 2
    assert f"--floor-rounds {rounds}: 0 (none) or at least 2" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no data split, no deployment folder
