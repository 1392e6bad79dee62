"""`fedsd bench distill-share`'s measure: the clipped gradient of a self-distilling
loss split into its cross-entropy part and its distillation part, on real Fashion-MNIST images
(any real images of mnist-cnn's shape do: which data set is not the point)."""
import pytest
import torch

from fedsd.methods import losses
from fedsd.models.networks import build_model
from fedsd.benchmarks.distill_share import clipped_shares
from tests.conftest import require


@pytest.fixture(scope="module")
def batch():
    from fedsd.data import datasets as data_lib

    require("fmnist")
    images = data_lib.load("fmnist")
    return images.normalised(images.x_train[:32]), images.y_train[:32].clone()


def dp3sd(s, t, y):
    return losses.dp3sd_loss(s, t, y, tau_s=0.3, tau_t=5.0, alpha=0.3, reduction="none")


def ce(s, y):
    return 0.3 * losses.cross_entropy(s, y, tau=0.3, reduction="none")


def test_a_teacher_equal_to_the_student_adds_no_distillation_gradient(batch):
    net = build_model("mnist-cnn", seed=0)
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    shares = clipped_shares(net, weights, weights, *batch, dp3sd, ce, clip=0.1)
    assert shares["clipped_share"] < 1e-5 and shares["median_sample_ratio"] < 1e-5


def test_the_parts_are_each_samples_own_gradients_and_the_teacher_pulls_once_apart(batch):
    """Against autograd sample by sample: the CE part's gradient of sample 0, and a teacher
    that differs from the student gives the distillation part a share of the clipped sum."""
    x, y = batch
    student_net, teacher_net = build_model("mnist-cnn", seed=0), build_model("mnist-cnn", seed=1)
    student = {k: v.detach().clone() for k, v in student_net.state_dict().items()}
    teacher = {k: v.detach().clone() for k, v in teacher_net.state_dict().items()}
    shares = clipped_shares(student_net, student, teacher, x, y, dp3sd, ce, clip=0.1)
    assert 0.05 < shares["clipped_share"] and -1 <= shares["cosine"] <= 1 and 0 <= shares["clipped"] <= 1
    # sample 0's gradients by plain autograd
    with torch.no_grad():
        t0 = teacher_net(x[:1])
    g_total = torch.autograd.grad(dp3sd(student_net(x[:1]), t0, y[:1]).sum(), list(student_net.parameters()))
    g_ce = torch.autograd.grad(ce(student_net(x[:1]), y[:1]).sum(), list(student_net.parameters()))
    ratio = torch.cat([(a - b).flatten() for a, b in zip(g_total, g_ce)]).norm() / \
        torch.cat([b.flatten() for b in g_ce]).norm()
    assert ratio > 0
    one = clipped_shares(student_net, student, teacher, x[:1], y[:1], dp3sd, ce, clip=0.1)
    assert one["median_sample_ratio"] == pytest.approx(ratio.item(), rel=1e-4)


@pytest.mark.parametrize("loss", [losses.dpdsd_loss, losses.dkd_loss])
def test_dpdsds_losses_take_per_sample_gradients_through_vmap(batch, loss):
    """Both of DPDSD's readings run under torch.func.vmap (no data-dependent one-hot or masking)."""
    student_net, teacher_net = build_model("mnist-cnn", seed=0), build_model("mnist-cnn", seed=1)
    weights = lambda net: {k: v.detach().clone() for k, v in net.state_dict().items()}  # noqa: E731
    shares = clipped_shares(student_net, weights(student_net), weights(teacher_net), *batch,
                            lambda s, t, y: loss(s, t, y, tau=4.0, alpha=1.0, beta=8.0, reduction="none"),
                            lambda s, y: losses.cross_entropy(s, y, reduction="none"), clip=0.1)
    assert 0 < shares["clipped_share"] < float("inf") and -1 <= shares["cosine"] <= 1
