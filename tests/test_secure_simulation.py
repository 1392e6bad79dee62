"""The in-process federation with secure aggregation and distributed noise
(simulations/commands/secure_simulation.py), on a small real subset: it spends exactly its ε,
resumes to the weights of a run never stopped, and self-distils from the model one step old."""
import pytest
import torch

from fedsd.config import TrainConfig
from fedsd.fed_settings import FedOptions
from simulations.commands.secure_simulation import SecureFederation, simulate_secure
from tests.conftest import require

pytestmark = pytest.mark.slow


def settings(method="dpsgd", rounds=4):
    cfg = TrainConfig(dataset="fmnist", method=method, subset=2000, batch_size=300, lr=1.0, epsilon=3.0,
                      threads=1, seed=3, grad_sample_mode="hooks").resolved()
    fed = FedOptions(num_clients=3, rounds=rounds, partition="dirichlet", dirichlet_alpha=0.5,
                     secure_aggregation=True, noise="distributed")
    return cfg, fed


def test_a_resumed_run_ends_with_the_weights_of_one_never_stopped_and_spends_its_epsilon(tmp_path):
    require("fmnist")
    cfg, fed = settings()
    whole = SecureFederation(cfg, fed, None)
    for r in range(1, 5):
        whole.take_round(r)
    first = SecureFederation(cfg, fed, None)
    for r in (1, 2):
        first.take_round(r)
    saved = first.state_dict()
    second = SecureFederation(cfg, fed, None)
    second.load(saved)
    for r in (3, 4):
        record = second.take_round(r)
    for k, v in whole.model["student"].items():
        assert torch.equal(v, second.model["student"][k]), k
    assert 2.99 < record["epsilon"] <= 3.0 and record["survivors"] == 3
    assert record["bytes_to_server"] > 3 * 8 * whole.noise.dim  # three masked vectors, and the shares


def test_dp3sd_distils_from_the_model_one_step_old_and_writes_its_result(tmp_path):
    require("fmnist")
    cfg, fed = settings("dp3sd", rounds=3)
    result, weights = simulate_secure(cfg, fed, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "result.json").is_file() and not (tmp_path / "run" / "checkpoint.pt").exists()
    assert result["steps"] == 3 and 2.99 < result["epsilon_spent"] <= 3.0
    assert 0.0 <= result["test_accuracy"] <= 1.0 and all(torch.isfinite(v).all() for v in weights.values())
