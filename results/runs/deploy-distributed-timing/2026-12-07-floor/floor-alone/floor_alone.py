"""Flower's floor alone: ten SuperNodes under --isolate, as deployed_distributed starts them (each
owner's data service started, idle: no training run comes), Flower's in-memory SuperLink, scripts/floor
sending the features model's arrays. `kill -TERM` stops every process and namespace it started.

    python floor_alone.py WORK 10 40 isolate [PULL_INTERVAL]    # WORK/floor/floor.json
"""
import statistics
import sys
from pathlib import Path

from fedsd.deployment.local_deployment import LocalDeployment, stop_on_sigterm

work, n, rounds, isolate = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "isolate"
pull = float(sys.argv[5]) if len(sys.argv) > 5 else "spread"
stop_on_sigterm()  # SIGTERM leaves the `with` below, which stops the deployment (else its nodes run on)
with LocalDeployment(work / "deployment", n, isolate=isolate, durable_superlink=False, pull_interval=pull) as d:
    d.start()
    seconds = d.run_floor([[10, 3969], [10]], rounds, work / "floor", timeout=900)
print("median of rounds 2…:", statistics.median(seconds[1:]))
