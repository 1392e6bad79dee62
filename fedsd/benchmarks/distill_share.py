"""`fedsd bench distill-share`: how much of a self-distilling method's clipped gradient comes
from its distillation term, against its cross-entropy term, reading by reading.

Each sample's loss is a cross-entropy part (α·CE for dp3sd and dpkd, CE for dpdsd) plus a
distillation part (the rest of the method's own loss, so whatever the reading makes of it). Per
sample, both parts' gradients are taken with torch.func; the sample's whole gradient g = g_ce +
g_kd is clipped at C as DP-SGD clips it, scaled by s = min(1, C/‖g‖), and the batch's clipped
sum splits into S_ce = Σ s·g_ce and S_kd = Σ s·g_kd. The measure is ‖S_kd‖ / ‖S_ce‖, beside the
median per-sample ‖g_kd‖ / ‖g_ce‖ and the cosine between S_kd and S_ce (negative: the teacher
pulls against the labels).

It trains the method as `fedsd train` would (central, the validation split held out, seed 0)
and measures at the end of every epoch after the warm-up, on a fixed batch of training samples,
with the teacher the method has at that moment (the epoch's start, or the previous iterate under
--teacher-every step). Nothing here is released: it is a diagnostic, run on data the user holds.
"""
from __future__ import annotations

import math

import torch

from fedsd.training.callbacks import StepCallback
from fedsd.methods import losses
from fedsd.training.central import CentralRun
from fedsd.methods import METHODS
from fedsd.models.networks import model_for

PROBE_SAMPLES = 256


class TeacherAtEnd(StepCallback):
    """Keeps the student and the teacher as they are after the call's last step."""

    def on_call_end(self, trainer) -> None:
        strip = lambda sd: {k.removeprefix("_module."): v.detach().clone() for k, v in sd.items()}  # noqa: E731
        self.student, self.teacher = strip(trainer.model.state_dict()), strip(trainer.teacher.state_dict())


def ce_part(cfg, method: str):
    """The cross-entropy part of a method's loss, per sample (the rest is the distillation part)."""
    if method == "dp3sd":
        return lambda s, y: cfg.dp3sd_alpha * losses.cross_entropy(s, y, tau=cfg.dp3sd_tau_s, reduction="none")
    if method == "dpdsd":
        tau = cfg.dpdsd_tau if cfg.dpdsd_ce == "tau" else 1.0
        return lambda s, y: losses.cross_entropy(s, y, tau=tau, reduction="none")
    if method == "dpkd":
        return lambda s, y: cfg.dpkd_alpha * losses.cross_entropy(s, y, reduction="none")
    raise ValueError(f"{method} has no distillation term")


def clipped_shares(net: torch.nn.Module, student: dict, teacher: dict, x: torch.Tensor, y: torch.Tensor,
                   total, ce, clip: float) -> dict:
    """‖S_kd‖/‖S_ce‖, their cosine, the median per-sample ‖g_kd‖/‖g_ce‖ and the share of samples
    clipped, for per-sample losses `total(s, t, y)` and `ce(s, y)` at parameters `student`."""
    from torch.func import functional_call, grad, vmap

    params = {k: v for k, v in student.items() if k in dict(net.named_parameters())}
    buffers = {k: v for k, v in student.items() if k not in params}
    with torch.no_grad():
        teacher_logits = functional_call(net, teacher, (x,))

    def sample_loss(p, xi, ti, yi, which):
        logits = functional_call(net, {**p, **buffers}, (xi[None],))
        return (total(logits, ti[None], yi[None]) if which == "total" else ce(logits, yi[None])).sum()

    def flat(which):
        g = vmap(grad(sample_loss), in_dims=(None, 0, 0, 0, None))(params, x, teacher_logits, y, which)
        return torch.cat([v.reshape(len(x), -1) for v in g.values()], dim=1)

    g_total, g_ce = flat("total"), flat("ce")
    g_kd = g_total - g_ce
    scale = (clip / g_total.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
    s_ce, s_kd = (scale[:, None] * g_ce).sum(0), (scale[:, None] * g_kd).sum(0)
    per_sample = g_kd.norm(dim=1) / g_ce.norm(dim=1).clamp_min(1e-12)
    return dict(clipped_share=float(s_kd.norm() / s_ce.norm().clamp_min(1e-12)),
                cosine=float(torch.nn.functional.cosine_similarity(s_kd, s_ce, dim=0)),
                median_sample_ratio=float(per_sample.median()), clipped=float((scale < 1).float().mean()))


def measure(cfg, probe_samples: int = PROBE_SAMPLES, progress=None) -> list[dict]:
    """Train `cfg` (central, no folder) and measure the shares at the end of every epoch whose
    loss reads the teacher; one record per such epoch."""
    run = CentralRun(cfg)
    cfg = run.cfg
    method = METHODS[cfg.method]
    data = run.trainer.data
    g = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(data.y_train), generator=g)[:probe_samples]
    x, y = data.x_train[pick].contiguous(), data.y_train[pick]
    net = model_for(cfg, data.num_classes).to(x.device)
    records = []
    for epoch in run.remaining_epochs():
        loss = method.epoch_loss(cfg, epoch)
        end = TeacherAtEnd()
        run.model, run.state, metrics = run.trainer.local_update(run.model, run.state, [epoch], callbacks=[end])
        if loss.reads_teacher:
            shares = clipped_shares(net, end.student, end.teacher, x, y, loss.per_sample, ce_part(cfg, cfg.method),
                                    cfg.clip)
            records.append(dict(epoch=epoch, **shares))
        if progress is not None:
            progress(epoch, records[-1] if records and records[-1]["epoch"] == epoch else None)
    return records


def summary(records: list[dict]) -> dict:
    """The run's measures over its distilling epochs: the mean of each, and the last epoch's."""
    if not records:
        return {}
    keys = ("clipped_share", "cosine", "median_sample_ratio", "clipped")
    mean = {k: sum(r[k] for r in records) / len(records) for k in keys}
    return dict(epochs=len(records), mean=mean, last=records[-1],
                finite=all(math.isfinite(r[k]) for r in records for k in keys))
