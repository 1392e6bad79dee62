"""DP3SD's warm-up loss (results/table-warmup.{md,json}): the papers' plain cross-entropy against
the sharpened CE_τs fedsd warms up on by default (--dp3sd-warmup, docs/algorithms.md, "The
teacher"), Fashion-MNIST, ε = 3, the papers' CNN, seeds 0, 1, 2 (simulations/warmup-study.sh runs them).

    python -m simulations.warmup_table      # after simulations/warmup-study.sh
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from fedsd.files.atomic import write_json

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "runs" / "warmup"
OUT = ROOT / "results" / "table-warmup"
WARMUPS = ("sharpened", "plain")
SEEDS = (0, 1, 2)
COMMAND = ("fedsd train --dataset fmnist --method dp3sd --epsilon 3 --seed {seed} --threads 1 "
           "--out {out} --quiet --log-dir off --dp3sd-warmup {warmup}")
# Table 1's dp3sd runs at the same settings (the default warm-up): a check that they reproduce
TABLE1 = ROOT / "results" / "runs" / "table1"


def run_name(warmup: str, seed: int) -> str:
    return f"fmnist-dp3sd-eps3-{warmup}-seed{seed}"


def run_dir(warmup: str, seed: int, runs: Path = RUNS) -> Path:
    return runs / run_name(warmup, seed)


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None)


def table(runs: Path = RUNS) -> dict:
    arms = {}
    for warmup in WARMUPS:
        results = {s: json.loads((run_dir(warmup, s, runs) / "result.json").read_text()) for s in SEEDS
                   if (run_dir(warmup, s, runs) / "result.json").exists()}
        accuracy = {s: 100 * r["test_accuracy"] for s, r in results.items()}
        mean, se = mean_se(list(accuracy.values()))
        arms[warmup] = dict(
            test_accuracy=accuracy, mean=mean, standard_error=se,
            epsilon_spent={s: r["epsilon_spent"] for s, r in results.items()},
            delta=next((r["delta"] for r in results.values()), None),
            epochs=sorted({r["config"]["epochs"] for r in results.values()}),
            commands=[COMMAND.format(seed=s, out=f"results/runs/warmup/{run_name(warmup, s)}", warmup=warmup)
                      for s in SEEDS])
    paired = [arms["plain"]["test_accuracy"][s] - arms["sharpened"]["test_accuracy"][s] for s in SEEDS
              if s in arms["plain"]["test_accuracy"] and s in arms["sharpened"]["test_accuracy"]]
    mean, se = mean_se(paired)
    unpaired = (None if arms["plain"]["standard_error"] is None or arms["sharpened"]["standard_error"] is None
                else (arms["plain"]["standard_error"] ** 2 + arms["sharpened"]["standard_error"] ** 2) ** 0.5)
    table1 = {s: 100 * json.loads((TABLE1 / f"fmnist-dp3sd-eps3-seed{s}" / "result.json").read_text())["test_accuracy"]
              for s in SEEDS if (TABLE1 / f"fmnist-dp3sd-eps3-seed{s}" / "result.json").exists()}
    return dict(dataset="fmnist", method="dp3sd", epsilon=3.0, model="mnist-cnn", arms=arms,
                plain_minus_sharpened=dict(by_seed=dict(zip([s for s in SEEDS if s in arms["plain"]["test_accuracy"]
                                                             and s in arms["sharpened"]["test_accuracy"]], paired)),
                                           mean=mean, paired_standard_error=se, unpaired_standard_error=unpaired,
                                           plain_better_beyond_2se=(mean is not None and se is not None
                                                                    and mean > 2 * se)),
                table1_sharpened_runs=table1)


def verdict(d: dict) -> str:
    """Whether plain is better by more than two standard errors (the paired ones), which would
    call for re-running Table 1's dp3sd cells with it as the default."""
    if d["plain_better_beyond_2se"]:
        return "Plain is better by more than two standard errors."
    worse = d["paired_standard_error"] is not None and d["mean"] < -2 * d["paired_standard_error"]
    return ("Plain is not better by more than two standard errors"
            + (" (it is worse by more than two)" if worse else "")
            + ": the default stays sharpened.")


def markdown(t: dict) -> str:
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    arms, d = t["arms"], t["plain_minus_sharpened"]
    eps = max((e for a in arms.values() for e in a["epsilon_spent"].values()), default=None)
    epochs = ", ".join(map(str, sorted({e for a in arms.values() for e in a["epochs"]})))
    lines = ["# DP3SD's warm-up: plain cross-entropy (the papers') against sharpened CE_τs (fedsd's default)", "",
             f"Fashion-MNIST, ε = 3 (at most {f(eps)} spent), "
             f"δ = {arms['sharpened']['delta'] or arms['plain']['delta']}, "
             f"the papers' CNN (mnist-cnn), dp3sd with its defaults ({epochs} epochs, one warm-up epoch), "
             "seeds 0, 1, 2. The warm-up epoch trains on CE_1 (plain) or on CE_τs at "
             "τs = 0.3 (sharpened); every later epoch is the same loss. Test accuracy (%); mean ± standard error "
             "(the standard deviation over seeds / √seeds).", "",
             "| warm-up | seed 0 | seed 1 | seed 2 | mean ± standard error |", "|---|---|---|---|---|"]
    for warmup in ("plain", "sharpened"):
        a = arms[warmup]
        cells = [f(a["test_accuracy"].get(s)) or "not run" for s in SEEDS]
        lines.append(f"| {warmup} | " + " | ".join(cells) + f" | {f(a['mean'])}"
                     + ("" if a["standard_error"] is None else f" ± {f(a['standard_error'])}") + " |")
    if d["mean"] is not None:
        lines += ["", "plain − sharpened, paired by seed: **" + f"{d['mean']:+.2f}".replace("-", "−") + "**"
                  + ("" if d["paired_standard_error"] is None else f" ± {d['paired_standard_error']:.2f}")
                  + " (standard error of the per-seed differences"
                  + ("" if d["unpaired_standard_error"] is None
                     else f"; unpaired, from the two means' standard errors: ± {d['unpaired_standard_error']:.2f}")
                  + f", {len(d['by_seed'])} seeds). "
                  + verdict(d)]
    if t["table1_sharpened_runs"]:
        same = {str(s): v for s, v in t["table1_sharpened_runs"].items()} == \
            {str(s): v for s, v in arms["sharpened"]["test_accuracy"].items()}
        lines += ["", "Table 1's dp3sd runs at these settings (results/runs/table1/fmnist-dp3sd-eps3-seed*, the "
                  "default warm-up): " + ", ".join(f"seed {s} {v:.2f}" for s, v in t["table1_sharpened_runs"].items())
                  + (": the sharpened runs above, made again." if same else ".")]
    lines += ["", "Commands (simulations/warmup-study.sh runs the missing ones; this table: `python -m "
              "simulations.warmup_table`):", ""]
    lines += [f"    {c}" for w in ("plain", "sharpened") for c in arms[w]["commands"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    t = table()
    write_json(OUT.with_suffix(".json"), t)
    OUT.with_suffix(".md").write_text(markdown(t))
    print(f"wrote {OUT.relative_to(ROOT)}.json and {OUT.relative_to(ROOT)}.md")


if __name__ == "__main__":
    main()
