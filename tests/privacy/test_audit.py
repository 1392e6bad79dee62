"""`fedsd audit`: the one-run bound (Steinke et al. 2023) against Monte-Carlo, and audits of
real Fashion-MNIST runs: sound (below the accountant's ε), with power (a broken mechanism is caught),
the same in every clipping mode, central and for one client of a federation."""
import json
import math

import numpy as np
import pytest

from fedsd.privacy import canary_audit as audit
from fedsd.settings.run import GRAD_SAMPLE_MODES, TrainConfig
from fedsd.cli.audit import AuditConfig, run_audit
from tests.conftest import require


# -- the bound ----------------------------------------------------------------------------
def test_p_value_without_delta_is_the_binomial_tail_monte_carlo():
    rng = np.random.default_rng(0)
    for eps, r, v in [(1.0, 100, 80), (2.0, 50, 45), (0.5, 200, 120)]:
        p = 1 / (1 + math.exp(-eps))
        draws = rng.binomial(r, p, size=400_000)
        assert abs(audit.p_value(1000, r, v, eps, 0.0) - (draws >= v).mean()) < 3e-3


def test_all_guesses_right_gives_the_closed_form():
    """r guesses, all right, δ = 0: p^r = β, so ε = log(p / (1 − p)) with p = β^(1/r)."""
    for r, beta in [(100, 0.05), (20, 0.01)]:
        p = beta ** (1 / r)
        assert audit.epsilon_lower_bound(1000, r, r, 0.0, beta) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)


def test_the_delta_term_only_lowers_the_bound():
    no_delta = audit.epsilon_lower_bound(1000, 100, 90, 0.0)
    with_delta = audit.epsilon_lower_bound(1000, 100, 90, 1e-5)
    assert 0 < with_delta < no_delta
    assert audit.p_value(1000, 100, 90, 1.0, 1e-5) > audit.p_value(1000, 100, 90, 1.0, 0.0)
    # δ large enough to explain everything: no lower bound at all.
    assert audit.epsilon_lower_bound(1000, 100, 90, 0.01) == 0.0


def test_the_bound_is_sound_for_randomized_response_monte_carlo():
    """Guessers that are ε₀-DP randomized response (each guess right with e^ε₀/(1 + e^ε₀)): the
    lower bound exceeds ε₀ in at most β of the trials, and is not vacuous."""
    rng = np.random.default_rng(1)
    eps0, r, trials = 1.0, 200, 600
    p = 1 / (1 + math.exp(-eps0))
    bounds = np.array([audit.epsilon_lower_bound(1000, r, int(rng.binomial(r, p)), 0.0, 0.05) for _ in range(trials)])
    exceed = (bounds > eps0).mean()
    assert exceed <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials), exceed
    assert np.median(bounds) > 0.4  # it has power: ε₀ = 1 is mostly seen as more than 0.4


def test_guess_uses_a_union_bound_over_the_guess_counts():
    scores = np.arange(1000, dtype=float)
    included = scores >= 500  # perfect separation
    outcome = audit.guess(scores, included, delta=0.0, confidence=0.95)
    assert outcome.correct == outcome.guesses == 1000
    beta = 0.05 / len(audit.GUESS_FRACTIONS)
    assert outcome.epsilon_lower_bound == pytest.approx(audit.epsilon_lower_bound(1000, 1000, 1000, 0.0, beta))


# -- audits of real runs (Fashion-MNIST subsets) ----------------------------------------------------
SMALL = dict(dataset="fmnist", subset=3000, epochs=4, batch_size=150, lr=0.5, threads=2)


def small_audit(method="dpsgd", epsilon=2.0, **kw):
    settings = {k: kw.pop(k) for k in ("canaries", "threat", "noise_scale", "clients") if k in kw}
    cfg = TrainConfig(method=method, epsilon=epsilon, **{**SMALL, **kw})
    return run_audit(cfg, AuditConfig(**settings), progress=False)


@pytest.mark.slow
def test_canaries_go_through_every_clipping_mode_alike():
    """The canaries are clipped and noised with the samples in every --grad-sample-mode: the
    same run gives the same canary scores (and the same model) whichever mode clips it."""
    require("fmnist")
    import torch

    from fedsd.data import datasets as data_lib
    from fedsd.privacy import accounting as privacy
    from fedsd.training.central import prepare_run
    from fedsd.training.loop import planned_trainer, initial_model

    scores, students = {}, {}
    for mode in GRAD_SAMPLE_MODES:
        cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=2.0, subset=600, epochs=1, batch_size=100,
                          lr=0.5, grad_sample_mode=mode, threads=2, memory_format="contiguous")
        inputs = prepare_run(cfg)
        plan = privacy.plan(2.0, 1e-5, 600, 100, 1, "rdp")
        trainer = planned_trainer(inputs.cfg, data_lib.prepare(inputs.data, inputs.train_indices), plan)
        canaries = audit.GradientCanaries(50, inputs.cfg.clip, plan.sample_rate, plan.noise_multiplier, 100, seed=7)
        model, _, _ = trainer.local_update(initial_model(inputs.cfg, 10), None, [1],
                                           callbacks=[audit.AuditedSteps(canaries)])
        scores[mode], students[mode] = canaries.scores.clone(), model["student"]
        assert canaries.joins[~canaries.included].sum() == 0 and canaries.joins[canaries.included].sum() > 0
    for mode in GRAD_SAMPLE_MODES:
        torch.testing.assert_close(scores[mode], scores["bk"], rtol=0, atol=1e-9)
        for k in students["bk"]:
            torch.testing.assert_close(students[mode][k], students["bk"][k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("clients", [1, 2], ids=["central", "client-of-2"])
@pytest.mark.parametrize("method", ["dpsgd", "dp3sd", "dpdsd"])
def test_the_audit_is_sound(method, clients):
    require("fmnist")
    report = small_audit(method, 2.0, clients=clients, **({"batch_size": 75} if clients == 2 else {}))
    assert 1.9 < report["epsilon_accountant"] <= 2.0
    assert report["epsilon_lower_bound"] <= report["epsilon_accountant"], report
    assert report["steps"] == 80 and report["clients"] == clients


@pytest.mark.slow
def test_the_audit_catches_noise_below_what_is_accounted(tmp_path):
    """--noise-scale 0.1: a tenth of the noise the accountant counts. The white-box lower bound
    rises above the accountant's ε, so the audit shows the mechanism broken; audit.json says so."""
    require("fmnist")
    from fedsd.cli.main import main

    out = tmp_path / "broken"
    assert main(["audit", "--dataset", "fmnist", "--method", "dpsgd", "--epsilon", "2", "--subset", "3000",
                 "--epochs", "4", "--batch-size", "150", "--lr", "0.5", "--threads", "2", "--noise-scale", "0.1",
                 "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "audit.json").read_text())
    assert report["epsilon_lower_bound"] > report["epsilon_accountant"], report
    for key in ("epsilon_accountant", "epsilon_lower_bound", "confidence", "canaries", "guesses", "correct",
                "threat", "method"):
        assert key in report
    assert report["canaries"] == 1000 and report["threat"] == "white" and report["noise_scale"] == 0.1
    assert (out / "scores.png").stat().st_size > 10_000
    assert len(json.loads((out / "canaries.json").read_text())["score"]) == 1000


@pytest.mark.slow
def test_the_teacher_costs_no_privacy():
    """The teacher is the run's own earlier model. White-box: dp3sd and dpdsd release exactly
    what dpsgd releases on the canaries' coordinates (the same guesses, the same bound).
    Black-box, canaries that are mislabelled training images, which the teacher sees too: each
    audits below the accountant's ε at ε = 8."""
    require("fmnist")
    white = {m: small_audit(m, 4.0) for m in ("dpsgd", "dp3sd", "dpdsd")}
    for m in ("dp3sd", "dpdsd"):
        assert white[m]["correct"] == white["dpsgd"]["correct"]
        assert white[m]["epsilon_lower_bound"] == white["dpsgd"]["epsilon_lower_bound"]
    black = {m: small_audit(m, 8.0, threat="black", canaries=200) for m in ("dpsgd", "dp3sd", "dpdsd")}
    for m, report in black.items():
        assert report["epsilon_lower_bound"] <= report["epsilon_accountant"], report


@pytest.mark.slow
def test_the_audit_runs_on_scatternet_features(tmp_path):
    """--features scatter: the audited holder trains on its features (the black-box canaries are
    scattered like the data), and a tenth of the accounted noise shows as a broken mechanism there
    too; the white-box bound stays below the accountant's ε at the full noise."""
    require("fmnist")
    from fedsd.cli.main import main

    base = ["audit", "--dataset", "fmnist", "--features", "scatter", "--method", "dpsgd", "--epsilon", "2",
            "--subset", "3000", "--epochs", "4", "--batch-size", "150", "--lr", "0.5", "--threads", "2", "--quiet"]
    reports = {}
    for name, extra in (("broken", ["--noise-scale", "0.1"]), ("sound", []), ("black", ["--threat", "black",
                                                                                       "--canaries", "200"])):
        assert main(base + extra + ["--out", str(tmp_path / name)]) == 0
        reports[name] = json.loads((tmp_path / name / "audit.json").read_text())
    assert reports["broken"]["epsilon_lower_bound"] > reports["broken"]["epsilon_accountant"], reports["broken"]
    for name in ("sound", "black"):
        assert reports[name]["epsilon_lower_bound"] <= reports[name]["epsilon_accountant"], reports[name]


def test_bad_audit_options_are_refused_before_any_work(tmp_path):
    from fedsd.cli.main import main

    base = ["audit", "--dataset", "fmnist", "--method", "dpsgd", "--epsilon", "2", "--out", str(tmp_path / "x")]
    assert main(base + ["--canaries", "3"]) == 2
    assert main(base + ["--noise-scale", "0"]) == 2
    assert main(base + ["--confidence", "1.5"]) == 2
    assert main(base + ["--features", "scatter", "--feature-norm", "private"]) == 2  # a release it would not see
    assert not (tmp_path / "x").exists()
