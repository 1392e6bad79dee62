"""σ calibration and the spent ε agree with Opacus' own accountants."""
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from fedsd.privacy import accounting as privacy
from fedsd.privacy.accounting import AccountantHistory, plan, steps_per_epoch
from fedsd.errors import BudgetError


@pytest.mark.parametrize("accountant,cls", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_plan_spends_at_most_the_budget_per_opacus(accountant, cls):
    p = plan(epsilon=3.0, delta=1e-5, num_samples=60000, batch_size=1600, epochs=60, accountant=accountant)
    assert p.sample_rate == pytest.approx(1600 / 60000)
    assert p.planned_steps == 60 * steps_per_epoch(60000, 1600) == 60 * 38
    opacus = cls()
    for _ in range(p.planned_steps):
        opacus.step(noise_multiplier=p.noise_multiplier, sample_rate=p.sample_rate)
    spent = opacus.get_epsilon(delta=1e-5)
    assert 0.99 * 3.0 <= spent <= 3.0
    ledger = AccountantHistory(accountant)
    for _ in range(p.planned_steps):
        ledger.step(p.noise_multiplier, p.sample_rate)
    assert ledger.epsilon(1e-5) == pytest.approx(spent, rel=1e-9)
    if accountant == "rdp":
        assert p.noise_multiplier == pytest.approx(2.05, abs=0.03)  # the papers' FMNIST: 2.04 under Opacus' q = 1/38


def test_ledger_across_rounds_equals_one_accountant():
    """A client's history carried round to round is one accountant, never a fresh one per round."""
    one = AccountantHistory("rdp")
    for _ in range(30):
        one.step(1.1, 0.05)
    carried = AccountantHistory("rdp")
    for _ in range(3):
        carried = AccountantHistory("rdp", carried.history)
        for _ in range(10):
            carried.step(1.1, 0.05)
    assert carried.steps == 30
    assert carried.epsilon(1e-5) == pytest.approx(one.epsilon(1e-5), rel=1e-12)
    fresh_per_round = AccountantHistory("rdp")
    for _ in range(10):
        fresh_per_round.step(1.1, 0.05)
    assert carried.epsilon(1e-5) > 1.2 * fresh_per_round.epsilon(1e-5)  # 3 rounds spend more than 1


def test_epsilon_after_is_a_dry_run():
    ledger = AccountantHistory("rdp")
    ledger.step(1.0, 0.1)
    before = ledger.epsilon(1e-5)
    after = ledger.epsilon_after(20, 1.0, 0.1, 1e-5)
    assert after > before and ledger.epsilon(1e-5) == before and ledger.steps == 1


def test_impossible_budget_is_refused():
    with pytest.raises(BudgetError, match="--epsilon"):
        plan(epsilon=1e-4, delta=1e-5, num_samples=1000, batch_size=1000, epochs=10000)


def test_rdp_orders_reach_the_optimum_and_opacus_root_logging_is_left_alone():
    """A short run at a high sample rate has its best Rényi order above Opacus' 63: with fedsd's
    orders no "optimal order is the largest alpha" warning arises (its cause is fixed), and
    importing fedsd gives the root logger no handler (Opacus' basicConfig is undone)."""
    import subprocess
    import sys
    import warnings

    from fedsd.privacy.accounting import AccountantHistory, plan

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = plan(3.0, 1e-5, 1000, 128, 2, "rdp")
        ledger = AccountantHistory("rdp", [[p.noise_multiplier, p.sample_rate, p.planned_steps]])
        assert ledger.epsilon(1e-5) <= 3.0
    code = "import logging, fedsd.training.loop, fedsd.privacy.accounting; assert not logging.getLogger().handlers"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ledger_epsilon_is_opacus_rdp_accountant_to_the_bit():
    """AccountantHistory composes per-step RDP once per (q, σ) (a small shard's q makes Opacus' RDP slow);
    the ε it reports is the one Opacus' RDPAccountant gives for the same history."""
    from fedsd.privacy.accounting import RDP_ORDERS

    history = [[1.3, 16 / 60, 4], [0.9, 0.02, 100], [1.3, 16 / 60, 8]]
    opacus = RDPAccountant()
    opacus.history = [tuple(h) for h in history]
    for delta in (1e-5, 1e-3):
        assert AccountantHistory("rdp", history).epsilon(delta) == float(opacus.get_epsilon(delta, alphas=RDP_ORDERS))


def test_calibration_is_kept_on_disk_for_other_processes(tmp_path, monkeypatch):
    """A σ searched once is found again by a fresh process (a Ray worker, a ClientApp) without
    a search; an unreadable cache file is searched again and rewritten."""
    import fedsd.privacy.accounting as privacy

    args = (3.0, 1e-5, 6000, 16, 2)
    searched = privacy.plan(*args, cache_dir=str(tmp_path))
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"
    privacy.plan.cache_clear()  # as a fresh process
    monkeypatch.setattr(privacy, "_calibrate", lambda *a: pytest.fail("searched again despite the cache"))
    assert privacy.plan(*args, cache_dir=str(tmp_path)) == searched
    privacy.plan.cache_clear()
    files[0].write_text("{not json")
    monkeypatch.undo()
    assert privacy.plan(*args, cache_dir=str(tmp_path)) == searched
    assert privacy.PrivacyPlan(**__import__("json").loads(files[0].read_text())) == searched


def test_a_prior_release_is_composed_into_the_plan_and_its_sigma_calibrated_to_what_is_left(tmp_path):
    """A run's private feature normalisation (two Gaussian releases at σ = 8 over the whole set)
    spends part of ε before DP-SGD: σ is searched with the accountant's history starting with
    it, so the two together spend the target, and a saved plan says so (a plan without a prior
    saves what it always did, so older runs resume)."""
    prior = ((8.0, 1.0, 2),)
    alone = privacy.plan(3.0, 1e-5, 50_000, 8192, 60, cache_dir=str(tmp_path))
    after = privacy.plan(3.0, 1e-5, 50_000, 8192, 60, cache_dir=str(tmp_path), prior=prior)
    assert after.noise_multiplier > alone.noise_multiplier
    spent = privacy.AccountantHistory("rdp", [[8.0, 1.0, 2], [after.noise_multiplier, after.sample_rate,
                                                              after.planned_steps]]).epsilon(1e-5)
    assert 3.0 - privacy.EPSILON_TOLERANCE <= spent <= 3.0
    assert "prior" not in alone.to_dict() and after.to_dict()["prior"] == [[8.0, 1.0, 2]]
    assert privacy.PrivacyPlan.from_dict(after.to_dict()) == after
    privacy.plan.cache_clear()
    assert privacy.plan(3.0, 1e-5, 50_000, 8192, 60, cache_dir=str(tmp_path), prior=prior) == after  # from disk
    with pytest.raises(BudgetError, match="after the .* spent first"):
        privacy.plan(0.5, 1e-5, 50_000, 8192, 60, cache_dir=str(tmp_path), prior=prior)


def test_the_ledger_says_what_is_spent_of_the_maximum_and_never_an_epsilon_left(tmp_path, capsys):
    """`fedsd ledger` said "left ε = 0.5" (max − spent), then the client admitted a run of ε = 1:
    under RDP a run fits when its steps composed with those spent stay within the maximum, which
    subtraction does not tell. The ledger says what is spent of the maximum, and how a run is
    admitted; its JSON has no left_epsilon."""
    import json

    from fedsd.cli.main import main
    from fedsd.privacy.accounting import PrivacyFilter

    ledger = PrivacyFilter(3.0, 1e-5)
    first = plan(2.5, 1e-5, 60000, 256, 5)
    ledger.spend(first.noise_multiplier, first.sample_rate, first.planned_steps, run="exp-1")
    second = plan(1.0, 1e-5, 60000, 256, 5)
    ledger.check(1.0, 1e-5, second.noise_multiplier, second.sample_rate, second.planned_steps)  # fits: ε 1 > 3 − 2.5
    (tmp_path / "ledger-abc.json").write_text(json.dumps(ledger.state_dict()))
    record = ["--record-dir", str(tmp_path / "record")]
    assert main(["ledger", "--state-dir", str(tmp_path), *record]) == 0
    text = capsys.readouterr().out
    assert "left" not in text.replace(str(tmp_path), "")
    assert f"spent           ε = {ledger.epsilon():.3f} of the owner's 3 over" in text
    assert "fits if its steps, composed (RDP) with those spent, stay within ε ≤ 3" in text
    assert main(["ledger", "--state-dir", str(tmp_path), "--json", *record]) == 0
    [said] = json.loads(capsys.readouterr().out)
    assert "left_epsilon" not in said and said["spent_epsilon"] == pytest.approx(ledger.epsilon())
    assert "max_epsilon - spent_epsilon is not what a run may spend" in said["admits"]
    with pytest.raises(privacy.LedgerSpent, match=r"lifetime budget: spent ε=2.49 of the owner's ε=3; .*composed with "
                                                  r"what was spent \(RDP\), would bring it to ε="):
        whole = plan(3.0, 1e-5, 60000, 256, 5)
        ledger.spend(whole.noise_multiplier, whole.sample_rate, whole.planned_steps)
