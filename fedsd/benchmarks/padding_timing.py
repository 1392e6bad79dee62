"""Does an owner's masked-input step take longer when it holds more records? (A timing side
channel: a review measured +171 ms for 2,000 records against 200, Welch t = +2.8, when a plan
with expected batch E = 1 let the padding fall back to each owner's own bound.)

Two owners under distributed noise, one holding `--small` and one `--large` Fashion-MNIST
records, take the step an owner's service takes (fedsd.secure.distributed_step.contribution,
padded and drawn as fedsd.app.client.secure_contribution.distributed_contribution pads and draws:
padded_rows of the plan, owner_rate of the run's public secagg-max-records), under the plan a
server could send with E = `--expected-batch`, alternating, `--repeats` times each, one thread.
It prints and writes (`--out`, JSON) each owner's median and Welch's t of the two samples.

    python -m fedsd.benchmarks.padding_timing --out results/bench-padding-timing.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def welch_t(a: list[float], b: list[float]) -> float:
    """Welch's t of mean(b) − mean(a)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    return (statistics.mean(b) - statistics.mean(a)) / (va + vb) ** 0.5


def owner(records: int, expected_batch: float, rounds: int):
    """A trainer over `records` records, the plan with E = expected_batch, and its padding and rate."""
    import torch

    from fedsd.app.client.step_padding import owner_rate, padded_rows
    from fedsd.data.client_data import input_stats
    from fedsd.data import datasets as data_lib
    from fedsd.privacy.accounting import PrivacyPlan
    from fedsd.secure import distributed_noise
    from fedsd.secure.distributed_step import dimension
    from fedsd.models.networks import model_for
    from fedsd.settings.federation import FedConfig
    from fedsd.settings.run import TrainConfig
    from fedsd.training.loop import planned_trainer

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", subset=records, batch_size=int(expected_batch), lr=1.0,
                      epsilon=3.0, threads=1, seed=0).resolved()
    images = data_lib.load(cfg.dataset, cfg.data_dir)
    indices = data_lib.training_indices(images, cfg.subset, cfg.seed)
    data = data_lib.prepare(images, indices, "cpu", input_stats(cfg), cfg.features)
    q = expected_batch / 60_000  # the federation's q; E = q × its 60,000 records
    noise = distributed_noise.calibrate(3.0, 1e-5, cfg.clip, q, expected_batch, rounds, 3,
                                        dimension(model_for(cfg, 10)))
    trainer = planned_trainer(cfg, data, PrivacyPlan(0.0, q, rounds, 3.0, 1e-5, "rdp"))
    rows = padded_rows(noise)
    rate = owner_rate(noise, FedConfig().secagg_max_records, rows)
    torch.manual_seed(0)
    return trainer, noise, rows, rate


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=200)
    parser.add_argument("--large", type=int, default=2000)
    parser.add_argument("--expected-batch", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    from fedsd.secure.distributed_step import contribution
    from fedsd.training.loop import initial_model

    torch.set_num_threads(1)
    owners = {n: owner(n, args.expected_batch, 1000) for n in (args.small, args.large)}
    student = initial_model(owners[args.small][0].cfg, 10)["student"]
    times: dict[int, list[float]] = {n: [] for n in owners}
    for k in range(args.repeats + 5):  # the first five of each warm up, not counted
        for n, (trainer, noise, rows, rate) in owners.items():
            started = time.perf_counter()
            contribution(trainer, None, student, 1, noise, key=bytes(16), honest=3, pad_to=rows, draw_rate=rate)
            if k >= 5:
                times[n].append(time.perf_counter() - started)
    result = dict(question="does the masked-input step's time tell the owner's record count?",
                  expected_batch=args.expected_batch, repeats=args.repeats,
                  padded_rows={n: o[2] for n, o in owners.items()}, draw_rate={n: o[3] for n, o in owners.items()},
                  median_ms={n: 1000 * statistics.median(t) for n, t in times.items()},
                  mean_ms={n: 1000 * statistics.mean(t) for n, t in times.items()},
                  welch_t=welch_t(times[args.small], times[args.large]))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
