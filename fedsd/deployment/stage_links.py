"""Where a deployed secure round's time goes, link by link: for each stage of each round, from the
server's record (secure-aggregation.json: when the stage was sent and when its last reply was
in, wall clock) and the owners' data-service logs (when each took the stage's message and when
it had answered):

- **to owner**: sent → the owner's service took it (the grid's push, the SuperLink, the SuperNode's
  pull, its ClientApp task's start and its forward), the median over owners;
- **owner**: took → answered (the owner's own work), the median;
- **spread**: the first owner's take to the last one's (nodes picking the message up one after
  another on shared cores);
- **to server**: the last answer → the stage's end (the reply's push, the SuperLink, the grid's pull).

    python -m fedsd.deployment.stage_links W/deployment/logs O/secure-aggregation.json

One machine's clocks, so the differences are the links' times (to the logs' millisecond).
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) fedsd data-service INFO: "
                  r"(took|answered) a secagg-(\w+) message")
LINKS = ("to_owner", "owner", "spread", "to_server")


def owner_events(logs: Path) -> list[tuple[float, str, str]]:
    """(wall time, took/answered, stage) of every data service's log in `logs`."""
    events = []
    for log in sorted(Path(logs).glob("data-service-*.log")):
        service = log.stem
        for line in log.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            try:
                at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None
            except ValueError:  # a line that looks like one and is not a time
                at = None
            if at is not None:
                events.append((at, m.group(2), m.group(3), service))
    return events


def stage_links(logs: Path, record: Path) -> list[dict]:
    """Each round's stages, each with its seconds and LINKS (None where no owner logged it)."""
    events = owner_events(logs)
    rounds = []
    for r in json.loads(Path(record).read_text()):
        stages = {}
        for stage, s in r.get("stages", {}).items():
            if "started_at" not in s:
                continue
            window = [e for e in events if e[2] == stage and s["started_at"] - 0.01 <= e[0] <= s["ended_at"] + 0.01]
            took = {e[3]: e[0] for e in window if e[1] == "took"}
            answered = {e[3]: e[0] for e in window if e[1] == "answered" and e[3] in took}
            links = dict.fromkeys(LINKS)
            if answered:
                links.update(to_owner=statistics.median(t - s["started_at"] for t in took.values()),
                             owner=statistics.median(answered[k] - took[k] for k in answered),
                             spread=max(took.values()) - min(took.values()),
                             to_server=s["ended_at"] - max(answered.values()))
            stages[stage] = dict(seconds=s["seconds"], **links)
        rounds.append(dict(round=r["round"], stages=stages))
    return rounds


def table(rounds: list[dict], first: int = 2) -> str:
    """A Markdown table of each stage's median over rounds `first`… (round 1 builds the features)."""
    later = [r for r in rounds if r["round"] >= first] or rounds
    names = list(dict.fromkeys(name for r in later for name in r["stages"]))
    lines = ["| stage | seconds | to owner | owner | spread | to server |", "|---|---|---|---|---|---|"]
    for name in names:
        cells = []
        for key in ("seconds",) + LINKS:
            values = [r["stages"][name][key] for r in later
                      if name in r["stages"] and r["stages"][name][key] is not None]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(stage_links(Path(args[0]), Path(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
