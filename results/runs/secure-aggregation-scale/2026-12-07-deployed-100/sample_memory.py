"""How the memory-attempt files were taken: every 5 s, the machine's memory in use (RAM, swap),
what the kernel's page merging saves, and the Pss (with swapped Pss) of the deployment's processes
by part: the owners' services (uids 47000–47499 under --isolate), the SuperNodes' processes (47500
and up), the server's (root's processes naming the work folder, the ServerApp, the SuperExec).

    python3 sample_memory.py OUT.jsonl WORK_FOLDER   # as root, beside the deployment; stop it with a signal
"""
import json
import os
import re
import sys
import time


def kib(text: str, key: str) -> int:
    found = re.search(rf"^{key}:\s+(\d+)", text, re.M)
    return int(found.group(1)) if found else 0


def part_of(pid: str, work: str) -> str | None:
    uid = int(open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0])
    if uid >= 47500:
        return "nodes"
    if uid >= 47000:
        return "owners"
    cmd = open(f"/proc/{pid}/cmdline").read()
    return "server" if work in cmd or "flwr-serverapp" in cmd or "flower-superexec" in cmd else None


def sample(work: str) -> dict:
    meminfo = open("/proc/meminfo").read()
    pss = {"owners": 0, "nodes": 0, "server": 0}
    count = dict.fromkeys(pss, 0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            part = part_of(pid, work)
            if part is None:
                continue
            rollup = open(f"/proc/{pid}/smaps_rollup").read()
        except (OSError, IndexError):  # gone meanwhile
            continue
        pss[part] += kib(rollup, "Pss") + kib(rollup, "SwapPss")
        count[part] += 1
    return {"t": round(time.time(), 1),
            "ram_used_mib": (kib(meminfo, "MemTotal") - kib(meminfo, "MemAvailable")) // 1024,
            "swap_used_mib": (kib(meminfo, "SwapTotal") - kib(meminfo, "SwapFree")) // 1024,
            "ksm_saved_mib": int(open("/sys/kernel/mm/ksm/pages_sharing").read()) * 4 // 1024,
            **{f"{k}_pss_mib": v // 1024 for k, v in pss.items()}, **{f"{k}_procs": v for k, v in count.items()}}


if __name__ == "__main__":
    out, work = sys.argv[1], sys.argv[2]
    with open(out, "a") as f:
        while True:
            started = time.time()
            f.write(json.dumps(sample(work)) + "\n")
            f.flush()
            time.sleep(max(0.5, 5 - (time.time() - started)))
