"""The in-process federation with secure aggregation and distributed noise
(fedsd/simulation/secure_federation.py), on a small real subset: it spends exactly its ε,
resumes to the weights of a run never stopped, and self-distils from the model one step old."""
import dataclasses
import math

import pytest
import torch

from fedsd.settings.run import TrainConfig
from fedsd.settings.federation import FedConfig
from fedsd.simulation.secure_federation import SecureFederation, simulate_secure
from tests.conftest import require

pytestmark = pytest.mark.slow


def settings(method="dpsgd", rounds=4):
    cfg = TrainConfig(dataset="fmnist", method=method, subset=2000, batch_size=300, lr=1.0, epsilon=3.0,
                      threads=1, seed=3, grad_sample_mode="hooks").resolved()
    fed = FedConfig(num_clients=3, rounds=rounds, partition="dirichlet", dirichlet_alpha=0.5,
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


def test_client_level_rounds_are_fedavg_of_clipped_updates_and_spend_the_clients_epsilon(tmp_path):
    """--privacy-unit client: with the noise taken out, the rounds (local epochs, clipped
    updates, secure sum, the server's mean) train a model well past chance; with it, the run
    spends each client's ε as R Gaussian steps at q = 1 and moves the model by no more than the
    clip plus the noise."""
    import dataclasses

    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", subset=3000, batch_size=50, lr=0.05, momentum=0.9,
                      epsilon=3.0, threads=1, seed=3).resolved()
    fed = FedConfig(num_clients=3, rounds=2, secure_aggregation=True, noise="distributed", privacy_unit="client",
                     update_clip=2.0, local_epochs=1)
    quiet = SecureFederation(cfg, fed, None)
    quiet.noise = quiet.own = dataclasses.replace(quiet.noise, noise_multiplier=0.0)
    records = [quiet.take_round(r) for r in (1, 2)]
    assert records[-1]["test_accuracy"] > 0.6 and records[-1]["survivors"] == 3
    result, weights = simulate_secure(cfg, fed, tmp_path / "run", progress=False)
    assert result["privacy_unit"] == "client" and result["sample_rate"] == 1.0 and result["steps"] == 2
    assert 2.99 < result["epsilon_spent"] <= 3.0 and result["record_epsilon"] > 2 * result["epsilon_spent"]
    assert result["noise"]["clip"] == 2.0 and result["noise"]["expected_batch"] == 3.0


def test_client_level_adaptive_clipping_moves_the_clip_from_the_secure_sum_alone(tmp_path):
    """--update-clip-quantile under secure aggregation: the clip starts far below every update's
    norm and rises round by round (all bits 0, noised); ε is the fixed clip's, the plan one
    coordinate longer; the clip of each round is in result.json."""
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", subset=3000, batch_size=50, lr=0.05, momentum=0.9,
                      epsilon=3.0, threads=1, seed=3).resolved()
    fed = FedConfig(num_clients=40, rounds=6, secure_aggregation=True, noise="distributed", privacy_unit="client",
                    update_clip=0.01, update_clip_quantile=0.5, update_clip_lr=1.0, local_epochs=1)
    result, _ = simulate_secure(cfg, fed, tmp_path / "run", progress=False)
    clips = [r["clip"] for r in result["rounds"]]
    # Every update's norm is above 0.01: ×e^{−η(b̄ − γ)} a round with b̄ = 0 plus noise of std σ_b / 40
    # (σ_b = z, above 40/20): 5 moves up while every norm is above, 4 of the noise's std spared
    rule = result["adaptive_update_clip"]
    assert rule["count_noise"] == pytest.approx(4 * result["noise"]["noise_multiplier"]) and rule["clients"] == 40
    assert clips[4] > 0.01 * math.exp(0.5 * 5 - 4 * math.sqrt(5) * rule["count_noise"] / 40), clips
    fixed, _ = simulate_secure(cfg, dataclasses.replace(fed, update_clip_quantile=0.0), progress=False)
    assert result["epsilon_spent"] == pytest.approx(fixed["epsilon_spent"], rel=1e-3)
    assert result["noise"]["dim"] == fixed["noise"]["dim"] + 1


@pytest.mark.parametrize("unit", ["record", "client"])
def test_the_plain_and_multi_round_sums_are_the_protocols_bit_for_bit_and_validation_is_scored(unit):
    """--secure-sum plain adds the clients' vectors in this process, and multi-round runs the protocol
    set up once a run: every round's sum, and so the weights, the clip and ε, are those of the run
    that ran the per-round protocol; with --validation
    each evaluation scores the held-out samples too (what the adaptive table screens on)."""
    require("fmnist")
    cfg, fed = settings(rounds=2)
    cfg = dataclasses.replace(cfg, validation=500)
    if unit == "client":
        fed = dataclasses.replace(fed, num_clients=5, privacy_unit="client", update_clip=0.5, local_steps=2,
                                  update_clip_quantile=0.5, update_clip_lr=1.0)
    ways = ("protocol", "plain", "multi-round")
    runs = [SecureFederation(cfg, dataclasses.replace(fed, secure_sum=way), None) for way in ways]
    records = [[run.take_round(r) for r in (1, 2)] for run in runs]
    assert not runs[0].plain and runs[1].plain and not runs[2].plain and runs[2].runs is not None
    for other in (runs[0], runs[2]):  # the per-round and the multi-round protocol: the plain sum's weights
        for k, v in other.model["student"].items():
            assert torch.equal(v, runs[1].model["student"][k]), k
    for kept, plain, multi in zip(*records):
        assert kept["epsilon"] == plain["epsilon"] == multi["epsilon"]
        assert kept.get("clip") == plain.get("clip") == multi.get("clip")
        assert kept["test_accuracy"] == plain["test_accuracy"] == multi["test_accuracy"]
        assert 0.0 <= plain["validation_accuracy"] <= 1.0
    assert records[0][-1]["bytes_to_server"] > records[1][-1]["bytes_to_server"]  # the protocol's shares and keys
    if unit == "client":
        assert records[1][-1]["clip"] != 0.5


def test_the_plain_sum_is_refused_outside_the_in_process_simulation():
    from fedsd.errors import ConfigError

    with pytest.raises(ConfigError, match="--secure-sum plain"):
        FedConfig(secure_sum="plain").validate()
    with pytest.raises(ConfigError, match="--secure-sum: unknown value"):
        FedConfig(secure_sum="clear", secure_aggregation=True, noise="distributed").validate()


def test_a_normalized_update_clip_steps_by_the_server_lr_per_unit_of_clip():
    """--update-clip-normalize: the server applies --server-lr × the round's mean over its clip S
    (post-processing: the same sums, the same clip and ε). At --server-lr S₀ the first round is
    plain FedAvg's; the second steps by S₀/S₁ of plain FedAvg's step from the same model."""
    require("fmnist")
    cfg, fed = settings(rounds=2)
    fed = dataclasses.replace(fed, num_clients=5, privacy_unit="client", update_clip=0.5, local_steps=2,
                              update_clip_quantile=0.5, update_clip_lr=1.0, secure_sum="plain")
    plain, normalized = (SecureFederation(cfg, f, None) for f in (
        fed, dataclasses.replace(fed, update_clip_normalize=True, server_lr=0.5)))
    before = {k: v.clone() for k, v in plain.model["student"].items()}
    first = [run.take_round(1) for run in (plain, normalized)]
    assert first[0]["clip"] == first[1]["clip"] != 0.5 and first[0]["epsilon"] == first[1]["epsilon"]
    for k, v in plain.model["student"].items():
        torch.testing.assert_close(v, normalized.model["student"][k], rtol=1e-5, atol=1e-7)
    start = {k: v.clone() for k, v in normalized.model["student"].items()}
    plain.model = dict(plain.model, student={k: v.clone() for k, v in start.items()})
    plain.states = [None if s is None else s for s in normalized.states]
    steps = []
    for run in (plain, normalized):
        run.take_round(2)
        steps.append(torch.cat([(run.model["student"][k] - start[k]).flatten().double() for k in start
                                if start[k].is_floating_point()]))
    ratio = float(steps[1].norm() / steps[0].norm())
    assert ratio == pytest.approx(0.5 / first[0]["clip"], rel=1e-4), ratio
    assert any(not torch.equal(before[k], start[k]) for k in before)
    from fedsd.errors import ConfigError

    with pytest.raises(ConfigError, match="--update-clip-normalize"):
        dataclasses.replace(fed, update_clip_quantile=0.0, update_clip_normalize=True).validate()


def test_more_clients_than_an_owner_shares_with_are_refused_before_any_work_unless_the_sum_is_plain(tmp_path):
    """A study at 300 clients died in round 1 with a traceback (a neighbourhood above the 128 a
    client shares with), after the progress bar had started: now a clear refusal naming the way
    on, before anything is read or written; with --secure-sum plain the same run passes its checks."""
    from fedsd import dry_run
    from fedsd.errors import ConfigError

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", batch_size=32, lr=0.05, epsilon=3.0, threads=1).resolved()
    fed = FedConfig(num_clients=300, rounds=2, secure_aggregation=True, noise="distributed", privacy_unit="client",
                    update_clip=0.2)
    with pytest.raises(ConfigError, match="--clients 300: .*--secure-sum plain"):
        simulate_secure(cfg, fed, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    require("fmnist")
    with pytest.raises(dry_run.DryRun, match="300 clients"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDSD_DRY_RUN", "1")
        simulate_secure(cfg, dataclasses.replace(fed, secure_sum="plain"), tmp_path / "run", progress=False)


def test_the_simulate_command_of_a_distributed_run_that_trained_exits_zero(tmp_path, capsys):
    """`fedsd simulate --secure-aggregation --noise distributed` said "no client trained in any of the
    rounds" and exited 1 after a run that trained: its rounds count survivors, not trained clients."""
    require("fmnist")
    from fedsd.cli.main import main

    assert main(["simulate", "--dataset", "fmnist", "--subset", "600", "--batch-size", "60", "--clients", "3",
                 "--rounds", "1", "--secure-aggregation", "--noise", "distributed", "--threads", "1", "--quiet",
                 "--out", str(tmp_path / "out")]) == 0
    assert "no client trained" not in capsys.readouterr().err


def test_a_dry_run_states_the_plan_and_computes_no_features(tmp_path, monkeypatch):
    """A dry run of a features recipe (`FEDSD_DRY_RUN=1 fedsd simulate --recipe distributed-features`)
    computed the whole data set's ScatterNet features before it stopped (a minute on one core, and
    a cache file written): it states the same plan, σ included, and computes none."""
    require("fmnist")
    from fedsd import dry_run

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", features="scatter", model="scatter-linear", batch_size=64,
                      lr=1.0, epsilon=3.0, subset=600, threads=1).resolved()
    fed = FedConfig(num_clients=3, rounds=2, secure_aggregation=True, noise="distributed")
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    with pytest.raises(dry_run.DryRun) as stopped:
        simulate_secure(cfg, fed, tmp_path / "run", progress=False)
    assert not (tmp_path / "cache" / "features").exists() and not (tmp_path / "run").exists()
    monkeypatch.delenv("FEDSD_DRY_RUN")
    whole = SecureFederation(cfg, fed, None)  # the plan of the run that would go on: the same σ
    assert f"σ={whole.noise.noise_multiplier:.3f} " in str(stopped.value)
    assert len(whole.shards) == 3 and whole.test[0].shape[1:] == whole.shards[0].x_train.shape[1:]
