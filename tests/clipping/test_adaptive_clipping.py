"""Adaptive clipping for records (fedsd.clipping.adaptive: Andrew et al. 2021): the clip follows a
quantile of the per-sample gradient norms, its count's cost composed into the run's ε."""
import dataclasses
import math

import pytest
import torch

from fedsd.clipping.adaptive import QuantileClip, centred_count
from fedsd.errors import ConfigError
from fedsd.privacy.accounting import RDP_ORDERS, AccountantHistory, plan
from fedsd.settings.run import TrainConfig
from tests.conftest import require


def test_the_count_is_centred_and_a_sample_whose_gradient_is_not_finite_counts_below():
    norms = torch.tensor([0.5, 1.0, 1.5, float("nan"), float("inf"), 3.0])
    # below: 0.5, 1.0 (at the clip), nan and inf (joined the sum as zero); above: 1.5, 3.0
    assert float(centred_count(norms, 1.0)) == 4 - 0.5 * 6


def test_the_rule_settles_at_the_quantile_from_ten_times_above_and_below():
    """The geometric update (the paper's Algorithm 1) with its noised count, on norms from a fixed
    distribution: from 10× and 0.1× its true quantile, the clip ends within 10 % of it."""
    g = torch.Generator().manual_seed(0)
    norms = torch.empty(200_000).log_normal_(0.0, 1.0, generator=g)
    true = float(norms.quantile(0.3))
    rule = QuantileClip(quantile=0.3, lr=0.2, count_noise=256 / 20, expected_batch=256, start=true)
    for start in (10 * true, 0.1 * true):
        clip = start
        for _ in range(600):
            batch = norms[torch.randint(len(norms), (256,), generator=g)]
            noise = float(torch.normal(0.0, rule.count_noise, (1,), generator=g))
            clip = rule.next_clip(clip, float(centred_count(batch, clip)) + noise)
        assert abs(clip / true - 1) < 0.10, (start, clip, true)


def test_the_gradient_and_the_count_spend_what_dp_accounting_composes_for_them():
    """Theorem 1: the gradient at σ_Δ and the centred count at σ_b on one Poisson sample spend
    what the run's accountant counts for the plan's z; dp_accounting's composition of the two
    mechanisms (its own code) says the same. Without the lowered σ_Δ (both at z), it says more."""
    from dp_accounting import ComposedDpEvent, GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    planned = plan(3.0, 1e-5, 60_000, 256, 10)
    z, q, steps = planned.noise_multiplier, planned.sample_rate, planned.planned_steps
    rule = QuantileClip.of(TrainConfig(clip=0.1, clip_quantile=0.5, batch_size=256))
    assert rule.count_noise == 256 / 20  # the paper's m/20

    def composed(gradient_sigma: float) -> float:
        accountant = RdpAccountant(RDP_ORDERS)
        accountant.compose(SelfComposedDpEvent(PoissonSampledDpEvent(q, ComposedDpEvent(
            [GaussianDpEvent(gradient_sigma), GaussianDpEvent(2 * rule.count_noise)])), steps))
        return accountant.get_epsilon(1e-5)

    ours = AccountantHistory("rdp", [[z, q, steps]]).epsilon(1e-5)
    assert ours <= 3.0
    assert composed(rule.gradient_noise_multiplier(z)) == pytest.approx(ours, rel=1e-5)
    assert composed(z) > ours * 1.001  # the count's cost, had the gradient kept all of z


def test_bad_values_are_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    from fedsd.cli.main import main
    from fedsd.settings.run import validate

    base = TrainConfig(dataset="fmnist", clip=0.1).resolved()
    for changes, flag in [(dict(clip_quantile=1.0), "--clip-quantile"), (dict(clip_quantile=-0.2), "--clip-quantile"),
                          (dict(clip_quantile=0.5, clip_lr=-1.0), "--clip-lr"),
                          (dict(clip_quantile=0.5, clip_lr=float("nan")), "--clip-lr"),
                          (dict(clip_quantile=0.5, clip_count_noise=-1.0), "--clip-count-noise")]:
        with pytest.raises(ConfigError, match=flag):
            validate(dataclasses.replace(base, **changes), 60_000)
    # a count noise that would leave the gradient nothing of z: refused, named, before any step
    with pytest.raises(ConfigError, match="--clip-count-noise"):
        QuantileClip(0.5, 0.2, count_noise=0.4, expected_batch=256, start=0.1).gradient_noise_multiplier(1.0)
    require("fmnist")  # and `fedsd train` says so before any work, its dry run too
    monkeypatch.setenv("FEDSD_DRY_RUN", "1")
    assert main(["train", "--clip-quantile", "0.7", "--clip-count-noise", "0.1", "--epochs", "1", "--epsilon", "3",
                 "--out", str(tmp_path / "run")]) != 0
    assert "--clip-count-noise: 0.1 leaves nothing" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_secure_aggregation_refuses_it_until_the_count_joins_the_secure_sum():
    from fedsd.settings.federation import FedConfig, client_config

    cfg = TrainConfig(dataset="fmnist", clip_quantile=0.5)
    with pytest.raises(ConfigError, match="--clip-quantile"):
        client_config(cfg, FedConfig(secure_aggregation=True))
    assert client_config(cfg, FedConfig()).clip_quantile == 0.5


def _trainer(mode: str, clip: float, **changes):
    from fedsd.data import datasets as data_lib
    from fedsd.training.loop import DPTrainer

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, epochs=4, batch_size=100, subset=800, clip=clip,
                      clip_quantile=0.1, grad_sample_mode=mode, memory_format="contiguous", threads=1,
                      **changes).resolved()
    images = data_lib.load("fmnist")
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 800, 0))
    return DPTrainer(cfg, tensors, plan(cfg.epsilon, cfg.delta, 800, 100, 4))


@pytest.mark.slow
def test_every_clipping_route_moves_the_clip_alike_and_a_resumed_call_goes_on_from_it():
    """bk, ghost and Opacus' per-sample routes count the same norms: one clip trajectory. Two calls
    of one epoch (the clip carried in the state) end where one call of two does."""
    require("fmnist")
    from fedsd.training.loop import initial_model

    clips, weights = {}, {}
    for mode in ("bk", "ghost", "hooks", "functorch"):
        trainer = _trainer(mode, clip=100.0, lr=0.001)
        model, state, metrics = trainer.local_update(initial_model(trainer.cfg, 10), None, [1, 2])
        clips[mode], weights[mode] = metrics["clip"], model["student"]
        assert state.clip == metrics["clip"]
    # every norm below it: ×e^{−η(1−γ)} a step (16 steps), less what the noise takes
    assert clips["bk"] < 100 * math.exp(-0.2 * 0.9 * 12), clips
    for mode in ("ghost", "hooks", "functorch"):
        assert clips[mode] == pytest.approx(clips["bk"], rel=1e-4), clips
    trainer = _trainer("bk", clip=100.0, lr=0.001)
    model, state, _ = trainer.local_update(initial_model(trainer.cfg, 10), None, [1])
    restored = type(state).from_state_dict(state.state_dict(trainer.plan), trainer.plan)
    model, state, metrics = trainer.local_update(model, restored, [2])
    assert metrics["clip"] == clips["bk"]
    assert all(torch.equal(model["student"][k], weights["bk"][k]) for k in model["student"])


@pytest.mark.slow
def test_from_a_tenth_of_the_tuned_clip_it_rises_and_secret_draws_noise_the_count_too():
    require("fmnist")
    from fedsd.privacy.secret_random import SecretStream
    from fedsd.training.loop import TrainState, initial_model

    trainer = _trainer("bk", clip=0.001)
    _, _, seeded = trainer.local_update(initial_model(trainer.cfg, 10), None, [1, 2])
    assert seeded["clip"] > 0.001 * math.exp(0.2 * 0.1 * 14)  # every norm above it: ×e^{ηγ} a step, less noise
    secret = [trainer.local_update(initial_model(trainer.cfg, 10), TrainState(secret=SecretStream.fresh()), [1])[2]
              for _ in range(2)]
    assert secret[0]["clip"] != secret[1]["clip"]  # the count's noise from each call's own secret stream
    # the gradient's noise multiplier is the lowered σ_Δ; the accountant's, the plan's z
    assert trainer.optimizer.noise_multiplier > trainer.plan.noise_multiplier == seeded["noise_multiplier"]


@pytest.mark.slow
def test_a_central_run_records_the_clip_each_epoch_and_plots_it(tmp_path):
    require("fmnist")
    from fedsd.training.central import train

    result, _ = train(TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, epochs=2, batch_size=100, subset=600,
                                  clip=100.0, lr=0.001, clip_quantile=0.5, threads=1), out=tmp_path / "run",
                      progress=False)
    clips = [e["clip"] for e in result["epochs"]]
    assert clips[0] < 100 * math.exp(-0.2 * 0.5 * 4) and clips[1] < clips[0]
    assert result["config"]["clip_quantile"] == 0.5
    assert (tmp_path / "run" / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_a_client_carries_its_clip_from_round_to_round_as_a_central_run_from_epoch_to_epoch(tmp_path):
    """--clients 1 --rounds 2 gives the weights and the clip of `fedsd train --epochs 2`: the
    estimate lives in the client's state between rounds, and each round records it."""
    require("fmnist")
    from fedsd.simulation.engine import simulate
    from fedsd.settings.federation import FedConfig
    from fedsd.training.central import train

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, batch_size=100, subset=600, clip=100.0, lr=0.001,
                      clip_quantile=0.5, seed=2, threads=1)
    fed, fed_weights = simulate(cfg, FedConfig(num_clients=1, rounds=2, local_epochs=1), out=tmp_path / "fed",
                                progress=False)
    central, weights = train(dataclasses.replace(cfg, epochs=2), progress=False)
    assert [r["client_clip"]["0"] for r in fed["rounds"]] == [e["clip"] for e in central["epochs"]]
    assert max((fed_weights[k] - weights[k]).abs().max().item() for k in weights) <= 1e-6
    assert (tmp_path / "fed" / "curve.png").stat().st_size > 0


def test_a_hostile_rate_count_noise_or_start_cannot_overflow_the_clip_or_push_it_below_float32s_reach():
    """A review playing the attacker overflowed the update with --clip-lr 1e4 (or a count noise of
    1e12) after the owner's charge, and drove the clip to 1e-44, where float32 rounds a clipped
    norm 1.49× past it: the rate is refused above 10, the fraction taken in [−1, 2], the clip kept
    within [start / 1e6, start × 1e6] and at or above 1e-4, and the start within [1e-4, 1e6]."""
    from fedsd.clipping.adaptive import LEAST_CLIP, SPAN
    from fedsd.settings.run import validate

    base = TrainConfig(dataset="fmnist", clip=0.1, clip_quantile=0.5).resolved()
    for changes, flag in [(dict(clip_lr=1e4), "--clip-lr"), (dict(clip=1e-44), "--clip"), (dict(clip=1e300), "--clip")]:
        with pytest.raises(ConfigError, match=flag):
            validate(dataclasses.replace(base, **changes), 60_000)
    rule = QuantileClip(0.5, 10.0, count_noise=1e12, expected_batch=256, start=0.1)
    clip = 0.1
    for released in (1e300, -1e300, float("nan"), 1e300, 1e300, 1e300, 1e300, 1e300, 1e300, 1e300):
        clip = rule.next_clip(clip, released)
        assert math.isfinite(clip) and max(0.1 / SPAN, LEAST_CLIP) <= clip <= 0.1 * SPAN
    assert clip == max(0.1 / SPAN, LEAST_CLIP)  # every fraction 1 (or none, NaN): down to the floor


@pytest.mark.slow
def test_an_owners_round_that_fails_after_its_charge_counts_as_spent_so_retries_cannot_drain_its_ledger(tmp_path,
                                                                                                     monkeypatch):
    """A server whose settings make an own-data owner's steps fail after its ledger was charged
    (a review playing the attacker did so with --clip-lr 1e4), asked again and again for the same
    round, drained the owner's lifetime ledger (each attempt charged anew, its state never
    advanced). Now the failed round is on disk as spent: the retries stop at the run's own ε."""
    require("fmnist")
    from flwr.app import ConfigRecord, Context, RecordDict

    from fedsd.app.client import handler as local
    from fedsd.app.records import model_to_record
    from fedsd.simulation.client_folders import write_client_folders
    from fedsd.settings.federation import FedConfig, client_config, to_flat
    from fedsd.training.loop import DPTrainer, initial_model

    cfg = TrainConfig(dataset="fmnist", method="dpsgd", batch_size=32, subset=300, threads=1, clip=1.0, epsilon=3.0,
                      grad_sample_mode="bk", memory_format="contiguous")
    fed = FedConfig(num_clients=2, rounds=3, client_data="own")
    write_client_folders(cfg, fed, tmp_path / "data", "npz", echo=lambda line: None)
    flat = {**to_flat(cfg, fed), "experiment-id": "x"}
    context = Context(run_id=1, node_id=1, node_config={
        "partition-id": 0, "num-partitions": 2, "data": str(tmp_path / "data" / "client-0"), "max-epsilon": 100.0,
        "state-dir": str(tmp_path / "state")}, state=RecordDict(), run_config={})
    message = RecordDict({"arrays": model_to_record(initial_model(client_config(cfg, fed), 10)),
                          "config": ConfigRecord({**flat, "server-round": 1})})
    monkeypatch.setattr(DPTrainer, "local_update", lambda *a, **k: (_ for _ in ()).throw(OverflowError("hostile")))
    for _ in range(6):
        try:
            local.train_reply(message, context)
        except OverflowError:
            pass
    side = local.client_side(message, context, plain_release=True)
    with local.peeked_ledger(side.node, side.fingerprint) as ledger:
        assert len(ledger.entries) == 3 and ledger.epsilon() <= 3.0 * 1.001, ledger.entries


@pytest.mark.slow
def test_a_normalized_step_is_the_private_gradient_over_the_steps_clip():
    """--clip-normalize: the same draws, the same clipped sum and noise, and a step 1/C as long:
    the private gradient in units of the clip (post-processing), so that --lr is per unit of clip."""
    require("fmnist")
    from fedsd.training.loop import initial_model

    steps = {}
    for normalize in (False, True):
        trainer = _trainer("bk", clip=0.5, lr=0.01, momentum=0.0, clip_normalize=normalize)
        start = initial_model(trainer.cfg, 10)
        model, _, metrics = trainer.local_update(start, None, [1])
        steps[normalize] = {k: model["student"][k] - start["student"][k] for k in start["student"]}
        assert metrics["clip"] != 0.5
    # one epoch of 8 steps, each at its own clip: compare the first step's size alone
    trainer = _trainer("bk", clip=0.5, lr=0.01, momentum=0.0, clip_normalize=True)
    plain = _trainer("bk", clip=0.5, lr=0.01, momentum=0.0)
    for t in (trainer, plain):
        t.load_student(initial_model(t.cfg, 10)["student"])
        t.generator.manual_seed(0)
        t.clipper.set_clip(0.5)
    from fedsd.methods import method_of

    objective = method_of(trainer.cfg).epoch_loss(trainer.cfg, 1)
    x, y = trainer.data.x_train[:100], trainer.data.y_train[:100]
    before = {k: v.clone() for k, v in trainer.student_weights().items()}
    trainer.train_on_batch(x, y, objective)
    plain.train_on_batch(x, y, objective)
    for k in before:
        moved, moved_plain = trainer.student_weights()[k] - before[k], plain.student_weights()[k] - before[k]
        assert torch.allclose(moved, moved_plain / 0.5, rtol=1e-4, atol=1e-7), k
    assert not all(torch.equal(steps[True][k], steps[False][k]) for k in steps[True])


def test_clip_normalize_applies_to_an_adaptive_clip_only():
    from fedsd.settings.run import validate

    with pytest.raises(ConfigError, match="--clip-normalize"):
        validate(TrainConfig(dataset="fmnist", clip_normalize=True).resolved(), 60_000)
