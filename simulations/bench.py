"""`fedsd bench`: side-by-side timings in one run (seconds are noisy; ratios are the claim).

    fedsd bench federated   steady-state seconds per federated round vs seconds per central
                            epoch of the same DP training on the same data
    fedsd bench step        one DP-SGD step as fedsd runs it vs a non-private step of the same
                            model, loss and batch
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (ratios measured side by side)")
    what = p.add_subparsers(dest="what", required=True)
    fed = what.add_parser("federated", help="federated round vs central epoch, same data and DP training")
    fed.add_argument("--dataset", default="fmnist")
    fed.add_argument("--method", default="dp3sd")
    fed.add_argument("--clients", type=int, default=10)
    fed.add_argument("--rounds", type=int, default=4, help="the first round (warm-up) is not counted")
    fed.add_argument("--batch-size", type=int, default=256)
    fed.add_argument("--subset", type=int, default=None)
    fed.add_argument("--epsilon", type=float, default=3.0)
    fed.add_argument("--ray-workers", type=int, default=2, help="Ray CPUs, one client at a time on each")
    fed.add_argument("--json", action="store_true")
    fed.set_defaults(func=bench_federated)
    step = what.add_parser("step", help="DP step vs non-private step, same model, loss and batch")
    step.add_argument("--model", choices=["mnist-cnn", "cifar-cnn"], default="mnist-cnn")
    step.add_argument("--batch-size", type=int, default=None, help="default: the paper's (1600 / 1000)")
    step.add_argument("--method", default="dp3sd", help="dp3sd also times the teacher's forward pass")
    step.add_argument("--grad-sample-mode", nargs="+", default=["hooks", "functorch", "ew", "ghost", "bk"])
    step.add_argument("--device", default="cpu")
    step.add_argument("--repeats", type=int, default=20)
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--json", action="store_true")
    step.set_defaults(func=bench_step)


def bench_federated(args: argparse.Namespace) -> int:
    from fedsd.central import train
    from fedsd.config import TrainConfig
    from fedsd.federation import FedOptions
    from simulations.simulate import simulate

    cfg = TrainConfig(dataset=args.dataset, method=args.method, epsilon=args.epsilon, batch_size=args.batch_size,
                      subset=args.subset, distill_warmup_epochs=0)  # every epoch pays for the teacher
    fed_result = simulate(cfg, FedOptions(num_clients=args.clients, rounds=args.rounds, client_cpus=1.0),
                          progress=False, ray_cpus=args.ray_workers)
    central, _ = train(TrainConfig(**{**cfg.__dict__, "epochs": args.rounds}), progress=False)
    # Steady state: leave out the first round / epoch (process start, caches being filled).
    round_seconds = [r["train_seconds"] for r in fed_result["rounds"][1:]]
    epoch_seconds = [e["seconds"] for e in central["epochs"][1:]]
    report = dict(dataset=args.dataset, method=args.method, clients=args.clients, ray_workers=args.ray_workers,
                  batch_size=args.batch_size, train_samples=central["num_train"],
                  central_epoch_seconds=statistics.median(epoch_seconds),
                  federated_round_seconds=statistics.median(round_seconds),
                  round_seconds_all=[r["train_seconds"] for r in fed_result["rounds"]],
                  epoch_seconds_all=[e["seconds"] for e in central["epochs"]])
    report["ratio"] = report["federated_round_seconds"] / report["central_epoch_seconds"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"central epoch: {report['central_epoch_seconds']:.2f} s   "
              f"federated round ({args.clients} clients, {args.ray_workers} Ray workers): "
              f"{report['federated_round_seconds']:.2f} s   ratio {report['ratio']:.3f}", file=sys.stdout)
    return 0


def _timer(device):
    """A function that runs fn() and returns its seconds (CUDA events on a GPU)."""
    import time

    import torch

    if device.type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
    else:
        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return timed


def bench_step(args: argparse.Namespace) -> int:
    import copy

    import torch

    from fedsd.central import resolve_device
    from fedsd.config import TrainConfig
    from fedsd.data import TensorData
    from fedsd.privacy import plan
    from fedsd.training import DPTrainer

    device = resolve_device(args.device)
    dataset = "fmnist" if args.model == "mnist-cnn" else "cifar10"
    shape = (1, 28, 28) if args.model == "mnist-cnn" else (3, 32, 32)
    base = TrainConfig(dataset=dataset, method=args.method, epsilon=3.0, epochs=1, batch_size=args.batch_size,
                       model=args.model, distill_warmup_epochs=0).resolved()
    batch = base.batch_size
    g = torch.Generator().manual_seed(0)
    # Timing only: the values do not matter, the shapes do (no accuracy is claimed here).
    x = torch.randn(batch, *shape, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    data = TensorData(x, y, x[:1], y[:1], 10)
    timed = _timer(device)
    rows = []
    for mode in args.grad_sample_mode:
        cfg = TrainConfig(**{**base.__dict__, "grad_sample_mode": mode})
        trainer = DPTrainer(cfg, data, plan(3.0, 1e-5, 10 * batch, batch, 1))
        loss_fn, uses_teacher = trainer._loss_for_epoch(1, {})
        plain = copy.deepcopy(trainer.teacher).train().requires_grad_(True)
        teacher = trainer.teacher
        sgd = torch.optim.SGD(plain.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # as the DP step

        def nonprivate_step():
            sgd.zero_grad(set_to_none=True)
            t = None
            if uses_teacher:
                with torch.no_grad():
                    t = teacher(x)
            loss_fn(plain(x), t, y).mean().backward()
            sgd.step()

        def dp_step():
            trainer.train_on_batch(x, y, loss_fn, uses_teacher)

        dp_times, np_times = [], []
        for i in range(args.warmup + args.repeats):  # interleaved, so both see the same machine state
            d, n = timed(dp_step), timed(nonprivate_step)
            if i >= args.warmup:
                dp_times.append(d)
                np_times.append(n)
        dp_s, np_s = statistics.median(dp_times), statistics.median(np_times)
        rows.append(dict(model=args.model, batch_size=batch, method=args.method, grad_sample_mode=mode,
                         device=str(device), threads=torch.get_num_threads(), dp_step_seconds=dp_s,
                         nonprivate_step_seconds=np_s, ratio=dp_s / np_s))
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
    else:
        for r in rows:
            print(f"{r['model']} B={r['batch_size']} {r['method']} {r['grad_sample_mode']:>9} on {r['device']}: "
                  f"dp {r['dp_step_seconds'] * 1000:.1f} ms, non-private {r['nonprivate_step_seconds'] * 1000:.1f} ms, "
                  f"ratio {r['ratio']:.2f}")
    return 0
