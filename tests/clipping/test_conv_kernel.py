"""fedsd.clipping.conv_kernel: each sample's conv weight gradient and its squared norm, as autograd
gives them one sample at a time, for the papers' six conv layers and shapes they do not have;
the same bits at any number of threads; the PyTorch route where it does not apply or is not
built, and book-keeping's clipped sums equal on both routes."""
import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedsd.clipping import conv_kernel
from tests.conftest import bookkeeping_clipped_sum

ROOT = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not conv_kernel.available(), reason="no C compiler to build the conv kernel")

LAYERS = {  # (in, out, kernel, stride, padding, dilation, input size)
    "mnist-cnn conv1": (1, 16, 8, 2, 3, 1, 28),
    "mnist-cnn conv2": (16, 32, 4, 2, 0, 1, 13),
    "cifar-cnn conv1": (3, 32, 3, 1, 1, 1, 32),
    "cifar-cnn conv2": (32, 64, 3, 1, 1, 1, 16),
    "cifar-cnn conv3": (64, 64, 3, 1, 1, 1, 8),
    "cifar-cnn conv4": (64, 128, 3, 1, 1, 1, 4),
    "48 channels, 5 in, dilated": (5, 48, 3, 1, 2, 2, 11),
    "non-square kernel, uneven padding": (2, 16, (3, 5), (2, 1), (1, 2), 1, 9),
}


def layer_and_gradients(spec, n=7, seed=0):
    cin, cout, k, s, p, d, hw = spec
    g = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(cin, cout, k, stride=s, padding=p, dilation=d).to(memory_format=torch.channels_last)
    x = torch.randn(n, cin, hw, hw + 1, generator=g).contiguous(memory_format=torch.channels_last)
    out_shape = conv(x).shape
    grad = torch.randn(out_shape, generator=g).contiguous(memory_format=torch.channels_last)
    return conv, x, grad


def autograd_per_sample(conv, x, grad):
    """(n, p, c, kh, kw): each sample's weight gradient from autograd, one sample at a time."""
    rows = []
    for xi, gi in zip(x, grad):
        conv.weight.grad = None
        conv(xi[None]).backward(gi[None])
        rows.append(conv.weight.grad.clone())
    return torch.stack(rows)


@needs_kernel
@pytest.mark.parametrize("name", list(LAYERS))
def test_kernel_gives_each_samples_gradient_and_norm(name):
    conv, x, grad = layer_and_gradients(LAYERS[name])
    assert conv_kernel.applies(conv, x, grad)
    per_sample, norms2 = conv_kernel.per_sample_grads(conv, x, grad)
    expected = autograd_per_sample(conv, x, grad)  # (n, p, c, kh, kw); the kernel's is (n, kh·kw·c, p)
    got = per_sample.view(len(x), conv.kernel_size[0], conv.kernel_size[1], x.shape[1], -1).permute(0, 4, 3, 1, 2)
    scale = expected.abs().max().item()  # sums over up to 1024 positions: float32 rounding grows with them
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(norms2, expected.flatten(1).pow(2).sum(1), rtol=1e-5, atol=0)
    assert expected.abs().max() > 1  # not a comparison of zeros


@needs_kernel
def test_kernel_result_does_not_depend_on_the_number_of_threads():
    conv, x, grad = layer_and_gradients(LAYERS["mnist-cnn conv2"], n=33)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = conv_kernel.per_sample_grads(conv, x, grad)
        torch.set_num_threads(2)
        two = conv_kernel.per_sample_grads(conv, x, grad)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@needs_kernel
def test_kernel_declines_what_it_cannot_take():
    conv, x, grad = layer_and_gradients(LAYERS["mnist-cnn conv2"])
    assert not conv_kernel.applies(conv, x.contiguous(), grad.contiguous())  # NCHW
    assert not conv_kernel.applies(conv.double(), x.double(), grad.double())
    narrow = nn.Conv2d(16, 8, 4, stride=2).to(memory_format=torch.channels_last)  # 8 channels: not whole vectors
    g8 = torch.zeros(len(x), 8, 5, 6).contiguous(memory_format=torch.channels_last)
    assert not conv_kernel.applies(narrow, x, g8)


def test_a_failed_build_falls_back_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    conv_kernel._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="not built.*slower route"):
            assert not conv_kernel.available()
    finally:
        conv_kernel._library.cache_clear()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(conv_kernel.ENABLED_ENV, "0")
    conv_kernel._library.cache_clear()
    try:
        assert not conv_kernel.available()
    finally:
        conv_kernel._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("model", ["mnist-cnn", "cifar-cnn"])
def test_bookkeeping_clipped_sum_is_the_same_on_both_routes(model):
    """The kernel's per-sample gradients and PyTorch's patches and batched products give
    book-keeping the same clipped sum, with clipping active (C below most samples' norms)."""
    with_kernel, without = bookkeeping_clipped_sum(model, kernel=True), bookkeeping_clipped_sum(model, kernel=False)
    for a, b in zip(with_kernel, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert all(a.abs().sum() > 0 for a in with_kernel)


# Instruction-set targets a user's CPU may have: the kernel's register block follows the target
# (AVX-512: 16-float vectors, AVX2: 8-float, SSE: 4-float), so each build is checked on its own.
TARGETS = {"x86-64-v4": ("avx512f",), "x86-64-v3": ("avx2", "fma"), "x86-64": ()}


def _cpu_flags() -> set[str]:
    from pathlib import Path

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {f for line in info.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@needs_kernel
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 targets")
@pytest.mark.parametrize("march,isa", [("x86-64-v4", "avx512"), ("x86-64-v3", "avx2"), ("x86-64", "sse")])
def test_kernel_builds_for_each_target_and_each_build_this_cpu_runs_is_exact(march, isa, tmp_path, monkeypatch):
    """Every target builds; where this CPU can run it, its gradients and norms match autograd
    on every layer (an AVX-512 build cannot run on an AVX2 CPU: it is built, not run)."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    path = conv_kernel.compiled(march, load=False)
    assert path.is_file() and path.stat().st_size > 0
    if not set(TARGETS[march]) <= _cpu_flags():
        pytest.skip(f"built for {march}; this CPU cannot run it")
    kernel = conv_kernel.compiled(march)
    assert kernel.isa == isa
    for name, spec in LAYERS.items():
        conv, x, grad = layer_and_gradients(spec)
        per_sample, norms2 = conv_kernel.per_sample_grads(conv, x, grad, kernel=kernel)
        expected = autograd_per_sample(conv, x, grad)
        got = per_sample.view(len(x), conv.kernel_size[0], conv.kernel_size[1], x.shape[1], -1).permute(0, 4, 3, 1, 2)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(), msg=name)
        torch.testing.assert_close(norms2, expected.flatten(1).pow(2).sum(1), rtol=1e-5, atol=0, msg=name)


def _two_layers(n: int, seed: int = 0):
    """mnist-cnn's two convs' (layer, input, output gradient) for n samples, and other weights' squared norms."""
    convs = [layer_and_gradients(LAYERS[name], n=n, seed=seed + k) for k, name in
             enumerate(("mnist-cnn conv1", "48 channels, 5 in, dilated"))]
    base2 = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 100
    return convs, base2


@needs_kernel
def test_one_pass_clipped_sums_are_the_per_sample_gradients_clipped_and_summed():
    """conv_kernel.clipped_sums (book-keeping's pass for the kernel's layers) gives the norms,
    Opacus' clipping factors and the clipped sums that per_sample_grads and PyTorch give, over
    more samples than one block and not a whole number of blocks, clipping active; each layer's
    bias too (its per-sample gradient is the output gradient summed over the positions), the
    second layer without one."""
    n = 70
    convs, base2 = _two_layers(n)
    convs[1][0].bias = None
    grads = [conv_kernel.per_sample_grads(*conv) for conv in convs]
    bias = convs[0][2].sum((2, 3))  # (n, p): the first layer's per-sample bias gradients
    expected2 = base2 + grads[0][1] + bias.pow(2).sum(1) + grads[1][1]
    C = float((expected2.sqrt() * n).median())  # about half the samples clipped
    norms2, coeff, sums = conv_kernel.clipped_sums(convs, base2, n, C)
    torch.testing.assert_close(norms2, expected2, rtol=1e-6, atol=0)
    expected_coeff = (C / (expected2.sqrt() * n + 1e-6)).clamp(max=1.0) * n
    torch.testing.assert_close(coeff, expected_coeff, rtol=1e-6, atol=0)
    assert 0 < (coeff < n).sum() < n  # some samples clipped, some not
    for (summed, _), (per_sample, _) in zip(sums, grads):
        expected = expected_coeff @ per_sample.flatten(1)
        torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    scale = (expected_coeff @ bias.abs()).max().item()  # a sum of terms of both signs: its rounding is theirs
    torch.testing.assert_close(sums[0][1], expected_coeff @ bias, rtol=1e-5, atol=1e-5 * scale)
    assert sums[1][1] is None
    # Every sample's clipped gradient (its own: n times the mean's) is within C.
    assert ((coeff / n) * expected2.sqrt() * n <= C * (1 + 1e-6)).all()


@needs_kernel
def test_one_pass_clipped_sums_do_not_depend_on_the_number_of_threads():
    convs, base2 = _two_layers(70)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = conv_kernel.clipped_sums(convs, base2, 70, 20.0)
        torch.set_num_threads(2)
        two = conv_kernel.clipped_sums(convs, base2, 70, 20.0)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip([one[0], one[1], *sum(one[2], ())],
                                                 [two[0], two[1], *sum(two[2], ())]))


@needs_kernel
def test_one_pass_leaves_out_a_sample_whose_norm_is_not_finite_only_when_asked():
    """zero_nonfinite: the sample's factor is 0 and the sums are the other samples'; without it,
    its NaN reaches the sum (the caller's choice, as on every other route)."""
    convs, base2 = _two_layers(40)
    convs[0][1][7] = float("inf")
    norms2, coeff, sums = conv_kernel.clipped_sums(convs, base2, 40, 20.0, zero_nonfinite=True)
    assert not torch.isfinite(norms2[7]) and coeff[7] == 0 and torch.isfinite(coeff).all()
    keep = torch.arange(40) != 7
    others = [(layer, a[keep].contiguous(memory_format=torch.channels_last),
               g[keep].contiguous(memory_format=torch.channels_last)) for layer, a, g in convs]
    # The others' factors are those of a batch of 40 (n scales them), so compare against those.
    per_sample = [(conv_kernel.per_sample_grads(*conv)[0], conv[2].sum((2, 3))) for conv in others]
    for (summed, bias_summed), (ps, bias) in zip(sums, per_sample):
        expected = coeff[keep] @ ps.flatten(1)
        torch.testing.assert_close(summed, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        torch.testing.assert_close(bias_summed, coeff[keep] @ bias, rtol=1e-5,
                                   atol=1e-5 * (coeff[keep] @ bias.abs()).max().item())
    _, _, unguarded = conv_kernel.clipped_sums(convs, base2, 40, 20.0)
    assert not torch.isfinite(unguarded[0][0]).all()


@needs_kernel
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_the_kernel_refuses_shapes_its_layer_would_not_give():
    """The kernel reads through raw pointers where the layer's geometry says each patch lies: an
    output gradient larger than that geometry gives (a Conv2d subclass with its own forward)
    would make it read past the input. Refused before any read."""
    conv, x, grad = layer_and_gradients(LAYERS["mnist-cnn conv2"], n=4)
    big = torch.zeros(4, grad.shape[1], grad.shape[2] + 3, grad.shape[3]).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="do not fit the layer"):
        conv_kernel.per_sample_grads(conv, x, big)
    with pytest.raises(ValueError, match="do not fit the layer"):
        conv_kernel.clipped_sums([(conv, x, big)], torch.zeros(4), 4, 1.0)
    with pytest.raises(ValueError, match="samples' inputs"):
        conv_kernel.clipped_sums([(conv, x, grad)], torch.zeros(5), 5, 1.0)
    # 8 output channels: not whole vectors, whose remainder the kernel would leave unwritten.
    narrow = nn.Conv2d(16, 8, 4, stride=2).to(memory_format=torch.channels_last)
    g8 = torch.zeros(4, 8, *grad.shape[2:]).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="a multiple of 16"):
        conv_kernel.per_sample_grads(narrow, x, g8)
    # No input channels: no patch to read (the bias's gradient comes from the weight's blocks).
    empty = nn.Conv2d(0, 16, 3).to(memory_format=torch.channels_last)
    x0, g0 = torch.zeros(4, 0, 6, 6), torch.zeros(4, 16, 4, 4).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="is not one it takes"):
        conv_kernel.clipped_sums([(empty, x0, g0)], torch.zeros(4), 4, 1.0)


class _Cropping(nn.Conv2d):
    """A Conv2d whose forward crops its input, so that negative padding gives a real output."""

    def forward(self, x):
        return nn.functional.conv2d(x[:, :, 4:-4, 4:-4], self.weight, self.bias, self.stride, 0, self.dilation)


@needs_kernel
@pytest.mark.parametrize("case", ["weight smaller than kernel_size", "weight larger than kernel_size",
                                  "negative padding"])
def test_the_kernel_refuses_a_layer_whose_geometry_is_not_its_weights(case):
    """The C code sizes its reads and writes by kernel_size and padding, Python its buffers by
    the same numbers: a weight of another size (with a stride, the output has the right shape)
    wrote 4096-float rows into 256-float buffers (a crash), or read rows C never wrote (NaN
    in the released sum); negative padding wrote before the padding buffer. A review found
    each; each is refused before any pointer is passed."""
    n = 8
    if case == "negative padding":
        conv = _Cropping(16, 16, 3, padding=-4)
        x = torch.randn(n, 16, 40, 40)
    else:
        conv = nn.Conv2d(16, 16, kernel_size=4 if case.endswith("smaller than kernel_size") else 1, stride=4,
                         bias=False)
        conv.weight = nn.Parameter(torch.randn(16, 16, *((1, 1) if case.endswith("smaller than kernel_size")
                                                         else (4, 4))))
        x = torch.randn(n, 16, 8, 8)
    conv = conv.to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(conv(x).shape).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="is not one it takes"):
        conv_kernel.clipped_sums([(conv, x, g)], torch.zeros(n), n, 1.0)
    with pytest.raises(ValueError, match="is not one it takes"):
        conv_kernel.per_sample_grads(conv, x, g)


@needs_kernel
def test_one_pass_on_no_samples_is_zero():
    conv, x, grad = layer_and_gradients(LAYERS["mnist-cnn conv2"], n=0)
    norms2, coeff, ((summed, bias),) = conv_kernel.clipped_sums([(conv, x, grad)], torch.zeros(0), 0, 1.0)
    assert norms2.shape == coeff.shape == (0,) and summed.shape == (conv.weight.numel(),) and not summed.any()
    assert bias.shape == conv.bias.shape and not bias.any()


@needs_kernel
def test_the_openmp_build_and_the_pool_build_give_the_same_bits_at_any_number_of_threads(tmp_path, monkeypatch):
    """Built with OpenMP (the parts on torch's threads) or without (on Python's): the same
    norms, factors, sums and per-sample gradients, bit for bit, at 1, 2 and 3 threads."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    team, pool = conv_kernel.compiled(), conv_kernel.compiled(openmp=False)
    assert not pool.openmp
    if not team.openmp:
        pytest.skip("the compiler has no OpenMP")
    convs, base2 = _two_layers(100)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for kernel in (team, pool):
                sums = conv_kernel.clipped_sums(convs, base2, 100, 20.0, kernel=kernel)
                grads = conv_kernel.per_sample_grads(*convs[1], kernel=kernel)
                results.append([sums[0], sums[1], *sum(sums[2], ()), *grads])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


@needs_kernel
@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_openmp_build_runs_on_torchs_own_openmp_runtime():
    """One OpenMP runtime in the process: the kernel's parts run on torch's threads (a second
    libgomp would bring a second team, spinning against torch's)."""
    kernel = conv_kernel._library()
    if not kernel.openmp:
        pytest.skip("the compiler has no OpenMP")
    conv_kernel.clipped_sums(*_two_layers(64), 64, 20.0)
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line or "libomp" in line}
    assert len(runtimes) == 1, runtimes


@needs_kernel
def test_an_openmp_build_that_does_not_load_gives_way_to_the_build_without(tmp_path, monkeypatch):
    """An OpenMP build that the process cannot load (torch's libgomp older than the compiler's)
    falls back to the build without OpenMP, not to no kernel at all."""
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    real = conv_kernel.ctypes.CDLL
    team_path = conv_kernel.compiled(load=False)

    def cdll(path, *args, **kwargs):
        if str(path) == str(team_path):
            raise OSError("undefined symbol: GOMP_parallel")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(conv_kernel.ctypes, "CDLL", cdll)
    kernel = conv_kernel.compiled()
    assert not kernel.openmp
    convs, base2 = _two_layers(40)
    assert torch.isfinite(conv_kernel.clipped_sums(convs, base2, 40, 20.0, kernel=kernel)[0]).all()


RUNS_TARGETS = [("native", ()), *((march, ("WIDE_DB=8", "NARROW_DB=16"))
                                  for march in ("x86-64-v4", "x86-64-v3", "x86-64"))]


@needs_kernel
@pytest.mark.parametrize("march,blocks", RUNS_TARGETS)
def test_blocks_read_as_runs_give_the_bits_of_rows_read_one_by_one(march, blocks, tmp_path, monkeypatch):
    """The kernel reads a block of rows whose patch entries lie side by side (a kernel row's
    channels, or its columns where there is one channel) through one pointer a run: mnist-cnn's
    two convs, where it does so, give the same norms, factors, sums and per-sample gradients,
    bit for bit, as the build that reads every row's offset (-D NO_RUNS). Each target this CPU
    runs, with blocks of 8 and 16 rows where its own blocks are not runs of 8 (AVX2's 6, SSE's 14)."""
    if march != "native" and (__import__("platform").machine() != "x86_64" or not set(TARGETS[march]) <= _cpu_flags()):
        pytest.skip(f"this CPU cannot run {march}")
    monkeypatch.setenv("FEDSD_CACHE_DIR", str(tmp_path))
    fast, plain = conv_kernel.compiled(march, blocks), conv_kernel.compiled(march, (*blocks, "NO_RUNS"))
    convs = [layer_and_gradients(LAYERS["mnist-cnn conv1"], n=70, seed=1),
             layer_and_gradients(LAYERS["mnist-cnn conv2"], n=70, seed=2)]
    if march != "native" or fast.isa == "avx512":  # blocks of 16 rows × 1 vector (conv1), 8 × 2 or × 1 (conv2)
        assert conv_kernel.runs(*convs[0], kernel=fast)[1] or conv_kernel.runs(*convs[0], kernel=fast)[0]
        assert conv_kernel.runs(*convs[1], kernel=fast)[0]
    assert conv_kernel.runs(*convs[0], kernel=plain) == conv_kernel.runs(*convs[1], kernel=plain) == (False, False)
    assert not any(conv_kernel.runs(*layer_and_gradients(LAYERS["cifar-cnn conv1"]), kernel=fast))  # 3 channels
    base2 = torch.rand(70)
    C = float((conv_kernel.clipped_sums(convs, base2, 70, 1.0, kernel=plain)[0].sqrt() * 70).median())
    got = [conv_kernel.clipped_sums(convs, base2, 70, C, kernel=k) for k in (fast, plain)]
    grads = [conv_kernel.per_sample_grads(*convs[0], kernel=k) for k in (fast, plain)]
    flat = [[r[0], r[1], *sum(r[2], ()), *g] for r, g in zip(got, grads)]
    assert all(torch.equal(a, b) for a, b in zip(*flat))
    assert 0 < (got[0][1] < 70).sum() < 70  # some clipped, some not


# -- the C file: warnings, the ctypes signatures, the sanitizers -------------------------------------
KERNEL_C = Path(conv_kernel.__file__).with_name(conv_kernel.KERNEL_C)
C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "int32_t": ctypes.c_int32}


def c_prototypes(source: str) -> dict[str, tuple]:
    """Every function the C exports (not static), as (return type, argument types) in ctypes'
    terms, a pointer of any kind a c_void_p: read from the definitions' own text."""
    text = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    found = {}
    for ret, name, params in re.findall(r"^(void|int|int64_t|float)\s+(\w+)\s*\(([^)]*)\)\s*\{", text, flags=re.M):
        args = []
        for param in (p.strip() for p in params.split(",")):
            if param in ("void", ""):
                continue
            args.append(ctypes.c_void_p if "*" in param else C_TYPES[param.replace("const ", "").split()[0]])
        found[name] = (None if ret == "void" else C_TYPES[ret], args)
    return found


def signature_mismatches(source: str, table: dict) -> list[str]:
    declared = c_prototypes(source)
    wrong = [f"{name}: the C exports it, SIGNATURES lacks it" for name in declared.keys() - table.keys()]
    wrong += [f"{name}: in SIGNATURES, not exported by the C" for name in table.keys() - declared.keys()]
    wrong += [f"{name}: C {declared[name]}, SIGNATURES {table[name]}" for name in declared.keys() & table.keys()
              if tuple(declared[name]) != tuple(table[name])]
    return wrong


def test_the_ctypes_signatures_are_the_c_prototypes():
    source = KERNEL_C.read_text()
    assert len(c_prototypes(source)) == 9  # every exported function was read
    assert signature_mismatches(source, conv_kernel.SIGNATURES) == []
    # the check can fail: one argument fewer, and a function the table does not have
    shorter = {**conv_kernel.SIGNATURES, "block_sum": (None, conv_kernel.SIGNATURES["block_sum"][1][:-1])}
    assert [m.split(":")[0] for m in signature_mismatches(source, shorter)] == ["block_sum"]
    added = source + "\nint planted(float* x, int64_t n) { return (int)n + (int)x[0]; }\n"
    assert signature_mismatches(added, conv_kernel.SIGNATURES) == ["planted: the C exports it, SIGNATURES lacks it"]


def test_the_module_reads_its_c_file_and_a_bundles_copy_finds_the_installed_one(tmp_path):
    """The C is the package's conv_kernel.c; a Flower app bundle carries only the .py files, and
    its copy of the module (first on sys.path, as a ClientApp has it) reads the installed fedsd's."""
    assert conv_kernel.SOURCE == KERNEL_C.read_text() and "void clipped_conv_sums(" in conv_kernel.SOURCE
    for path in (ROOT / "fedsd").rglob("*.py"):
        copy = tmp_path / "fab" / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(path.read_bytes())
    code = ("from fedsd.clipping import conv_kernel as k; import sys; "
            "print(k.__file__); sys.stdout.write(k.SOURCE)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "fab")}, timeout=120)
    where, _, source = run.stdout.partition("\n")
    assert where.startswith(str(tmp_path / "fab")), run.stderr[-2000:]
    assert source == KERNEL_C.read_text()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("march,openmp", [("native", True), ("x86-64", False)])
def test_the_c_compiles_without_a_warning(march, openmp, tmp_path):
    if march == "x86-64" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 target")
    done = subprocess.run(["cc", "-O3", f"-march={march}", *(["-fopenmp"] if openmp else []), "-Wall", "-Wextra",
                           "-Werror", "-c", str(KERNEL_C), "-o", str(tmp_path / "kernel.o")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


SANITIZED = """
import torch
from fedsd.clipping import conv_kernel
from tests.clipping.test_conv_kernel import LAYERS, _two_layers, autograd_per_sample, layer_and_gradients

kernel = conv_kernel.compiled(flags=("-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                                     "-fno-omit-frame-pointer", "-g"))
for spec in LAYERS.values():
    conv, x, grad = layer_and_gradients(spec, n=5)
    got, norms2 = conv_kernel.per_sample_grads(conv, x, grad, kernel=kernel)
    assert torch.allclose(norms2, autograd_per_sample(conv, x, grad).flatten(1).pow(2).sum(1), rtol=1e-4)
for n in (0, 1, 33):
    convs, base2 = _two_layers(n)
    sums = conv_kernel.clipped_sums(convs, base2, max(n, 1), 1.0, kernel=kernel)
    assert all(torch.isfinite(s).all() for s in sums[0:1])
print("sanitized run: clean")
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_kernel_runs_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    """The kernel's own checks (each layer's gradients and norms, the one pass at 0, 1 and 33
    samples) on a build with AddressSanitizer and UBSan: any out-of-bounds read or write, or
    undefined behaviour, stops the process with the sanitizer's report."""
    asan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not Path(asan).is_file():
        pytest.skip("the compiler has no AddressSanitizer runtime")
    env = {**os.environ, "LD_PRELOAD": asan, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "FEDSD_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", SANITIZED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "sanitized run: clean" in run.stdout, (run.stdout + run.stderr)[-4000:]
    assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr, run.stderr[-4000:]
