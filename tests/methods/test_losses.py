"""The losses of docs/algorithms.md against hand computations (plain Python math, sample by sample)."""
import dataclasses
import math

import pytest
import torch

from fedsd.methods.losses import dkd_loss, dp3sd_loss, dpdsd_loss, kd_loss


def softmax(z, tau):
    e = [math.exp(v / tau) for v in z]
    return [v / sum(e) for v in e]


def hand_dp3sd(zs, zt, y, tau_s, tau_t, alpha):
    ce = -math.log(softmax(zs, tau_s)[y])
    pt, ps = softmax(zt, tau_t), softmax(zs, tau_t)
    kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, ps))
    return alpha * ce + (1 - alpha) * tau_t ** 2 * kl


def hand_dpdsd(zs, zt, y, tau, alpha, beta, ce_tau=1.0):
    T, S = softmax(zt, tau), softmax(zs, tau)
    gamma = T[y] - 1 / len(zs)
    tcsd = -math.exp(gamma) * T[y] * math.log(S[y])
    ncsd = -math.exp(gamma) * sum(T[i] * math.log(S[i]) for i in range(len(zs)) if i != y)
    ce = -math.log(softmax(zs, ce_tau)[y])
    return ce + alpha * tcsd + beta * ncsd


def kl(p, q):
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)


def hand_dkd(zs, zt, y, tau, alpha, beta, ce_tau=1.0):
    """Decoupled KD (Zhao et al. 2022), written out: the target/rest split and the non-target
    classes renormalised, each a KL at temperature τ scaled by τ²."""
    T, S = softmax(zt, tau), softmax(zs, tau)
    tckd = kl([T[y], 1 - T[y]], [S[y], 1 - S[y]])
    rest_t = [T[i] / (1 - T[y]) for i in range(len(zs)) if i != y]
    rest_s = [S[i] / (1 - S[y]) for i in range(len(zs)) if i != y]
    ce = -math.log(softmax(zs, ce_tau)[y])
    return ce + tau ** 2 * (alpha * tckd + beta * kl(rest_t, rest_s))


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(6, 10, generator=g, dtype=torch.float64) * 3
    zt = torch.randn(6, 10, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 10, (6,), generator=g)
    return zs, zt, y


@pytest.mark.parametrize("tau_s,tau_t,alpha", [(0.3, 5.0, 0.3), (0.1, 5.0, 0.1),
                                               (1.0, 5.0, 0.3),  # no sparsity
                                               (0.3, 1.0, 0.3),  # no smoothing
                                               (1.0, 1.0, 0.3)])  # neither
def test_dp3sd_matches_hand_computation(batch, tau_s, tau_t, alpha):
    zs, zt, y = batch
    per_sample = dp3sd_loss(zs, zt, y, tau_s=tau_s, tau_t=tau_t, alpha=alpha, reduction="none")
    expected = [hand_dp3sd(zs[i].tolist(), zt[i].tolist(), int(y[i]), tau_s, tau_t, alpha) for i in range(6)]
    assert per_sample.tolist() == pytest.approx(expected, rel=1e-10)
    mean = dp3sd_loss(zs, zt, y, tau_s=tau_s, tau_t=tau_t, alpha=alpha)
    assert mean.item() == pytest.approx(sum(expected) / 6, rel=1e-10)  # a mean over the batch, not classes


@pytest.mark.parametrize("tau,alpha,beta", [(5.0, 0.1, 0.3), (2.0, 0.1, 0.5),
                                            (5.0, 0.0, 0.3),  # without TCSD
                                            (5.0, 0.1, 0.0)])  # without NCSD
def test_dpdsd_matches_hand_computation(batch, tau, alpha, beta):
    zs, zt, y = batch
    per_sample = dpdsd_loss(zs, zt, y, tau=tau, alpha=alpha, beta=beta, reduction="none")
    expected = [hand_dpdsd(zs[i].tolist(), zt[i].tolist(), int(y[i]), tau, alpha, beta) for i in range(6)]
    assert per_sample.tolist() == pytest.approx(expected, rel=1e-10)


def test_dpdsd_gate_shrinks_an_unsure_teacher(batch):
    """γ < 0 (teacher less sure of the target than uniform) gives e^γ < 1: less taken from it."""
    zs, _, y = batch
    unsure = torch.zeros(6, 10, dtype=torch.float64)
    unsure[torch.arange(6), y] = -10.0  # T_t ≈ 0 → γ ≈ −0.1
    sure = torch.zeros(6, 10, dtype=torch.float64)
    sure[torch.arange(6), y] = 10.0
    kd_unsure = dpdsd_loss(zs, unsure, y, tau=1.0, alpha=0.0, beta=1.0, reduction="none") - \
        dpdsd_loss(zs, unsure, y, tau=1.0, alpha=0.0, beta=0.0, reduction="none")
    T = torch.softmax(unsure, 1)
    gate = torch.exp(T[torch.arange(6), y] - 0.1)
    assert (gate < 1).all()
    raw = -(T * torch.log_softmax(zs, 1)).sum(1) + T[torch.arange(6), y] * torch.log_softmax(zs, 1)[torch.arange(6), y]
    assert torch.allclose(kd_unsure, gate * raw)
    assert dpdsd_loss(zs, sure, y, tau=1.0, alpha=1.0, beta=0.0).item() != pytest.approx(
        dpdsd_loss(zs, unsure, y, tau=1.0, alpha=1.0, beta=0.0).item())


def test_no_gradient_reaches_the_teacher(batch):
    zs, zt, y = batch
    zs, zt = zs.clone().requires_grad_(), zt.clone().requires_grad_()
    (dp3sd_loss(zs, zt, y, tau_s=0.3, tau_t=5, alpha=0.3) + dpdsd_loss(zs, zt, y, tau=5, alpha=0.1, beta=0.3)
     + kd_loss(zs, zt, y, tau=5, alpha=0.3)).backward()
    assert zt.grad is None and zs.grad is not None and zs.grad.abs().sum() > 0


def test_kd_loss_is_alpha_ce_plus_scaled_kl(batch):
    zs, zt, y = batch
    tau, alpha = 4.0, 0.25
    ce = torch.nn.functional.cross_entropy(zs, y, reduction="none")
    pt, log_ps = torch.softmax(zt / tau, 1), torch.log_softmax(zs / tau, 1)
    kl = (pt * (pt.log() - log_ps)).sum(1)
    assert torch.allclose(kd_loss(zs, zt, y, tau=tau, alpha=alpha, reduction="none"),
                          alpha * ce + (1 - alpha) * tau ** 2 * kl)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tau_s=0.0, tau_t=5, alpha=0.3), "tau"), (dict(tau_s=0.3, tau_t=-1, alpha=0.3), "tau"),
    (dict(tau_s=0.3, tau_t=5, alpha=1.5), "alpha")])
def test_dp3sd_rejects_bad_settings(batch, kwargs, match):
    zs, zt, y = batch
    with pytest.raises(ValueError, match=match):
        dp3sd_loss(zs, zt, y, **kwargs)


def test_bad_reduction(batch):
    zs, zt, y = batch
    with pytest.raises(ValueError, match="reduction"):
        dpdsd_loss(zs, zt, y, tau=5, alpha=0.1, beta=0.3, reduction="sum")


@pytest.mark.parametrize("schedule,weights", [("constant", [1, 1, 1, 1]), ("decay", [1, 0.75, 0.5, 0.25]),
                                              ("ramp", [0.25, 0.5, 0.75, 1])])
def test_distill_schedule_scales_the_distillation_terms_by_epoch(batch, schedule, weights):
    """--distill-schedule: after 2 warm-up epochs of 6, epochs 3..6 weigh the teacher's terms by
    the schedule; the classification term keeps its weight."""
    from fedsd.settings.run import TrainConfig
    from fedsd.methods import METHODS

    zs, zt, y = batch
    cfg = TrainConfig(dataset="fmnist", epochs=6, distill_warmup_epochs=2, distill_schedule=schedule)
    for method in ("dp3sd", "dpdsd"):
        c = dataclasses.replace(cfg, method=method).resolved()
        assert not METHODS[method].epoch_loss(c, 2).reads_teacher  # still warming up
        for epoch, w in zip(range(3, 7), weights):
            got = METHODS[method].epoch_loss(c, epoch).per_sample(zs, zt, y).tolist()
            if method == "dp3sd":
                ce = [-math.log(softmax(zs[i].tolist(), c.dp3sd_tau_s)[int(y[i])]) for i in range(6)]
                full = [hand_dp3sd(zs[i].tolist(), zt[i].tolist(), int(y[i]), c.dp3sd_tau_s, c.dp3sd_tau_t,
                                   c.dp3sd_alpha)
                        for i in range(6)]
                expected = [c.dp3sd_alpha * a + w * (f - c.dp3sd_alpha * a) for a, f in zip(ce, full)]
            else:
                expected = [hand_dpdsd(zs[i].tolist(), zt[i].tolist(), int(y[i]), c.dpdsd_tau, w * c.dpdsd_alpha,
                                      w * c.dpdsd_beta)
                            for i in range(6)]
            assert got == pytest.approx(expected, rel=1e-10), (method, epoch)


@pytest.mark.parametrize("warmup", ["sharpened", "plain"])
def test_dp3sd_warms_up_on_cross_entropy_at_its_warmup_temperature(batch, warmup):
    """--dp3sd-warmup: the warm-up epochs train on CE_τs (sharpened, the default) or on CE_1
    (plain, the papers' DP-SGD warm-up), without the teacher; the epochs after are unchanged."""
    from fedsd.settings.run import TrainConfig
    from fedsd.methods import METHODS

    zs, zt, y = batch
    c = TrainConfig(dataset="fmnist", method="dp3sd", epochs=3, distill_warmup_epochs=1, dp3sd_warmup=warmup).resolved()
    assert TrainConfig(dataset="fmnist", method="dp3sd").resolved().dp3sd_warmup == "sharpened"
    loss = METHODS["dp3sd"].epoch_loss(c, 1)
    tau = c.dp3sd_tau_s if warmup == "sharpened" else 1.0
    assert not loss.reads_teacher
    assert loss.per_sample(zs, None, y).tolist() == pytest.approx(
        [-math.log(softmax(zs[i].tolist(), tau)[int(y[i])]) for i in range(6)], rel=1e-10)
    after = METHODS["dp3sd"].epoch_loss(c, 2).per_sample(zs, zt, y).tolist()
    assert after == pytest.approx([hand_dp3sd(zs[i].tolist(), zt[i].tolist(), int(y[i]), c.dp3sd_tau_s,
                                              c.dp3sd_tau_t, c.dp3sd_alpha)
                                   for i in range(6)], rel=1e-10)


# -- the readings of the papers, each against its hand computation -------------------
SMALL = (torch.tensor([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0]], dtype=torch.float64),  # 2 samples, 3 classes
         torch.tensor([[1.0, 0.0, -1.0], [-0.5, 1.5, 0.5]], dtype=torch.float64), torch.tensor([0, 1]))


def test_kl_averaged_over_classes_is_the_kl_divided_by_k():
    zs, zt, y = SMALL
    summed = dp3sd_loss(zs, zt, y, tau_s=0.3, tau_t=5.0, alpha=0.3, reduction="none")
    averaged = dp3sd_loss(zs, zt, y, tau_s=0.3, tau_t=5.0, alpha=0.3, class_mean=True, reduction="none")
    for i in range(2):
        ce = -math.log(softmax(zs[i].tolist(), 0.3)[int(y[i])])
        kl_i = kl(softmax(zt[i].tolist(), 5.0), softmax(zs[i].tolist(), 5.0))
        assert summed[i].item() == pytest.approx(0.3 * ce + 0.7 * 25 * kl_i, rel=1e-12)
        assert averaged[i].item() == pytest.approx(0.3 * ce + 0.7 * 25 * kl_i / 3, rel=1e-12)


@pytest.mark.parametrize("ce_tau", [1.0, 5.0])
def test_dkd_form_matches_hand_computation(batch, ce_tau):
    for zs, zt, y in (SMALL, batch):
        got = dkd_loss(zs, zt, y, tau=5.0, alpha=0.1, beta=0.3, ce_tau=ce_tau, reduction="none").tolist()
        expected = [hand_dkd(zs[i].tolist(), zt[i].tolist(), int(y[i]), 5.0, 0.1, 0.3, ce_tau) for i in range(len(y))]
        assert got == pytest.approx(expected, rel=1e-9)


def test_dpdsd_cross_entropy_at_tau(batch):
    zs, zt, y = batch
    got = dpdsd_loss(zs, zt, y, tau=5.0, alpha=0.1, beta=0.3, ce_tau=5.0, reduction="none").tolist()
    assert got == pytest.approx([hand_dpdsd(zs[i].tolist(), zt[i].tolist(), int(y[i]), 5.0, 0.1, 0.3, 5.0)
                                 for i in range(6)], rel=1e-10)


def test_dkd_is_minimised_by_the_teachers_distribution_and_the_equations_are_not():
    """DKD's distillation terms are KLs: zero, with a zero gradient, where the student's
    distribution is the teacher's. The equations' terms are cross-entropies with a gate:
    their gradient there is not zero, and pushes the student away from the teacher."""
    zt = torch.tensor([[1.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    y = torch.tensor([0])
    zs = zt.clone().requires_grad_()
    (dkd_loss(zs, zt, y, tau=5.0, alpha=0.1, beta=0.3) - dkd_loss(zs, zt, y, tau=5.0, alpha=0.0, beta=0.0)).backward()
    assert zs.grad.abs().max().item() < 1e-12
    zs.grad = None
    (dpdsd_loss(zs, zt, y, tau=5.0, alpha=0.1, beta=0.3)
     - dpdsd_loss(zs, zt, y, tau=5.0, alpha=0.0, beta=0.0)).backward()
    assert zs.grad.abs().max().item() > 1e-3


def test_dkd_gradient_is_finite_for_a_confident_target():
    zs = torch.tensor([[40.0, -40.0, 0.0]], dtype=torch.float64, requires_grad=True)
    dkd_loss(zs, torch.tensor([[30.0, -30.0, 0.0]], dtype=torch.float64), torch.tensor([0]),
             tau=1.0, alpha=1.0, beta=1.0).backward()
    assert torch.isfinite(zs.grad).all()
