"""fedsd.training.compiled: the parts of a DP step that compile (the teacher's forward, the
student's runs of weightless layers) change no bit of the step, and a compiled part that would
(another value, another layout, another input gradient, an error) is never used: the step goes
on eagerly and says why once."""
import pytest
import torch
from torch import nn

from fedsd.training import compiled as compiled_lib
from fedsd.training.compiled import CompiledForward, student_forward, teacher_forward


class _DoubledGradient(torch.autograd.Function):
    """The identity forward whose backward doubles the gradient: a compiled graph whose values
    are right and whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


RELU_POOL = nn.Sequential(nn.ReLU(), nn.AvgPool2d(2))
WRONG = {
    "its output differs from eager's": lambda x: RELU_POOL(x) * (1 + 2 ** -20),
    "its output differs from eager's ": lambda x: RELU_POOL(x) * -1.0 if not x.gt(0).any() else RELU_POOL(x),
    "its output has strides": lambda x: RELU_POOL(x).contiguous(),
    "its input gradient differs from eager's": lambda x: _DoubledGradient.apply(RELU_POOL(x)),
    "RuntimeError: index 1033187128 is out of bounds": lambda x: (_ for _ in ()).throw(
        RuntimeError("index 1033187128 is out of bounds for dimension 1 with size 196")),
}


@pytest.mark.parametrize("why", list(WRONG))
def test_a_compiled_part_that_is_not_bitwise_eager_is_left_out_and_the_step_goes_on_eagerly(monkeypatch, capsys, why):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: WRONG[why])
    part = CompiledForward(RELU_POOL, "layers 1–2 (ReLU → AvgPool2d)", after=1, gradient=True)
    x = torch.randn(8, 4, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    if why.endswith(" "):  # all ≤ 0: eager's output is +0.0 everywhere, the wrong graph's -0.0:
        # equal, not the same bits
        x = (-x.detach().abs()).requires_grad_()
    for call in range(3):  # 1: eager (not yet); 2: checked, left out; 3: eager
        out = part(x)
        assert torch.equal(out, RELU_POOL(x)) and out.stride() == RELU_POOL(x).stride()
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(grad, torch.autograd.grad(RELU_POOL(x).sum(), x)[0])
    assert part.state.startswith("left out: " + why.strip()) and part.compiled is None
    err = capsys.readouterr().err
    assert err.count("the compiled layers 1–2 (ReLU → AvgPool2d) is left out (eager from now on): " + why.strip()) == 1


def test_a_compiled_part_is_used_only_after_its_check_and_its_first_calls(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        return lambda x: calls.append(len(x)) or fn(x)
    monkeypatch.setattr(torch, "compile", fake_compile)
    part = CompiledForward(RELU_POOL, "teacher's forward", after=2)
    x = torch.randn(8, 4, 6, 6)
    part(x), part(x)
    assert calls == [] and part.state == "eager"
    part(x), part(x[:1]), part(x[:5])  # checked on its first batch; a batch of one stays eager
    assert calls == [8, 8, 5] and part.state == "compiled"
    # another kind of input is another graph: checked on its first call too, and left out if it differs
    wrong_without_gradient = lambda x: RELU_POOL(x) if x.requires_grad else RELU_POOL(x) + 1  # noqa: E731
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: wrong_without_gradient)
    part = CompiledForward(RELU_POOL, "layers", after=0, gradient=True)
    part(x.clone().requires_grad_())
    assert part.state == "compiled"
    assert torch.equal(part(x), RELU_POOL(x)) and part.state == "left out: its output differs from eager's"
    monkeypatch.setenv(compiled_lib.OPT_OUT_ENV, "0")
    off = CompiledForward(RELU_POOL, "teacher's forward", after=0)
    off(x)
    assert calls == [8, 8, 5] and off.state == "left out: FEDSD_COMPILE=0"


def test_the_students_runs_of_weightless_layers_compile_and_max_pooling_stays_eager():
    from fedsd.models.networks import build_model

    forward, runs = student_forward(build_model("cifar-cnn"))
    assert [r.name for r in runs] == ["layers 1–2 (ReLU → AvgPool2d)", "layers 4–5 (ReLU → AvgPool2d)",
                                      "layers 7–8 (ReLU → AvgPool2d)",
                                      "layers 10–12 (ReLU → AdaptiveAvgPool2d → Flatten)"]
    mnist = build_model("mnist-cnn")  # ReLU, then MaxPool2d: nothing to fuse
    assert student_forward(mnist) == (mnist, [])
    # the teacher's forward compiles for networks of known layers only (its max pooling too)
    assert isinstance(teacher_forward(mnist), CompiledForward)
    grouped = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU())
    assert teacher_forward(grouped) is grouped


@pytest.mark.slow
def test_a_dp_step_with_its_compiled_parts_releases_the_eager_steps_weights_bit_for_bit():
    """Compiles for real (about 15 s): book-keeping on cifar-cnn, the teacher's forward and the
    four runs of weightless layers compiled, three Poisson-sized batches (one graph each part)."""
    from fedsd.benchmarks import step_timing as bench
    from fedsd.methods import method_of
    from fedsd.settings.run import TrainConfig

    base = TrainConfig(dataset="cifar10", method="dp3sd", epsilon=3.0, epochs=1, batch_size=64, model="cifar-cnn",
                       **bench.every_epoch_distils("dp3sd")).resolved()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 3, 32, 32, generator=g), torch.randint(0, 10, (80,), generator=g)
    objective = method_of(base).epoch_loss(base, 1)
    (eager,), (fast,) = (bench.private_steps(base, ["bk"], x, y, objective, compiled=c)[1].values()
                         for c in (False, True))
    fast.model.load_state_dict(eager.model.state_dict())
    fast.teacher.load_state_dict(eager.teacher.state_dict())
    for n in (64, 51, 70):
        for trainer in (eager, fast):
            trainer.generator.manual_seed(n)  # the same noise
            trainer.train_on_batch(trainer.data.x_train[:n], y[:n], objective)
        assert all(torch.equal(p, q) for p, q in zip(eager.model.parameters(), fast.model.parameters()))
    assert list(fast.compiled_parts().values()) == ["compiled"] * 5
    # under secret draws (an owner's data) nothing compiled runs: the step is eager's
    fast.secret = object()
    seen = [part.calls for part in fast._compiled]
    fast.train_on_batch(fast.data.x_train[:64], y[:64], objective)
    fast.secret = None
    assert [part.calls for part in fast._compiled] == seen
    assert set(eager.compiled_parts().values()) == {"eager"}
    # one graph each, whatever the batch: before each part had a code object of its own, the five
    # shared one, whose recompilations dynamo stops at 8, running the rest eagerly without a word
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    parts = fast._compiled
    codes = [part.compiled._torchdynamo_orig_callable.__code__ for part in parts]
    assert len(set(map(id, codes))) == 5 and [len(_debug_get_cache_entry_list(c)) for c in codes] == [1] * 5
