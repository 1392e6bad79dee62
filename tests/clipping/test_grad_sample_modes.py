"""Every per-sample clipping route (Opacus' hooks, functorch, expanded weights, ghost clipping,
fedsd's book-keeping), in every memory layout it allows, gives the reference weights (Opacus'
hooks on NCHW tensors) to float tolerance, and the same ε."""
import pytest
import torch

from fedsd.data import datasets as data_lib
from fedsd.clipping import routes
from fedsd.settings.run import CHANNELS_LAST_EXACT, TrainConfig
from fedsd.errors import ConfigError
from fedsd.privacy.accounting import plan
from fedsd.methods import EpochLoss
from fedsd.training.loop import DPTrainer, initial_model
from tests.conftest import bookkeeping_clipped_sum, require, write_cifar_shaped


def run(mode: str, method: str, epochs=(1, 2), dataset="fmnist", memory_format="auto", data_dir=None, physical=0):
    cfg = TrainConfig(dataset=dataset, method=method, epsilon=3, epochs=2, batch_size=50, subset=300, seed=2,
                      grad_sample_mode=mode, memory_format=memory_format, distill_warmup_epochs=1,
                      threads=1, max_physical_batch_size=physical).resolved()
    images = data_lib.load(dataset, data_dir)
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 300, 0))
    trainer = DPTrainer(cfg, tensors, plan(3, 1e-5, 300, 50, 2))
    model, state, metrics = trainer.local_update(initial_model(cfg, 10), None, list(epochs))
    return model["student"], metrics["epsilon"]


def layouts(mode):
    return ["contiguous", "channels-last"] if mode in CHANNELS_LAST_EXACT else ["contiguous"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,memory_format", [(m, f) for m in ["hooks", "functorch", "ew", "ghost", "bk"]
                                                for f in layouts(m)])
@pytest.mark.parametrize("method", ["dpsgd", "dp3sd"])
def test_mode_matches_hooks(mode, memory_format, method):
    require("fmnist")
    reference, eps_ref = run("hooks", method, memory_format="contiguous")
    fast, eps = run(mode, method, memory_format=memory_format)
    assert eps == eps_ref
    worst = max((fast[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-4, worst
    moved = max((reference[k] - initial_model(TrainConfig(dataset="fmnist").resolved(), 10)["student"][k])
                .abs().max().item() for k in reference)
    assert moved > 100 * worst  # the match is not trivial: training moved the weights


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost", "bk"])
def test_physical_batches_give_the_logical_batchs_weights(mode):
    """A Poisson batch of about 50 trained in passes of at most 16 (fedsd.training.physical_batches): each part's
    clipped sum kept until the last, one noisy step; the weights and ε of the whole batch."""
    require("fmnist")
    layout = routes.layout_for(mode, "auto")  # as --grad-sample-mode auto runs it
    whole, eps_whole = run(mode, "dp3sd", memory_format=layout)
    parts, eps_parts = run(mode, "dp3sd", memory_format=layout, physical=16)
    assert eps_parts == eps_whole
    assert max((parts[k] - whole[k]).abs().max().item() for k in whole) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_cifar_cnn_mode_matches_hooks(mode, tmp_path):
    """cifar-cnn: average pooling, three channels, and both of book-keeping's conv routes
    (per-sample gradients for the large early maps, ghost norms for the small late ones), on a
    CIFAR-shaped set the test makes."""
    root = write_cifar_shaped(tmp_path)
    reference, eps_ref = run("hooks", "dp3sd", dataset="cifar10", data_dir=root)
    fast, eps = run(mode, "dp3sd", dataset="cifar10", data_dir=root)
    assert eps == eps_ref
    assert max((fast[k] - reference[k]).abs().max().item() for k in reference) < 1e-4


def test_default_is_the_measured_route():
    cfg = TrainConfig().resolved()
    assert cfg.grad_sample_mode == "auto" and cfg.channels_last
    assert not TrainConfig(grad_sample_mode="hooks").channels_last  # auto: NCHW where Opacus needs it


def test_expanded_weights_take_nchw_on_cuda_by_default():
    """torch's expanded-weights GroupNorm refuses channels-last input on CUDA (seen on an H100):
    under --memory-format auto, ew runs NCHW there and channels-last on a CPU, where it is exact."""
    from fedsd.training.loop import torch_memory_format

    ew = TrainConfig(grad_sample_mode="ew")
    assert torch_memory_format(ew, torch.device("cpu")) == torch.channels_last
    assert torch_memory_format(ew, torch.device("cuda")) == torch.contiguous_format
    assert torch_memory_format(TrainConfig(grad_sample_mode="functorch"), torch.device("cuda")) == torch.channels_last


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_channels_last_refused_where_opacus_gets_it_wrong(mode):
    """Opacus' hooks and ghost clipping unfold NCHW-strided memory: on channels-last tensors
    they give wrong per-sample gradients, so that combination is refused, not run."""
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", grad_sample_mode=mode, memory_format="channels-last",
                      subset=300, batch_size=50).resolved()
    x = torch.zeros(60, 1, 28, 28)
    with pytest.raises(ConfigError, match="--memory-format.*channels-last.*wrong per-sample gradients"):
        DPTrainer(cfg, data_lib.TensorData(x, torch.zeros(60, dtype=torch.long), x, torch.zeros(60), 10),
                  plan(3, 1e-5, 60, 50, 1))


def test_bookkeeping_refuses_layers_it_has_no_rule_for():
    from torch import nn

    from fedsd.clipping.bookkeeping import BookKeepingEngine

    with pytest.raises(ValueError, match="GroupNorm"):
        BookKeepingEngine(nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4)), 1.0)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_empty_batch_takes_a_noise_only_step(mode):
    require("fmnist")
    cfg = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3, epochs=1, batch_size=50, subset=300,
                      grad_sample_mode=mode).resolved()
    images = data_lib.load("fmnist")
    tensors = data_lib.prepare(images, data_lib.stratified_subset(images.y_train, 300, 0))
    p = plan(3, 1e-5, 300, 50, 1)
    trainer = DPTrainer(cfg, tensors, p)
    trainer.generator.manual_seed(0)
    before = [w.detach().clone() for w in trainer.model.parameters()]
    trainer.train_on_batch(trainer.data.x_train[:0], tensors.y_train[:0],
                           EpochLoss(lambda s, t, y: s.sum(1), False, 1.0))
    deltas = torch.cat([(w.detach() - b).flatten() for w, b in zip(trainer.model.parameters(), before)])
    expected_std = cfg.lr * p.noise_multiplier * cfg.clip / cfg.batch_size
    assert deltas.std().item() == pytest.approx(expected_std, rel=0.05)
    assert abs(deltas.mean().item()) < 0.05 * expected_std


@pytest.mark.parametrize("model", ["mnist-cnn", "cifar-cnn"])
def test_bookkeeping_in_cache_sized_chunks_matches_the_whole_batch(monkeypatch, model):
    """Patches made a few samples at a time (CPU, without the conv kernel) give each sample's
    gradient norm and the clipped sum of the whole batch at once."""
    import fedsd.clipping.bookkeeping as bk

    def clipped(chunk_bytes):
        monkeypatch.setattr(bk, "PATCH_CHUNK_BYTES", chunk_bytes)
        return bookkeeping_clipped_sum(model, kernel=False)

    whole, chunked = clipped(1 << 40), clipped(1)  # one chunk; one sample a chunk
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert any(a.abs().sum() > 0 for a in whole)
