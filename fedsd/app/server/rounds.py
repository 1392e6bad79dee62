"""A run's round-by-round book-keeping, apart from the strategy loop that calls it.

After every round Flower's `Strategy.start` calls `RoundBook.evaluate_global`: it evaluates the
global model on the server's public test split (when the task has one), records the round
(accuracy, each client's ε, who trained, refused or missed, the clients' own evaluation),
checkpoints it for --resume, logs one line and moves the progress bar.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, MetricRecord
from tqdm.auto import tqdm

from fedsd.training.loop import evaluate
from fedsd.methods import released
from fedsd.app.records import record_to_model

from fedsd.training.tensorboard import round_scalars

from fedsd.app.server import checkpoint
from fedsd.app.server.strategy import RecordingStrategy, round_log


class RoundBook:
    def __init__(self, strategy: RecordingStrategy, net: torch.nn.Module,
                 test: tuple[torch.Tensor, torch.Tensor] | None, *,
                 validation: tuple[torch.Tensor, torch.Tensor] | None = None, rounds_total: int, start_round: int,
                 out: Path | None, settings: dict, experiment_id: str,
                 progress: bool, description: str):
        self.strategy, self.net, self.test, self.validation = strategy, net, test, validation
        self.rounds_total, self.start_round = rounds_total, start_round
        self.rounds: list[dict] = []  # the run's rounds so far (a resumed run's: load_state_dict)
        self.out, self.settings, self.experiment_id = out, settings, experiment_id
        self.bar = tqdm(total=rounds_total, initial=start_round, unit="round", disable=not progress,
                        desc=description, dynamic_ncols=True)
        self.last = time.perf_counter()
        self.log = None  # a TensorBoardLog (fedsd.training.tensorboard), when the run writes one; run_server closes it
        # Under noise=distributed the server's optimizer (SecureRounds sets it): its momentum goes in each checkpoint.
        self.server_optimizer = None
        self.names: dict[int, str] = {}  # under secure aggregation: protocol id → roster name or node id

    def evaluate_global(self, launch_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Flower's evaluate_fn: round 0 is the initial model (evaluated, not recorded)."""
        model = record_to_model(arrays)
        accuracy, loss, validation = self._evaluate(model)
        if launch_round > 0:
            self._record(launch_round + self.start_round, model, accuracy, loss, validation)
        return MetricRecord({"test-accuracy": accuracy, "test-loss": loss})

    def _evaluate(self, model) -> tuple[float, float, float | None]:
        """(test accuracy, test loss, --validation accuracy) of the released weights. A custom
        task has no public test split at the server (NaN, NaN); without --validation, None."""
        if self.test is None and self.validation is None:
            return float("nan"), float("nan"), None
        self.net.load_state_dict(released(model))
        accuracy, loss = evaluate(self.net, *self.test) if self.test is not None else (float("nan"), float("nan"))
        validation = evaluate(self.net, *self.validation)[0] if self.validation is not None else None
        return accuracy, loss, validation

    def _record(self, server_round: int, model, accuracy: float, loss: float, validation: float | None) -> None:
        s = self.strategy
        now = time.perf_counter()
        epsilons = dict(sorted(s.client_epsilon.items()))
        reports = s.round_clients.get(server_round, {})
        federated = s.evaluations.get(server_round)
        self.rounds.append(dict(
            round=server_round, test_accuracy=_number(accuracy), test_loss=_number(loss),
            federated_evaluation=federated,
            seconds=now - self.last, train_seconds=s.train_seconds.get(server_round),
            client_epsilon={str(k): v for k, v in epsilons.items()},
            trained=sorted(k for k, r in reports.items() if not int(r.get("skipped", 0)) and "rejected" not in r),
            skipped=sorted(k for k, r in reports.items() if int(r.get("skipped", 0))),
            refused={str(k): r["refused"] for k, r in reports.items() if "refused" in r},
            epsilon_fell_from={str(k): r["epsilon-fell-from"] for k, r in reports.items() if "epsilon-fell-from" in r},
            rejected={str(k): r["rejected"] for k, r in reports.items() if "rejected" in r},
            lifetime_budget={str(k): lifetime_budget(r) for k, r in reports.items() if "max-epsilon" in r},
            skipped_files={str(k): r["skipped-files"] for k, r in reports.items() if "skipped-files" in r},
            service={str(k): r["service"] for k, r in reports.items() if "service" in r},
            missed=s.missed.get(server_round, [])))
        clips = {str(k): r["clip"] for k, r in reports.items() if "clip" in r}
        if clips:  # adaptive clipping: each client's clip estimate after the round
            self.rounds[-1]["client_clip"] = clips
        if getattr(self.server_optimizer, "update_clip", None) is not None:  # the clients' update clip S after it
            self.rounds[-1]["clip"] = self.server_optimizer.update_clip
        if validation is not None:  # a simulation's --validation split, for choosing settings
            self.rounds[-1]["validation_accuracy"] = validation
        if self.out is not None:
            checkpoint.save(self.out, round=server_round, model=model, settings=self.settings,
                            experiment_id=self.experiment_id, book=self.state_dict(), strategy=s.state_dict(),
                            optimizer=None if self.server_optimizer is None else self.server_optimizer.state_dict())
        if self.log is not None:
            self.log.scalars(server_round, round_scalars(self.rounds[-1]))
        shown = accuracy if self.test is not None or federated is None else federated["test_accuracy"]
        round_log(self.rounds[-1], self.rounds_total, shown, max(epsilons.values(), default=0.0), self.names)
        self.bar.update(1)
        self.bar.set_postfix(acc=f"{shown:.4f}", eps=f"{max(epsilons.values(), default=0.0):.2f}")
        self.last = now

    def state_dict(self) -> dict:
        return {"rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.rounds = list(state["rounds"])

    def final_accuracy(self) -> float | None:
        """The last round's accuracy: the server's, else the clients' weighted one."""
        if not self.rounds:
            return None
        last = self.rounds[-1]
        if last["test_accuracy"] is None and last["federated_evaluation"]:
            return last["federated_evaluation"]["test_accuracy"]
        return last["test_accuracy"]

    def final_validation_accuracy(self) -> float | None:
        """The last round's accuracy on a simulation's --validation split (None without one)."""
        return self.rounds[-1].get("validation_accuracy") if self.rounds else None

    def close(self) -> None:
        self.bar.close()


def lifetime_budget(report: dict) -> dict:
    """The owner's lifetime limits a client reported ("inf": its owner set no limit)."""
    eps = float(report["max-epsilon"])
    return {"max_epsilon": "inf" if math.isinf(eps) else eps, "max_delta": float(report["max-delta"])}


def _number(x: float) -> float | None:
    return None if x != x else x  # NaN (not evaluated) is null in JSON
