"""Book-keeping per-sample clipping (Bu et al., 2023) for Conv2d / Linear models.

One backward pass gives each layer's output gradient g (and the forward pass kept its input
a); autograd never computes a weight gradient. Per layer, from (a, g):
  - Linear: the per-sample norm is ‖a_i‖²‖g_i‖², with no per-sample gradient at all, and the
    clipped sum Σ_i c_i ∇_i is one matrix product of the reweighted output gradients.
  - Conv2d with small output maps: the ghost norm Σ_{t,t'} (a_t·a_t')(g_t·g_t') over output
    positions, and the clipped sum as one ordinary convolution weight gradient of the
    reweighted output gradients.
  - Conv2d with large maps (T² ≫ d·p): the per-sample gradients G_iᵀA_i from batched
    matrix products of the im2col patches, their norms, and the clipped sum cᵀ(∇_1 … ∇_n).
    That skips both the reweighting of the layer's (large) output gradient and its weight
    gradient convolution.
On CPU, per-sample gradients come from fedsd.clipping.conv_kernel, which never writes the patches
(where it is not built, the patches are made and used a cache-sized chunk of the batch at a
time), nor the per-sample gradients: its one pass (clipped_sums) measures, clips and sums each
sample's while they are in cache, once every other layer's norms are known.
The result is written into p.grad; Opacus' DPOptimizerFastGradientClipping then adds the noise
and averages, as for its own ghost clipping. The clipping factor is Opacus' own:
c_i = min(1, C / (‖∇_i‖ + 1e-6)). Everything works on channels-last activations without a
layout change (results/perf.md).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from fedsd.clipping import conv_kernel
from fedsd.errors import ConfigError

# Ghost norms cost 2T²(d+p) flops a sample (T output positions, d = c·k·k inputs per position,
# p output channels), per-sample gradients 2T·d·p plus the patches. Measured on this CPU at
# the papers' batch sizes (results/perf.md), with the patches and batched products ghost wins
# up to about twice the flops: mnist-cnn conv2 (0.9×) and cifar-cnn conv3 (1.1×), conv4 (0.15×)
# take ghost norms; mnist-cnn conv1 (15×) and cifar-cnn conv1 (>100×), conv2 (4.9×) per-sample
# gradients. fedsd.clipping.conv_kernel's per-sample gradients are faster, so with it ghost norms win
# only below about a tenth of the flops (cifar-cnn conv4, 0.15×: kernel 14.6 ms, ghost 19.4;
# fedsd.clipping.routes' RULES, which a run's route follows, has the measurements).
GHOST_FLOPS_LIMIT = 2.0
GHOST_FLOPS_LIMIT_WITH_KERNEL = 0.1
# The im2col patches of a chunk of the batch, in bytes, on CPU: 2 MiB stays in this CPU's cache
# (measured on mnist-cnn at B = 1600, 1 thread: conv1's per-sample gradients 43 → 28 ms, conv2's
# ghost norms 31 → 20 ms; chunks of 1–4 MiB within a millisecond of each other).
PATCH_CHUNK_BYTES = 2 << 20


def _patches(layer: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """im2col as (n, T, kh·kw·c): one strided copy of the (padded) channels-last input, in the
    feature order of a channels-last weight (p, kh, kw, c)."""
    n, c, h, w = a.shape
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
    ph, pw = layer.padding
    nhwc = a.permute(0, 2, 3, 1)  # a view when a is channels-last
    if ph or pw:
        padded = a.new_zeros((n, h + 2 * ph, w + 2 * pw, c))
        padded[:, ph:ph + h, pw:pw + w] = nhwc
        nhwc = padded
    else:
        nhwc = nhwc.contiguous()
    hp, wp = nhwc.shape[1:3]
    th, tw = (hp - dh * (kh - 1) - 1) // sh + 1, (wp - dw * (kw - 1) - 1) // sw + 1
    sn, sy, sx, sc = nhwc.stride()
    view = nhwc.as_strided((n, th, tw, kh, kw, c), (sn, sy * sh, sx * sw, sy * dh, sx * dw, sc))
    return view.reshape(n, th * tw, kh * kw * c)


def _chunks(layer: nn.Conv2d, a: torch.Tensor, T: int) -> range:
    """Starts of the batch chunks whose im2col patches fit in cache (CPU): patches written and
    read back at once cost a fraction of a whole batch's (80 MB for mnist-cnn conv1 at
    B = 1600), which go out to memory and back. On a GPU, the whole batch in one launch."""
    n = a.shape[0]
    if a.device.type != "cpu":
        return range(0, n, max(n, 1))
    per_sample = T * layer.weight[0].numel() * a.element_size()
    return range(0, n, max(1, PATCH_CHUNK_BYTES // per_sample))


def _per_sample_grads(layer: nn.Conv2d, a: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """(n, p, kh·kw·c): each sample's GᵢᵀAᵢ, its patches Aᵢ made chunk by chunk."""
    n, T, p = G.shape
    out = a.new_empty((n, p, layer.weight[0].numel()))
    starts = _chunks(layer, a, T)
    for s in starts:
        e = s + starts.step
        torch.bmm(G[s:e].transpose(1, 2), _patches(layer, a[s:e]), out=out[s:e])
    return out


def _ghost_norms2(layer: nn.Conv2d, a: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Each sample's squared gradient norm Σ_{t,t'} (a_t·a_t')(g_t·g_t'), chunk by chunk."""
    n, T, _ = G.shape
    norms2 = a.new_empty(n)
    starts = _chunks(layer, a, T)
    for s in starts:
        e = s + starts.step
        A, Gs = _patches(layer, a[s:e]), G[s:e]
        norms2[s:e] = (torch.bmm(A, A.transpose(1, 2)) * torch.bmm(Gs, Gs.transpose(1, 2))).sum((1, 2))
    return norms2


def clip_factor(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Opacus' per-sample clipping factor (DPOptimizer, ghost clipping): min(1, C / (‖∇_i‖ + 1e-6))."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


# How a conv layer's per-sample norms and clipped sum are made: ghost norms and a reweighted
# weight gradient, per-sample gradients from fedsd.clipping.conv_kernel, or from PyTorch's patches and
# batched products.
CONV_WAYS = ("ghost", "kernel", "patches")


class BookKeepingEngine:
    """The book-keeping computation (hooks, per-sample norms, the clipped sum) that the `bk`
    clipper (fedsd.clipping.bk.BookKeeping, a Clipper) runs; not a Clipper itself."""

    def __init__(self, model: nn.Module, max_grad_norm: float, kernel: bool = True,
                 conv_ways: dict[int, str] | None = None):
        """kernel=False: per-sample gradients by PyTorch's batched products, never fedsd.clipping.conv_kernel.
        conv_ways: a way of CONV_WAYS for each conv layer (by its index among the model's
        Conv2d/Linear layers), as the run's route says (fedsd.clipping.routes); unset, a flops rule
        chooses (uses_ghost_norm)."""
        self.layers = []
        for module in model.modules():
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue  # no weights, or a frozen block's (--train-layers): no gradient, no clipping, no route
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                                      or isinstance(module.padding, str)):
                    raise ConfigError("--grad-sample-mode bk: Conv2d needs groups=1 and numeric zero padding")
                self.layers.append(module)
            else:  # GroupNorm, a class token, ...: no rule, wrong sums
                raise ConfigError(f"--grad-sample-mode bk: no book-keeping rule for {type(module).__name__}; "
                                 "use hooks or ghost")
        self.max_grad_norm = max_grad_norm
        self.kernel = kernel
        self.conv_ways = dict(conv_ways) if conv_ways is not None else None
        self.taken: dict[int, str] = {}  # the way each conv layer took in the last step (benchmarks)
        self.norms: torch.Tensor | None = None  # each sample's gradient norm in the last backward pass
        # Watches, never changes: observer(layer, part) is entered around each layer's per-sample
        # norms ("norms") and its part of the clipped sum ("clip-sum"), a context manager (`fedsd
        # bench step --layers` times them), and observer((layer, ...), "norms") around the kernel
        # layers' one pass that makes both; the same computation runs with or without it.
        self.observer = None
        self._inputs: dict[nn.Module, torch.Tensor] = {}
        self._outputs: dict[nn.Module, torch.Tensor] = {}
        for layer in self.layers:
            layer.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        if torch.is_grad_enabled():  # training forward only, not evaluation or a teacher
            self._inputs[module] = inputs[0].detach()
            self._outputs[module] = output

    @staticmethod
    def uses_ghost_norm(layer: nn.Conv2d, g: torch.Tensor, kernel: bool) -> bool:
        T, p, d = g.shape[2] * g.shape[3], g.shape[1], layer.weight[0].numel()
        limit = GHOST_FLOPS_LIMIT_WITH_KERNEL if kernel else GHOST_FLOPS_LIMIT
        return 2 * T * T * (d + p) < limit * 2 * T * d * p

    def way(self, index: int, layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> str:
        """The way conv layer `index` takes for this (a, g): the measured one where given (PyTorch's
        patches where the kernel does not apply here), else the flops rule."""
        kernel = self.kernel and conv_kernel.applies(layer, a, g)
        if self.conv_ways is not None and index in self.conv_ways:
            chosen = self.conv_ways[index]
            return "patches" if chosen == "kernel" and not kernel else chosen
        return "ghost" if self.uses_ghost_norm(layer, g, kernel) else "kernel" if kernel else "patches"

    def captured(self, loss: torch.Tensor) -> list[tuple[nn.Module, torch.Tensor, torch.Tensor]]:
        """(layer, its input a, its output gradient g) for every layer, from one backward pass
        that computes no weight gradients (g is of the batch mean: 1/n of each sample's own)."""
        grads = torch.autograd.grad(loss, [self._outputs[m] for m in self.layers])
        found = [(layer, self._inputs[layer], g) for layer, g in zip(self.layers, grads)]
        self._inputs.clear()
        self._outputs.clear()
        return found

    @staticmethod
    def add_layer_norms2(norms2: torch.Tensor, layer: nn.Module, a: torch.Tensor, g: torch.Tensor,
                         way: str | None) -> tuple:
        """Add one layer's squared per-sample gradient norms (of the batch mean's gradients) to
        `norms2`, in place, and return what its clipped sum needs: (per-sample weight gradients
        or None, per-sample bias gradients or None). `way`: a conv layer's "ghost" or "patches";
        the kernel's layers are measured in their one pass (backward, conv_kernel.clipped_sums)."""
        if isinstance(layer, nn.Linear):
            if a.dim() != 2:
                raise ConfigError("--grad-sample-mode bk: Linear layers need (batch, features) inputs")
            g2 = g.pow(2).sum(1)  # ‖g_i‖²: the weight's factor and the bias's own norm
            norms2 += a.pow(2).sum(1) * g2
            if layer.bias is not None:
                norms2 += g2
            return None, None
        n, p, th, tw = g.shape
        per_sample_bias = _add_bias_norms2(norms2, layer, g)
        G = g.permute(0, 2, 3, 1).reshape(n, th * tw, p)  # (n, T, p), a view when channels-last
        if way == "ghost":
            norms2 += _ghost_norms2(layer, a, G)
            return None, None
        per_sample = _per_sample_grads(layer, a, G)
        norms2 += torch.linalg.vector_norm(per_sample.flatten(1), dim=1).square()
        return per_sample, per_sample_bias

    @staticmethod
    def layer_clipped_sum(layer: nn.Module, a: torch.Tensor, g: torch.Tensor, kept: tuple,
                          coeff: torch.Tensor) -> None:
        """Set the layer's p.grad to Σ_i coeff_i ∇_i."""
        per_sample, per_sample_bias = kept
        if per_sample is not None:  # Σ_i c_i ∇_i straight from PyTorch's per-sample gradients (p, kh, kw, c)
            _set_summed(layer, coeff @ per_sample.flatten(1), False,
                        None if per_sample_bias is None else coeff @ per_sample_bias)
            return
        weighted = g * coeff.view(-1, *([1] * (g.dim() - 1)))
        if isinstance(layer, nn.Linear):
            layer.weight.grad = weighted.t() @ a
            if layer.bias is not None:
                layer.bias.grad = weighted.sum(0)
            return
        # Σ_i c_i ∇_i is the ordinary weight gradient of the output gradients scaled by c_i.
        layer.weight.grad = torch.ops.aten.convolution_backward(
            weighted, a, layer.weight, None, list(layer.stride), list(layer.padding), list(layer.dilation),
            False, [0, 0], 1, [False, True, False])[1]
        if layer.bias is not None:
            layer.bias.grad = weighted.sum((0, 2, 3))

    def backward(self, loss: torch.Tensor, batch_size: int, zero_nonfinite: bool = False) -> None:
        """Set p.grad to the sum over the batch of the clipped per-sample gradients of the
        per-sample losses (`loss` is their mean over `batch_size` samples). zero_nonfinite: a
        sample whose gradient norm is not finite joins the sum with a zero gradient (its rows of
        every layer's input, output gradient and per-sample gradients zeroed; the same work for
        any data). The conv layers that take the kernel are measured, clipped and summed in one
        pass (conv_kernel.clipped_sums), which an observer sees as those layers' norms, together."""
        watch = self.observer or _unwatched
        norms2 = torch.zeros(batch_size, device=loss.device, dtype=loss.dtype)
        kept, fused = [], []
        for index, (layer, a, g) in enumerate(self.captured(loss)):
            way = self.way(index, layer, a, g) if isinstance(layer, nn.Conv2d) else None
            if way is not None:
                self.taken[index] = way
            if way == "kernel":  # weight's and bias's norms, factors and sums in the one pass
                kept.append((layer, a, g, _FusedConv(len(fused))))
                fused.append((layer, a, g))
                continue
            with watch(layer, "norms"):
                kept.append((layer, a, g, self.add_layer_norms2(norms2, layer, a, g, way)))
        if fused:  # the kernel's layers last: their pass needs every other weight's norms
            with watch(tuple(layer for layer, _, _ in fused), "norms"):  # one part: the pass makes both at once
                norms2, coeff, sums = conv_kernel.clipped_sums(fused, norms2, batch_size, self.max_grad_norm,
                                                               zero_nonfinite)
        else:
            # Scale back from the mean's gradients to each sample's own (×n), in the norms and in
            # the weights of the sum, rather than in every output gradient.
            coeff = clip_factor(norms2.sqrt() * batch_size, self.max_grad_norm) * batch_size
        self.norms = norms2.sqrt() * batch_size
        if zero_nonfinite:
            bad = ~torch.isfinite(self.norms)
            coeff = torch.where(bad, torch.zeros((), dtype=coeff.dtype, device=coeff.device), coeff)
            # The pass's layers are summed already (a bad sample added +0.0): nothing of theirs to zero.
            kept = [(layer, a, g, needs) if isinstance(needs, _FusedConv)
                    else (layer, *(_zero_rows(t, bad) for t in (a, g)), tuple(_zero_rows(t, bad) for t in needs))
                    for layer, a, g, needs in kept]
        for layer, a, g, needs in kept:
            with watch(layer, "clip-sum"):
                if isinstance(needs, _FusedConv):
                    summed, bias_summed = sums[needs.index]
                    _set_summed(layer, summed, True, bias_summed)
                else:
                    self.layer_clipped_sum(layer, a, g, needs, coeff)


def _add_bias_norms2(norms2: torch.Tensor, layer: nn.Conv2d, g: torch.Tensor) -> torch.Tensor | None:
    """Add a conv layer's per-sample bias gradients' squared norms; return them (None: no bias)."""
    if layer.bias is None:
        return None
    per_sample_bias = g.sum((2, 3))
    norms2 += per_sample_bias.pow(2).sum(1)
    return per_sample_bias


@dataclasses.dataclass(frozen=True)
class _FusedConv:
    """A conv layer in conv_kernel.clipped_sums' pass (its weight's and bias's clipped sums come
    from there): its place among that pass's layers."""
    index: int


def _set_summed(layer: nn.Conv2d, summed: torch.Tensor, d_first: bool, bias_summed: torch.Tensor | None) -> None:
    """A conv layer's p.grad from its clipped sum Σ_i c_i ∇_i, flat in (kh, kw, c, p) order
    (d_first, the kernel's) or (p, kh, kw, c), and its bias's from Σ_i c_i ∇b_i (None: no bias)."""
    p, c, kh, kw = layer.weight.shape
    summed = summed.view(kh, kw, c, p).permute(3, 2, 0, 1) if d_first else summed.view(p, kh, kw, c).permute(0, 3, 1, 2)
    layer.weight.grad = summed.contiguous(memory_format=_format_of(layer.weight))
    if bias_summed is not None:
        layer.bias.grad = bias_summed


def _unwatched(layer: nn.Module, part: str) -> contextlib.nullcontext:
    """No observer: nothing around a layer's part."""
    return contextlib.nullcontext()


def _zero_rows(t, bad: torch.Tensor):
    """`t` with the rows (first dimension) of the `bad` samples zeroed; what is not a tensor, as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.where(bad.view(-1, *([1] * (t.dim() - 1))), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _format_of(weight: torch.Tensor) -> torch.memory_format:
    """A gradient in its parameter's layout, so the optimizer's updates need no conversion."""
    return torch.channels_last if weight.is_contiguous(memory_format=torch.channels_last) \
        and not weight.is_contiguous() else torch.contiguous_format
