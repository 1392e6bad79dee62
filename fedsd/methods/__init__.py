"""The training methods, one file each, registered by name (`register`).

A method says what a run of it carries and computes; the trainer (fedsd.training.loop) runs the
same DP-SGD steps for all of them:
  - its settings (`Settings`: a dataclass of fedsd.settings.declared.setting() fields, each with its
    help, its default for every data set and where that comes from, and its check), the one place
    they are declared: registering the method adds them to TrainConfig (fedsd.settings.run), from
    which the command line, the Flower run config and result.json are derived; and checks across
    them (`check`);
  - the groups of weights it carries from call to call (`groups`: the student, and where it has
    them the EMA or DPKD's teacher), which one it releases by default (`releases`; --release
    ema gives any method but DPKD dpema's release, `release_of`), and their start
    (`initial_model`);
  - each epoch's per-sample loss with its chance level (`epoch_loss`), and what changes when an
    epoch starts (`on_epoch_start`: DPKD's second stage);
  - the step callbacks a call of it runs (`step_callbacks`; the released EMA's is every method's,
    `release_callbacks`).
A new method is a subclass of `Method` in a file of its own, decorated with `@register`, with
its tests. Its hooks' `cfg` is the run's TrainConfig; for an editor, a method types it by what it
reads (`Method[DP3SDRun]`: a Protocol naming the settings it reads, on MethodRun). A package
outside fedsd adds one through the entry-point group `fedsd.methods`
(in its pyproject.toml: `[project.entry-points."fedsd.methods"]  mine = "my_package:MyMethod"`):
it is loaded when fedsd.methods is imported, and its settings become options of `fedsd train`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedsd.methods.base import (EMA_DECAY, METHODS, POSITIVE, RELEASES, UNIT_INTERVAL, EpochLoss, Method, MethodConfig,
                                MethodRun, Model, SelfDistillationConfig, SelfDistilling, SelfDistillingRun, Weights,
                                cross_entropy, distill_weight, register, release_callbacks, release_of, warming_up,
                                with_release)
from fedsd.registry import load_entry_points

if TYPE_CHECKING:
    from fedsd.settings.run import RunConfig

__all__ = ["EMA_DECAY", "METHODS", "MODEL_GROUPS", "POSITIVE", "RELEASES", "UNIT_INTERVAL", "EpochLoss", "Method",
           "MethodConfig", "MethodRun", "Model", "SelfDistillationConfig", "SelfDistilling", "SelfDistillingRun",
           "Weights", "cross_entropy", "distill_weight", "method_of", "register", "release_callbacks", "release_of",
           "released", "warming_up", "with_release"]

# fedsd 0.1's names of the settings base classes (a method plugin imports them): still given for
# this release, with a note naming the new one. Defined before the plugins load, which may ask.
RENAMED_CLASSES = {"MethodSettings": "MethodConfig", "SelfDistillationSettings": "SelfDistillationConfig"}


def __getattr__(name):
    if name in RENAMED_CLASSES:
        import warnings

        from fedsd.errors import FedsdNote

        new = RENAMED_CLASSES[name]
        warnings.warn(FedsdNote(f"fedsd.methods.{name}: renamed {new} in fedsd 0.2; {name} still works in this "
                                f"release"), stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from fedsd.methods import dpsgd, dpema, dpkd, dp3sd, dpdsd  # noqa: E402,F401  (each registers itself)

load_entry_points("fedsd.methods", register)
# every group of weights some method carries: what a model on the wire may hold
MODEL_GROUPS = tuple(dict.fromkeys(g for m in METHODS.values() for g in m.groups))


def method_of(cfg: RunConfig) -> Method[Any]:
    """The method of a run's settings (a TrainConfig)."""
    return METHODS[cfg.method]


def released(model: Model) -> Weights:
    """The weights a run releases and evaluates, found by the groups the model holds: the EMA
    where it carries one (dpema, --release ema), else the student."""
    return model.get("ema", model["student"])
