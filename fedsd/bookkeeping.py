"""Book-keeping per-sample clipping (Bu et al., 2023) for Conv2d / Linear models.

One backward pass gives each layer's output gradient g (and the forward pass kept its input
a); weight gradients are never computed by autograd. From (a, g):
  - per-sample gradient norms: for Linear ‖a_i‖²‖g_i‖² (no per-sample gradient at all); for
    Conv2d either the ghost norm Σ_{t,t'} (a_t·a_t')(g_t·g_t') over output positions (small
    maps), or the per-sample gradients from one grouped convolution backward (the batch as
    groups), whichever is cheaper for that layer's shape (GROUPED_CONV_COST);
  - the clipped sum Σ_i c_i ∇_i: the layer's ordinary weight gradient with each sample's
    output gradient scaled by c_i (one matrix product / one convolution backward),
  written into p.grad. Opacus' DPOptimizerFastGradientClipping then adds the noise and
  averages, as for its own ghost clipping. The clipping factor is Opacus' own:
  c_i = min(1, C / (‖∇_i‖ + 1e-6)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The per-sample conv norm: the ghost norm Σ_{t,t'} (a_t·a_t')(g_t·g_t') costs about 2T²(d+p)
# flops a sample (T output positions, d = c·k·k, p output channels); the per-sample gradient
# from a grouped convolution backward about T·d·p, but grouped kernels with one group a sample
# run far below peak (measured on CPU: conv 16→32, k4, on 13×13 maps at B = 1600, ghost 44 ms
# against grouped 130 ms). Ghost wins unless it costs this many times more flops.
GROUPED_CONV_COST = 8


def _patches(layer: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """im2col as one strided copy of the channels-last input: (n, T, k·k·c). Faster on CPU than
    F.unfold; the order of the d features does not matter for the ghost norm."""
    if tuple(layer.dilation) != (1, 1):
        return F.unfold(a, layer.kernel_size, padding=layer.padding, stride=layer.stride).transpose(1, 2)
    ph, pw = layer.padding
    a = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
    a = a.contiguous(memory_format=torch.channels_last)
    n, c, h, w = a.shape
    (kh, kw), (sh, sw) = layer.kernel_size, layer.stride
    th, tw = (h - kh) // sh + 1, (w - kw) // sw + 1
    sn, sc, sy, sx = a.stride()
    view = a.as_strided((n, th, tw, kh, kw, c), (sn, sy * sh, sx * sw, sy, sx, sc))
    return view.reshape(n, th * tw, kh * kw * c)


class BookKeepingClipper:
    def __init__(self, model: nn.Module, max_grad_norm: float):
        self.layers = []
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                if isinstance(module, nn.Conv2d) and (module.groups != 1 or module.padding_mode != "zeros"
                                                      or isinstance(module.padding, str)):
                    raise ValueError("--grad-sample-mode bk: Conv2d needs groups=1 and numeric zero padding")
                self.layers.append(module)
            elif list(module.children()) == [] and list(module.parameters(recurse=False)):
                raise ValueError(f"--grad-sample-mode bk: no book-keeping rule for {type(module).__name__}; "
                                 "use hooks or ghost")
        self.max_grad_norm = max_grad_norm
        self._inputs: dict[nn.Module, torch.Tensor] = {}
        self._outputs: dict[nn.Module, torch.Tensor] = {}
        for layer in self.layers:
            layer.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        if torch.is_grad_enabled():  # training forward only, not evaluation or a teacher
            self._inputs[module] = inputs[0].detach()
            self._outputs[module] = output

    def backward(self, loss: torch.Tensor, batch_size: int) -> None:
        """Set p.grad to the sum over the batch of the clipped per-sample gradients of the
        per-sample losses (`loss` is their mean over `batch_size` samples)."""
        layers = self.layers
        outputs = [self._outputs[m] for m in layers]
        grads = torch.autograd.grad(loss, outputs)  # output gradients only: no weight gradients
        norms2 = torch.zeros(batch_size, device=loss.device, dtype=loss.dtype)
        kept = []
        for layer, g in zip(layers, grads):  # g: gradients of the batch mean, 1/n of each sample's own
            a = self._inputs[layer]
            if isinstance(layer, nn.Linear):
                if a.dim() != 2:
                    raise ValueError("--grad-sample-mode bk: Linear layers need (batch, features) inputs")
                norms2 += a.pow(2).sum(1) * g.pow(2).sum(1)
                if layer.bias is not None:
                    norms2 += g.pow(2).sum(1)
                kept.append((layer, a, g))
                continue
            p, T = g.shape[1], g.shape[2] * g.shape[3]
            d = layer.weight[0].numel()
            if 2 * T * T * (d + p) < GROUPED_CONV_COST * T * d * p:
                A = _patches(layer, a)  # (n, T, d)
                G = g.flatten(2)  # (n, p, T)
                norms2 += (torch.bmm(A, A.transpose(1, 2)) * torch.bmm(G.transpose(1, 2), G)).sum((1, 2))
            else:  # ∇_i for every sample at once: one convolution backward with the batch as groups
                norms2 += self._per_sample_conv_grads(layer, a, g).pow(2).sum(1)
            if layer.bias is not None:
                norms2 += g.sum((2, 3)).pow(2).sum(1)
            kept.append((layer, a, g))
        # Scale back from the mean's gradients to each sample's own (×n), in the norms and in the
        # weights of the sum, rather than in every output gradient.
        norms = norms2.sqrt() * batch_size
        coeff = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * batch_size
        for layer, a, g in kept:
            weighted = g * coeff.view(-1, *([1] * (g.dim() - 1)))
            if isinstance(layer, nn.Linear):
                layer.weight.grad = weighted.t() @ a
                if layer.bias is not None:
                    layer.bias.grad = weighted.sum(0)
                continue
            # Σ_i c_i ∇_i is the ordinary weight gradient of the output gradients scaled by c_i.
            layer.weight.grad = torch.ops.aten.convolution_backward(
                weighted, a, layer.weight, None, list(layer.stride), list(layer.padding), list(layer.dilation),
                False, [0, 0], 1, [False, True, False])[1]
            if layer.bias is not None:
                layer.bias.grad = weighted.sum((0, 2, 3))
        self._inputs.clear()
        self._outputs.clear()

    @staticmethod
    def _per_sample_conv_grads(layer: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """(n, weight size) per-sample weight gradients: the n samples as n groups of one conv."""
        n, c, h, w = a.shape
        p = g.shape[1]
        shape = (n * p, c, *layer.kernel_size)
        grads = torch.ops.aten.convolution_backward(
            g.reshape(1, n * p, *g.shape[2:]), a.reshape(1, n * c, h, w), torch.empty(shape, device=a.device),
            None, list(layer.stride), list(layer.padding), list(layer.dilation), False, [0, 0], n,
            [False, True, False])[1]
        return grads.reshape(n, -1)
