"""The weights a short run of each method and each clipping route ends with, as recorded before
the trainer was split into methods, clippers and step callbacks: a refactor must
not change a number. `python -m tests.same_weights --write` records them anew (only when a
change is meant to change the numbers, and said so in its commit)."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

RECORD = Path(__file__).parent / "data" / "same_weights.json"
# (method, clipping route, FedProx μ): every method on book-keeping (the default route on CPU),
# every other route on dp3sd (its teacher reads the same batch), FedProx's post-noise term on dpsgd.
CASES = [(m, "bk", 0.0) for m in ("dpsgd", "dpema", "dpkd", "dp3sd", "dpdsd")] + \
        [("dp3sd", r, 0.0) for r in ("hooks", "functorch", "ew", "ghost")] + [("dpsgd", "bk", 0.1)]


def case_name(method: str, route: str, mu: float) -> str:
    return f"{method}-{route}" + (f"-prox{mu:g}" if mu else "")


def train(method: str, route: str, mu: float) -> dict[str, dict[str, torch.Tensor]]:
    """Two epochs (DPKD: one each stage) on 300 Fashion-MNIST samples at B = 50, one thread."""
    from fedsd.data import datasets as data_lib
    from fedsd.settings.run import TrainConfig
    from fedsd.privacy.accounting import plan
    from fedsd.training.loop import DPTrainer, initial_model

    cfg = TrainConfig(dataset="fmnist", method=method, epsilon=3, epochs=2, batch_size=50, subset=300, seed=3,
                      grad_sample_mode=route, threads=1, dpkd_teacher_epochs=1 if method == "dpkd" else None).resolved()
    images = data_lib.load("fmnist")
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 300, 0))
    trainer = DPTrainer(cfg, tensors, plan(3, 1e-5, 300, 50, 2))
    model, _, _ = trainer.local_update(initial_model(cfg, 10), None, [1, 2], proximal_mu=mu)
    return model


def fingerprint(model: dict[str, dict[str, torch.Tensor]]) -> dict:
    """Per weight tensor: its sum and its dot with a fixed ramp (float64), and the sha256 of
    all bytes (equal on one machine; across CPUs the sums agree to rounding)."""
    sums, digest = {}, hashlib.sha256()
    for group in sorted(model):
        for name in sorted(model[group]):
            t = model[group][name].detach().cpu().contiguous()
            flat = t.double().flatten()
            ramp = torch.linspace(-1, 1, len(flat), dtype=torch.float64)
            sums[f"{group}/{name}"] = [flat.sum().item(), (flat * ramp).sum().item(), flat.abs().sum().item()]
            digest.update(t.numpy().tobytes())
    return dict(sums=sums, sha256=digest.hexdigest())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", action="store_true", help=f"record every case into {RECORD}")
    args = p.parse_args()
    record = {case_name(*c): fingerprint(train(*c)) for c in CASES}
    if args.write:
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {RECORD}")
    else:
        old = json.loads(RECORD.read_text())
        for name, fp in record.items():
            print(name, "bit-identical" if fp["sha256"] == old[name]["sha256"] else "DIFFERENT BYTES")


if __name__ == "__main__":
    main()
