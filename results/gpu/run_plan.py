"""Run a plan's fedsd runs (a JSON list of {name, config}) one after another on the device until
DEADLINE (epoch seconds): python3 run_plan.py DEADLINE PLAN.json. A run already finished in
/tmp/runs (an earlier call on the same warm machine) is skipped. After each run, $OUT/runs.tgz
holds every finished run less its checkpoint: one file, because a call brings back only a few
(the first call here copied each run's folder and got 8 files of 13 runs back)."""
import json
import os
import subprocess
import sys
import time

deadline = float(sys.argv[1])
plan = json.load(open(sys.argv[2]))
out, runs = os.environ["OUT"], "/tmp/runs"
os.makedirs(runs, exist_ok=True)
for entry in plan:
    run_out = f"{runs}/{entry['name']}"
    if os.path.isfile(f"{run_out}/result.json"):
        continue
    left = deadline - time.time()
    if left < 20:
        print("deadline: stop before", entry["name"], flush=True)
        break
    cfg = f"/tmp/{entry['name']}.json"
    json.dump(entry["config"], open(cfg, "w"))
    t0 = time.time()
    code = ("import json; from fedsd.simulation.sweeps import _run_one; "
            f"r = _run_one(json.load(open('{cfg}')), '{run_out}'); "
            f"print('RESULT', r.get('test_accuracy'), r.get('diverged', ''))")
    try:
        p = subprocess.run([sys.executable, "-c", code], timeout=left, capture_output=True, text=True)
        tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
        print(f"{entry['name']}: rc={p.returncode} {time.time() - t0:.0f}s", *tail, sep="\n  ", flush=True)
    except subprocess.TimeoutExpired:
        print(f"{entry['name']}: deadline after {time.time() - t0:.0f}s (not finished)", flush=True)
        break
    subprocess.run(["tar", "czf", f"{out}/runs.tgz", "--exclude=checkpoint.pt", "-C", "/tmp", "runs"], check=True)
