"""fedsd.deployment.stage_links: a deployed secure round's stages split by link, from the server's
record and the owners' data-service logs (one machine's clock)."""
import json
from datetime import datetime

from fedsd.deployment.stage_links import stage_links, table


def _line(at: float, what: str, stage: str) -> str:
    stamp = datetime.fromtimestamp(at).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"{stamp} fedsd data-service INFO: {what} a secagg-{stage} message\n"


def test_each_stage_is_split_into_the_way_to_the_owner_its_work_and_the_way_back(tmp_path):
    t0 = 1_800_000_000.0
    # two owners: the confirm stage sent at t0, taken at +1.2 and +1.6, answered 0.1 s later; in at +2.5
    for k, took in enumerate((1.2, 1.6)):
        (tmp_path / f"data-service-{k}.log").write_text(
            _line(t0 - 5, "took", "confirm") + _line(t0 - 4.9, "answered", "confirm")  # the round before's
            + _line(t0 + took, "took", "confirm") + _line(t0 + took + 0.1, "answered", "confirm")
            + "2026-12-05 00:00:00,000 fedsd data-service WARNING: something else\n")
    record = tmp_path / "secure-aggregation.json"
    record.write_text(json.dumps([{"round": 2, "stages": {
        "confirm": {"seconds": 2.5, "started_at": t0, "ended_at": t0 + 2.5},
        "unmask": {"seconds": 1.0, "started_at": t0 + 3, "ended_at": t0 + 4}}}]))
    [r] = stage_links(tmp_path, record)
    confirm = r["stages"]["confirm"]
    assert abs(confirm["to_owner"] - 1.4) < 0.002 and abs(confirm["owner"] - 0.1) < 0.002
    assert abs(confirm["spread"] - 0.4) < 0.002 and abs(confirm["to_server"] - 0.8) < 0.002
    assert r["stages"]["unmask"]["owner"] is None  # no owner logged it: not made up
    assert "| confirm | 2.50 | 1.40 | 0.10 | 0.40 | 0.80 |" in table([r])
