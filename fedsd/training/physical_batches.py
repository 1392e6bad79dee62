"""Physical batches: a logical (Poisson) batch too large for memory is trained a part at a time.

DP-SGD's step is the noisy sum of the batch's clipped per-sample gradients. The sum splits over
any partition of the batch, so, as Opacus' BatchMemoryManager does, the batch is cut into
physical batches of at most `--max-physical-batch-size` samples: each is forwarded and
backwarded on its own, its clipped sum is kept (fedsd.clipping.Clipper.hold), and the noise is
added once, to the whole batch's sum. The sampling, the noise, the accounting and the weights
are those of the logical batch (equal to float rounding: tests/models/test_models.py).

By default the size is what fits: a budget of memory over what one sample costs, estimated from
one forward pass (its activations, kept for the backward pass and matched by their gradients)
and the model's size (a per-sample gradient of every weight, as Opacus' hooks make). The papers'
networks fit their whole batches (a few hundred kB a sample); resnet18 on CIFAR-10 takes about
100 MB a sample, so B = 1000 would need about 100 GB at once.
"""
from __future__ import annotations

import torch
from torch import nn

from fedsd.models.networks import model_for

# The share of the free memory one trainer may take, and on a CPU at most this many bytes: the
# nodes of a federation that share a machine (Ray's workers, co-located SuperNodes) each train
# at once, and a swapping machine is worse than more, smaller physical batches.
MEMORY_SHARE = 0.5
CPU_BYTES_CAP = 4 << 30
# Activations are kept for the backward pass, which makes their gradients and, for the clippers,
# the layers' inputs and output gradients again.
ACTIVATION_COPIES = 3
GRAD_SAMPLE_COPIES = 2  # the per-sample gradients, and the clipped copy Opacus makes of them


def sample_bytes(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """What one sample of a training step costs in memory, estimated from one forward pass."""
    sizes = []

    def keep(module, inputs, output):
        if isinstance(output, torch.Tensor):
            sizes.append(output.numel() * output.element_size())

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_hook(keep) for m in leaves]
    try:
        parameter = next(model.parameters())
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a dropout draws nothing of the run's
            model(torch.zeros((1, *input_shape), device=parameter.device, dtype=parameter.dtype))
    finally:
        for h in handles:
            h.remove()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return ACTIVATION_COPIES * sum(sizes) + GRAD_SAMPLE_COPIES * weights


def free_bytes(device: torch.device) -> int:
    """The memory a trainer on `device` may take (MEMORY_SHARE of what is free; CPU_BYTES_CAP)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(MEMORY_SHARE * free)
    available = CPU_BYTES_CAP / MEMORY_SHARE
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass  # not Linux: the cap alone
    return int(min(MEMORY_SHARE * available, CPU_BYTES_CAP))


def physical_batch_size(cfg, model: nn.Module, input_shape: tuple[int, ...], device: torch.device) -> int:
    """The most samples one forward and backward pass takes: --max-physical-batch-size, or what
    fits (sample_bytes, free_bytes)."""
    if cfg.max_physical_batch_size:
        return cfg.max_physical_batch_size
    fits = max(1, free_bytes(device) // max(1, sample_bytes(model, input_shape)))
    return fits - fits % 8 if fits >= 8 else fits  # a multiple of 8: one size from run to run as free memory varies


def measured_batch_size(cfg, num_classes: int, input_shape: tuple[int, ...], device: torch.device) -> int:
    """The batch one pass of a run of `cfg` takes (its batch size, or its physical batch size
    where that is smaller): what `fedsd bench routes --measure` times a route on (fedsd.clipping.routes)."""
    model = model_for(cfg, num_classes, seed=0).to(device)  # seeded: the run's random state untouched
    return min(cfg.batch_size, physical_batch_size(cfg, model, input_shape, device))
