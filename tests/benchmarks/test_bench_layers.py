"""`fedsd bench step`: the per-layer table (--layers) and the compiled non-private candidate's
check against the eager step (left out, with why, where it raises or its gradients differ).
Tiny batches, no real compilation: a few seconds each."""
import argparse
import json

import pytest
import torch

from fedsd.benchmarks import layer_times, step_timing as bench
from fedsd.clipping import conv_kernel
from fedsd.cli.main import main
from fedsd.models.networks import build_model
from fedsd.settings.run import TrainConfig

TINY = ["bench", "step", "--model", "mnist-cnn", "--batch-size", "32", "--repeats", "1", "--warmup", "0", "--json"]


def run_json(capsys, *extra) -> tuple[dict | list, str]:
    """The JSON report and what went to stderr."""
    assert main([*TINY, *extra]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_layers_one_row_a_trainable_layer_and_parts_within_the_step(capsys):
    report, _ = run_json(capsys, "--no-compile", "--layers")
    names = [n for n, m in build_model("mnist-cnn").named_modules()
             if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert [r["name"] for r in report["layers"]] == names
    assert report["route"] == "bk"
    assert [r["way"] for r in report["layers"]][-2:] == ["linear", "linear"]
    for r in report["layers"]:
        assert set(r["dp_ms"]) == {"forward", "backward", "norms", "clip-sum"}
        assert set(r["nonprivate_ms"]) == {"forward", "backward"}
        assert all(v >= 0 for v in [*r["dp_ms"].values(), *r["nonprivate_ms"].values()])
    assert all(r["dp_ms"]["forward"] > 0 for r in report["layers"])
    # The two convs take the kernel: their norms and clipped sums are one pass, one row of its own.
    together = report["kernel_layers_together"]
    assert together["layers"] == (names[:2] if conv_kernel.available() else [])
    assert (together["dp_ms"] > 0) == conv_kernel.available()
    # The pass makes their weights' and biases' norms: nothing of theirs is measured apart from it.
    assert all((r["dp_ms"]["norms"] == 0) == (r["name"] in together["layers"]) for r in report["layers"])
    between = report["between_layers"]
    assert all(v >= 0 for v in [*between["dp_ms"].values(), *between["nonprivate_ms"].values()])
    # The parts lie within the whole step (each is timed inside it), and are a fair share of it.
    assert report["dp_step_ms"] / 20 < report["dp_layers_ms"] <= report["dp_step_ms"] * 1.01
    assert report["nonprivate_step_ms"] / 20 < report["nonprivate_layers_ms"] <= report["nonprivate_step_ms"] * 1.01


def test_layers_text_table(capsys):
    assert main([*TINY[:-1], "--no-compile", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "0 Conv2d 1→16 k8 s2" in out and "9 Linear 32→10" in out and "whole step" in out and "between layers" in out
    assert ("kernel layers 0, 3: norms and clip-sum in one pass" in out) == conv_kernel.available()


def _step_of(observed: bool, x, y, objective):
    """One default-route DP step from the same start; the clipped sum before the noise and the weights after."""
    base = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3.0, epochs=1, batch_size=32,
                       model="mnist-cnn").resolved()
    torch.manual_seed(0)
    steps, trainers = bench.private_steps(base, [base.grad_sample_mode], x, y, objective)
    trainer = trainers[base.grad_sample_mode]
    if observed:
        clock = layer_times.LayerClock(trainer.clipper.model, x.device)
        trainer.clipper.engine.observer = clock.watch
    seen = {}

    class Before:
        def before_noise(self, t):
            seen.update({n: p.grad.clone() for n, p in t.clipper.model.named_parameters()})

        def after_noise(self, t):
            pass

        def after_step(self, t):
            pass

    torch.manual_seed(1)
    trainer.train_on_batch(trainer.data.x_train, y, objective, callbacks=[Before()])
    if observed:
        times = clock.step_done()
        assert times["7"]["norms"] > 0 and (times[layer_times.TOGETHER]["norms"] > 0) == conv_kernel.available()
    return seen, {n: p.detach().clone() for n, p in trainer.clipper.model.named_parameters()}


def test_the_observer_changes_no_bit():
    from fedsd.methods import method_of

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 28, 28, generator=g), torch.randint(0, 10, (32,), generator=g)
    base = TrainConfig(dataset="fmnist", method="dpsgd", epsilon=3.0, batch_size=32, model="mnist-cnn").resolved()
    objective = method_of(base).epoch_loss(base, 1)
    (sum_plain, after_plain), (sum_watched, after_watched) = (_step_of(o, x, y, objective) for o in (False, True))
    assert sum_plain.keys() == sum_watched.keys() and after_plain.keys() == after_watched.keys()
    assert all(torch.equal(sum_plain[n], sum_watched[n]) for n in sum_plain)
    assert all(torch.equal(after_plain[n], after_watched[n]) for n in after_plain)


def raising(module):
    def compiled(*args, **kwargs):
        raise RuntimeError("index 1033187128 is out of bounds for dimension 1 with size 196\nmore")
    return compiled


def perturbing(module):
    return lambda *args, **kwargs: module(*args, **kwargs) * 1.5


@pytest.mark.parametrize("fake, reason", [(raising, "RuntimeError: index 1033187128 is out of bounds for dimension 1 "
                                                    "with size 196"),
                                          (perturbing, "its gradient of")])
def test_a_failing_compiled_candidate_is_left_out_with_why(monkeypatch, capsys, fake, reason):
    monkeypatch.setattr(torch, "compile", fake)
    rows, err = run_json(capsys, "--grad-sample-mode", "bk")
    assert rows[0]["left_out"]["compiled-channels-last"].startswith(reason)
    # The parts compiled as the DP step's are checked bit for bit there, and run eager when they differ.
    assert set(rows[0]["nonprivate_step_seconds"]) == {"eager-nchw", "eager-channels-last",
                                                       "compiled-parts-channels-last"}
    assert "compiled-channels-last left out: " + reason in err
    # and in the text table
    args = argparse.Namespace(model="mnist-cnn", method=rows[0]["method"], grad_sample_mode=["bk"])
    text = "\n".join(bench.step_lines(args, 32, "cpu", rows))
    assert "compiled-channels-last left out: " + reason in text


def test_a_compiled_candidate_with_the_eager_gradients_is_timed(monkeypatch, capsys):
    monkeypatch.setattr(torch, "compile", lambda module: module)
    rows, _ = run_json(capsys, "--grad-sample-mode", "bk")
    assert rows[0]["left_out"] == {}
    assert {"compiled-channels-last", "compiled-parts-channels-last"} <= set(rows[0]["nonprivate_step_seconds"])
