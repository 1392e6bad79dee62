"""`fedsd audit`: measure the privacy of a real run, not only compute it (fedsd.privacy.canary_audit;
docs/algorithms.md, "Measured privacy").

    fedsd audit --dataset mnist --method dp3sd --epsilon 2 --subset 5000 --epochs 10 \\
        [--canaries 1000] [--threat white|black] [--clients N] [--noise-scale s] --out DIR

trains once with m canaries, each included with probability ½, and writes DIR/audit.json (the
accountant's ε against the measured lower bound, at the stated confidence, and the guesses),
DIR/scores.png (included against excluded canaries' scores) and DIR/canaries.json (every
canary's score and whether it was included).

With --clients N ≥ 2 the run is a federation of N clients and client 0 holds the canaries: its
canaries join its local steps in every round. The federation runs in this process, with each
client's training the same DPTrainer.local_update the ClientApp calls and the server's FedAvg
(the sample-weighted mean): audit settings, --noise-scale above all, are a laboratory's and
must never travel from a server to a client.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fedsd.privacy import canary_audit as audit, accounting as privacy
from fedsd.data import features
from fedsd.data import datasets as data_lib
from fedsd.data.client_data import input_stats
from fedsd.training.central import prepare_run
from fedsd.runtime import resolve_device
from fedsd.settings.run import TrainConfig, check_setting
from fedsd.errors import ConfigError
from fedsd.settings.federation import FedConfig
from fedsd.files.results import atomic_path, check_out_dir, staged_out_dir, write_json
from fedsd.settings.declared import add_options, from_args, setting
from fedsd.training.loop import DPTrainer, evaluate, initial_model, planned_trainer
from fedsd.training.seeds import derive_seed
from fedsd.methods import released
from fedsd import dry_run
from fedsd.app.simulated_shards import build_federation

SEED_AUDIT = 3  # canaries: inclusion and participation (fedsd.training.loop's purposes 0–2)
THREATS = ("white", "black")


@dataclasses.dataclass
class AuditConfig:
    """What `fedsd audit` adds to a TrainConfig (fedsd.settings.declared: each setting declared once)."""

    canaries: int = setting(1000, "m, each included with probability ½")
    threat: str = setting("white", "white: gradient canaries scored from every released update; black: "
                          "mislabelled images scored by the final model's loss", choices=THREATS)
    noise_scale: float = setting(1.0, "draw s·σ noise while the accountant counts σ: s < 1 simulates a broken "
                                 "mechanism, which the audit must catch")
    confidence: float = setting(0.95, "1 − β of the lower bound")
    clients: int = setting(1, "1: central; N ≥ 2: an N-client federation (IID, one local epoch a round, --epochs "
                           "rounds) in which client 0 holds the canaries")

    def validate(self) -> None:
        check_setting(self.canaries >= 10, "--canaries", "must be >= 10", self.canaries)
        check_setting(self.threat in THREATS, "--threat", f"one of {', '.join(THREATS)}", self.threat)
        check_setting(self.noise_scale > 0, "--noise-scale", "must be > 0", self.noise_scale)
        check_setting(0 < self.confidence < 1, "--confidence", "must be in (0, 1)", self.confidence)
        check_setting(self.clients >= 1, "--clients", "must be >= 1", self.clients)


def add_audit_parser(sub) -> None:
    p = sub.add_parser("audit", help="a one-run privacy audit: a measured lower bound on ε (Steinke et al. 2023)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, TrainConfig, required=("epsilon",))
    add_options(p, AuditConfig)
    p.add_argument("--out", required=True, help="result folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    settings = from_args(AuditConfig, args)
    report = run_audit(from_args(TrainConfig, args), settings, args.out, args.overwrite, progress=not args.quiet)
    print(f"fedsd audit: {report['method']} ({report['threat']}-box, {report['canaries']} canaries): "
          f"ε lower bound {report['epsilon_lower_bound']:.3f} at {report['confidence']:.0%} confidence, "
          f"accountant ε {report['epsilon_accountant']:.3f}\n  files          {Path(args.out).absolute()}/ "
          "(audit.json, scores.png, canaries.json)")
    return 0


@dataclasses.dataclass
class Party:
    """One data holder of the audited run (the only one when central)."""
    trainer: DPTrainer
    state: object = None


def _black_box_canaries(images: data_lib.ImageData, m: int, seed: int, stats: tuple):
    """m test images, each with a wrong label drawn at random: (x, y_wrong, test positions)."""
    g = torch.Generator().manual_seed(seed)
    if m > len(images.y_test):
        raise ConfigError(f"--canaries: black-box canaries come from the {len(images.y_test)} test images, got {m}")
    positions = torch.randperm(len(images.y_test), generator=g)[:m]
    shift = torch.randint(1, images.num_classes, (m,), generator=g)
    wrong = (images.y_test[positions] + shift) % images.num_classes
    return images.normalised(images.x_test[positions], stats), wrong, positions


def _with_canaries(data: data_lib.TensorData, x: torch.Tensor, y: torch.Tensor, included: torch.Tensor,
                   positions: torch.Tensor) -> data_lib.TensorData:
    """A holder's data with the included canaries added to its training set and every canary
    image taken out of its test set."""
    keep = torch.ones(len(data.y_test), dtype=torch.bool)
    keep[positions] = False
    return data_lib.TensorData(torch.cat([data.x_train, x[included].to(data.x_train)]),
                               torch.cat([data.y_train, y[included].to(data.y_train)]),
                               data.x_test[keep.to(data.x_test.device)], data.y_test[keep.to(data.y_test.device)],
                               data.num_classes)


def run_audit(cfg: TrainConfig, settings: AuditConfig, out=None, overwrite: bool = False,
              progress: bool = True) -> dict:
    """Train once with canaries and measure; returns audit.json's content (and writes `out`)."""
    cfg = _checked(cfg, settings, out, overwrite)
    seed = derive_seed(cfg.seed, SEED_AUDIT)
    cfg, images, holders = _holders(cfg, settings)
    black = None
    if settings.threat == "black":
        x, y, positions = _black_box_canaries(images, settings.canaries, seed, input_stats(cfg))
        x = features.inputs(x, cfg.features, "canary images")  # what the network takes, as the data's
        included = torch.rand(settings.canaries, generator=torch.Generator().manual_seed(seed + 1)) < 0.5
        black = (x, y, included)
        holders[0] = _with_canaries(holders[0], x, y, included, positions)
    plans = [privacy.plan(cfg.epsilon, cfg.delta, len(h.y_train), cfg.batch_size, cfg.epochs, cfg.accountant)
             for h in holders]
    parties = [Party(planned_trainer(cfg, h, plan, client=k)) for k, (h, plan) in enumerate(zip(holders, plans))]
    canaries = None
    if settings.threat == "white":
        canaries = audit.GradientCanaries(settings.canaries, cfg.clip, plans[0].sample_rate,
                                          plans[0].noise_multiplier, cfg.batch_size, seed, parties[0].trainer.device)
    dry_run.stop_here(f"audit {cfg.method} ({settings.threat}-box, {settings.canaries} canaries) over {cfg.epochs} "
                      f"epochs of {len(holders)} holder(s)")
    started = time.perf_counter()
    epsilon_accountant, accuracy = _train(cfg, parties, audit.AuditedSteps(canaries, settings.noise_scale),
                                          images.num_classes, progress)
    scores, included = _scores(canaries, black, parties[0].trainer)
    outcome = audit.guess(scores, included, cfg.delta, settings.confidence)
    report = dict(epsilon_accountant=epsilon_accountant, epsilon_lower_bound=outcome.epsilon_lower_bound,
                  confidence=settings.confidence, canaries=settings.canaries, guesses=outcome.guesses,
                  correct=outcome.correct, k_plus=outcome.guesses // 2, k_minus=outcome.guesses // 2,
                  threat=settings.threat, method=cfg.method, dataset=cfg.dataset, epsilon_target=cfg.epsilon,
                  delta=cfg.delta, noise_scale=settings.noise_scale, clients=settings.clients,
                  audited_client=0 if settings.clients > 1 else None, test_accuracy=accuracy,
                  noise_multiplier=plans[0].noise_multiplier, sample_rate=plans[0].sample_rate,
                  steps=parties[0].state.steps, included=int(included.sum()),
                  wall_seconds=time.perf_counter() - started, config=cfg.to_dict())
    if out is not None:
        with staged_out_dir(out, overwrite) as scratch:
            write_json(scratch / "canaries.json", dict(score=scores.tolist(), included=included.tolist()))
            plot_scores(scratch / "scores.png", scores, included, report)
            write_json(scratch / "audit.json", report)
    return report


def _checked(cfg: TrainConfig, settings: AuditConfig, out, overwrite: bool) -> TrainConfig:
    """The run's settings resolved, every check made before any work."""
    settings.validate()
    if out is not None:
        check_out_dir(out, overwrite)
    cfg = cfg.resolved()
    if cfg.feature_norm != "group":
        # The canaries' membership is read off DP-SGD's steps; a release made before them, from
        # the data, is a second mechanism the audit would not see.
        raise ConfigError(f"--feature-norm {cfg.feature_norm}: fedsd audit measures DP-SGD's steps alone; audit "
                          "ScatterNet features with --feature-norm group")
    if cfg.clip_quantile:
        # Its canaries are measured at a fixed clip; the estimate's counts are a second release per
        # step, which the accountant composes (fedsd.clipping.adaptive) but the canaries do not see.
        raise ConfigError("--clip-quantile: fedsd audit measures DP-SGD at a fixed clip; audit with --clip-quantile 0 "
                          "(the count's cost is in the accountant's ε, Theorem 1)")
    return cfg


def _holders(cfg: TrainConfig, settings: AuditConfig) -> tuple[TrainConfig, data_lib.ImageData, list]:
    """The data each holder trains on: the run's training split, or each client's shard."""
    if settings.clients == 1:
        inputs = prepare_run(cfg)
        cfg, images, device = inputs.cfg, inputs.data, inputs.device
        return cfg, images, [data_lib.prepare(images, inputs.train_indices, device, input_stats(cfg), cfg.features)]
    device = resolve_device(cfg.device)
    federation = build_federation(cfg, FedConfig(num_clients=settings.clients, rounds=cfg.epochs, local_epochs=1))
    return federation.cfg, federation.images, [federation.client_data(k, device) for k in range(settings.clients)]


def _train(cfg: TrainConfig, parties: list, audited_steps, num_classes: int, progress: bool) -> tuple[float, float]:
    """Every epoch (round) of every party, the first one's steps audited; the audited party's
    accountant ε and its released model's test accuracy."""
    audited = parties[0].trainer
    model = initial_model(cfg, num_classes)
    for epoch in tqdm(range(1, cfg.epochs + 1), desc=f"audit {cfg.dataset} {cfg.method} ε={cfg.epsilon:g}",
                      unit="round" if len(parties) > 1 else "epoch", disable=not progress):
        replies = []
        for party in parties:
            trained, party.state, metrics = party.trainer.local_update(
                model, party.state, [epoch], callbacks=[audited_steps] if party.trainer is audited else ())
            replies.append((trained, len(party.trainer.data.y_train), metrics))
        model = fedavg(replies)
    audited.model.load_state_dict(released(model))
    accuracy, _ = evaluate(audited.model, audited.data.x_test, audited.data.y_test)
    return replies[0][2]["epsilon"], accuracy


def _scores(canaries, black, audited) -> tuple[np.ndarray, np.ndarray]:
    """Each canary's score and whether it was included: the white-box canaries' own, or the
    black-box canaries' negative loss under the released model (low loss: seen in training)."""
    if canaries is not None:
        return canaries.scores.numpy(), canaries.included.numpy()
    x, y, included = black
    audited.model.eval()
    with torch.no_grad():
        logits = audited.model(x.to(audited.device).contiguous(memory_format=audited.memory_format))
        loss = torch.nn.functional.cross_entropy(logits, y.to(audited.device), reduction="none")
    return (-loss).double().cpu().numpy(), included.numpy()


def fedavg(replies: list[tuple[dict, int, dict]]) -> dict:
    """FedAvg's sample-weighted mean of every weight group (with one holder: its own model)."""
    if len(replies) == 1:
        return replies[0][0]
    total = sum(n for _, n, _ in replies)
    return {group: {name: sum(model[group][name].float() * (n / total) for model, n, _ in replies)
                    .to(replies[0][0][group][name].dtype) for name in weights}
            for group, weights in replies[0][0].items()}


def plot_scores(path: Path, scores: np.ndarray, included: np.ndarray, report: dict) -> None:
    """Histograms of the included and the excluded canaries' scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.histogram_bin_edges(scores, bins=40)
    ax.hist(scores[included], bins=bins, alpha=0.6, label=f"included ({included.sum()})")
    ax.hist(scores[~included], bins=bins, alpha=0.6, label=f"excluded ({(~included).sum()})")
    ax.set_xlabel("canary score")
    ax.set_ylabel("canaries")
    ax.set_title(f"{report['dataset']} {report['method']} {report['threat']}-box: ε ≥ "
                 f"{report['epsilon_lower_bound']:.2f} (accountant {report['epsilon_accountant']:.2f})")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
