"""The pretrained-network table (results/table-pretrained.{md,json}): private fine-tuning at ε = 3
from a network pretrained without privacy on the other data set (simulations/pretrained-study.sh),
and on CIFAR-10 at ε = 2 from its first 5,000 training images as the public set
(simulations/pretrained-cifar10.sh); each row's seeds on test, against this repository's best rows
without public data.

    python -m simulations.pretrained_table      # after the scripts
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from fedsd.files.atomic import write_json

RUNS = Path("results/runs/pretrained")
OUT = Path("results/table-pretrained")
# The best rows here without public data (results/table-features.md, ScatterNet features, ε = 3)
# and the papers' CNN trained from scratch with dpsgd (results/table1.md, ε = 3)
# (CIFAR-10 at ε = 2: no features row at that ε; the CNN from scratch is Table 1's one seed, on
# all 50,000 training images, 60 epochs)
BEST = {("mnist", 3.0): 98.79, ("fmnist", 3.0): 89.56}
SCRATCH_CNN = {("mnist", 3.0): 97.20, ("fmnist", 3.0): 84.52, ("cifar10", 2.0): 54.17}
TRAINED = {"head": "the head (on the frozen blocks' cached output)",
           "last:2": "the last block: fc 512→32→10 (on the frozen blocks' cached output)",
           "all": "every layer (pixels)"}
TRAINED_CIFAR_CNN = {"last:2": "the last two blocks (on the frozen blocks' cached output)"}


def _against(table: dict, dataset: str, epsilon: float, mean: float) -> float | None:
    return mean - table[(dataset, epsilon)] if (dataset, epsilon) in table else None


def rows(runs: Path = RUNS) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for path in sorted(runs.glob("*/result.json")):
        r = json.loads(path.read_text())
        c = r["config"]
        key = (c["dataset"], Path(c["init_weights"]).name or "none (random start)", c["train_layers"], c["features"],
               c["lr"], c["epochs"], c["batch_size"], float(c["epsilon"]), c["model"])
        cells.setdefault(key, []).append(r)
    out = []
    for (dataset, weights, layers, features, lr, epochs, batch, epsilon, model), results in sorted(cells.items()):
        accuracy = [100 * r["test_accuracy"] for r in sorted(results, key=lambda r: r["seed"])]
        mean = statistics.mean(accuracy)
        se = statistics.stdev(accuracy) / len(accuracy) ** 0.5 if len(accuracy) > 1 else None
        out.append(dict(dataset=dataset, init_weights=weights, train_layers=layers, features=features, lr=lr,
                        epochs=epochs, batch_size=batch, epsilon=epsilon, model=model,
                        seeds=[r["seed"] for r in results], test_accuracy=accuracy, mean=mean, standard_error=se,
                        against_best=_against(BEST, dataset, epsilon, mean),
                        against_scratch_cnn=_against(SCRATCH_CNN, dataset, epsilon, mean),
                        epsilon_spent=max(r["epsilon_spent"] for r in results),
                        wall_seconds=statistics.mean(r["wall_seconds"] for r in results),
                        trained_parameters=(results[0].get("pretrained") or {}).get("trained_parameters"),
                        by_seed={r["seed"]: 100 * r["test_accuracy"] for r in results}))
    for row in out:  # every layer from the public weights, paired by seed with the random start at the same length
        control = [c for c in out if c["dataset"] == row["dataset"] and c["init_weights"].startswith("none")
                   and c["epochs"] == row["epochs"] and c["lr"] == row["lr"] and c["epsilon"] == row["epsilon"]]
        if row["train_layers"] == "all" and not row["init_weights"].startswith("none") and control:
            diffs = [row["by_seed"][s] - control[0]["by_seed"][s] for s in row["by_seed"] if s in control[0]["by_seed"]]
            row["against_random_start"] = statistics.mean(diffs)
            row["against_random_start_se"] = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    return out


def markdown(table: list[dict]) -> str:
    lines = ["# Private fine-tuning from a public pretrained network (δ = 1e-5, dpsgd)", "",
             "MNIST and Fashion-MNIST at ε = 3: each private data set's network (the papers' mnist-cnn) starts "
             "from weights pretrained without privacy on the other data set. CIFAR-10 at ε = 2: the papers' "
             "cifar-cnn pretrained without privacy on the first 5,000 training images (public), then trained "
             "privately on the other 45,000 (`--public-first 5000`). Pretraining: `fedsd pretrain`, "
             "results/pretrained/. DP-SGD then trains what the row says; the head's and last block's lr chosen "
             "on validation (results/sweeps/*-dpsgd-pretrained-*). Test accuracy (%) by seed, mean ± standard "
             "error; against this repository's best without public data at that ε (ScatterNet features at ε = 3: "
             f"MNIST {BEST[('mnist', 3.0)]}, Fashion-MNIST {BEST[('fmnist', 3.0)]}) and the same CNN from scratch "
             f"(dpsgd, Table 1: {SCRATCH_CNN[('mnist', 3.0)]}, {SCRATCH_CNN[('fmnist', 3.0)]} at ε = 3; CIFAR-10 "
             f"{SCRATCH_CNN[('cifar10', 2.0)]} at ε = 2, one seed on all 50,000 images). Commands: results/README.md, "
             "\"Does a public pretrained network help?\".", "",
             "| private data | pretrained on | trains | weights trained | lr | epochs | B | test accuracy by seed | "
             "mean ± SE | − best | − CNN from scratch (Table 1, dpsgd) | − random start, same length, paired | ε | "
             "seconds a run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        se = f" ± {r['standard_error']:.2f}" if r["standard_error"] is not None else ""
        paired = (f"{r['against_random_start']:+.2f}" + (f" ± {r['against_random_start_se']:.2f}"
                                                         if r.get("against_random_start_se") is not None else "")
                  if "against_random_start" in r else "")
        weights = (f"{r['trained_parameters']:,}" if r["trained_parameters"] is not None else  # a random start: all
                   {"mnist-cnn": "26,010"}.get(r["model"], "all"))
        trained = ((TRAINED_CIFAR_CNN if r["model"] == "cifar-cnn" else {}).get(r["train_layers"])
                   or TRAINED.get(r["train_layers"], r["train_layers"]))
        best, scratch = (f"{v:+.2f}" if v is not None else "" for v in (r["against_best"], r["against_scratch_cnn"]))
        lines.append(f"| {r['dataset']} | {r['init_weights']} | {trained} | "
                     f"{weights} | {r['lr']:g} | {r['epochs']} | {r['batch_size']} | "
                     f"{', '.join(f'{a:.2f}' for a in r['test_accuracy'])} | **{r['mean']:.2f}**{se} | "
                     f"{best} | {scratch} | {paired} | "
                     f"{r['epsilon_spent']:.3f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    table = rows()
    write_json(OUT.with_suffix(".json"), table)
    OUT.with_suffix(".md").write_text(markdown(table))
    print(markdown(table))


if __name__ == "__main__":
    main()
