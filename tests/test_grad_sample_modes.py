"""Every per-sample clipping route (Opacus' hooks, functorch, expanded weights, ghost clipping)
gives the reference path's weights to float tolerance, and the same ε."""
import pytest
import torch

from fedsd import data as data_lib
from fedsd.config import TrainConfig
from fedsd.privacy import plan
from fedsd.training import DPTrainer, initial_model
from tests.conftest import require


def run(mode: str, method: str, epochs=(1, 2)):
    cfg = TrainConfig(dataset="mnist", method=method, epsilon=3, epochs=2, batch_size=50, subset=300, seed=2,
                      grad_sample_mode=mode, distill_warmup_epochs=1, threads=1).resolved()
    images = data_lib.load("mnist")
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 300, 0))
    trainer = DPTrainer(cfg, tensors, plan(3, 1e-5, 300, 50, 2))
    model, state, metrics = trainer.local_update(initial_model(cfg, 10), None, list(epochs))
    return model["student"], metrics["epsilon"]


@pytest.mark.parametrize("mode", ["functorch", "ew", "ghost"])
@pytest.mark.parametrize("method", ["dpsgd", "dp3sd"])
def test_mode_matches_hooks(mode, method):
    require("mnist")
    reference, eps_ref = run("hooks", method)
    fast, eps = run(mode, method)
    assert eps == eps_ref
    worst = max((fast[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-4, worst
    moved = max((reference[k] - initial_model(TrainConfig(dataset="mnist").resolved(), 10)["student"][k])
                .abs().max().item() for k in reference)
    assert moved > 100 * worst  # the match is not trivial: training moved the weights


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_empty_batch_takes_a_noise_only_step(mode):
    require("mnist")
    cfg = TrainConfig(dataset="mnist", method="dpsgd", epsilon=3, epochs=1, batch_size=50, subset=300,
                      grad_sample_mode=mode).resolved()
    images = data_lib.load("mnist")
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 300, 0))
    p = plan(3, 1e-5, 300, 50, 1)
    trainer = DPTrainer(cfg, tensors, p)
    trainer.generator.manual_seed(0)
    before = [w.detach().clone() for w in trainer.model.parameters()]
    trainer.train_on_batch(tensors.x_train[:0], tensors.y_train[:0], lambda s, t, y: s.sum(1), False)
    deltas = torch.cat([(w.detach() - b).flatten() for w, b in zip(trainer.model.parameters(), before)])
    expected_std = cfg.lr * p.noise_multiplier * cfg.clip / cfg.batch_size
    assert deltas.std().item() == pytest.approx(expected_std, rel=0.05)
    assert abs(deltas.mean().item()) < 0.05 * expected_std
