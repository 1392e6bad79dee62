"""`fedsd train`: central DP training, the papers' setup (one client holding all the data)."""
from __future__ import annotations

import argparse

from fedsd import dry_run
from fedsd.settings.recipe_files import add_recipe_option, blamed_on, with_recipe
from fedsd.errors import ConfigError
from fedsd.models.networks import start_report
from fedsd.models.pretrained import start_line
from fedsd.settings.declared import add_options, from_args, settings_of
from fedsd.settings.run import RENAMED, RENAMED_TYPES, TrainConfig, method_groups, renamed_settings
from fedsd.training.central import load_checkpoint, plan_run, train
from fedsd.training.summary import run_summary


def add_train_options(p: argparse.ArgumentParser, epsilon_required: bool = True, out_required: bool = True) -> None:
    """Every TrainConfig setting as an option (declared once, in fedsd.settings.run), and the run's folder."""
    add_options(p, TrainConfig, required=("epsilon",) if epsilon_required else (), groups=method_groups(p))
    for old in RENAMED:  # fedsd 0.1's flags: still taken in this release, with a note (config_from_args)
        p.add_argument("--" + old.replace("_", "-"), dest="renamed_" + old, type=RENAMED_TYPES.get(old, float),
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--out", required=out_required, help="result folder (must be new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--route-from", metavar="RUN", default=None,
                   help="take the clipping route the run in folder RUN recorded (its result.json or checkpoint): "
                        "its weights again, on any machine with the same thread count and instruction set")
    p.add_argument("--log-dir", default=None, help="TensorBoard log folder, per epoch or round: accuracy, loss, ε "
                   "(each client's too), and the settings as hparams (default: OUT/tensorboard where TensorBoard is "
                   "installed, pip install 'fedsd[tensorboard]'; off: none)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The settings given, with --route-from's route as --route (checked against the run's network,
    input and thread count)."""
    old = {name: getattr(args, "renamed_" + name) for name in RENAMED if hasattr(args, "renamed_" + name)}
    given = renamed_settings(old, getattr(args, "method", None), say="flag")
    taken = sorted(n for n in given if hasattr(args, n) and n not in getattr(args, "from_recipe", {}))  # typed twice
    if taken:
        raise ConfigError(f"--{taken[0].replace('_', '-')}: given twice, once under its old name (fedsd 0.1's); "
                          f"give --{taken[0].replace('_', '-')} only")
    cfg = from_args(TrainConfig, args, **given)
    if getattr(args, "route_from", None):
        import dataclasses

        from fedsd.clipping import routes
        from fedsd.data.client_data import with_custom_task

        if cfg.route:
            raise ConfigError("--route-from: gives the run's route; leave out --route")
        cfg = dataclasses.replace(cfg, route=routes.route_from(args.route_from, with_custom_task(cfg).resolved()))
    return cfg


def cmd_train(args) -> int:
    recipe = with_recipe(args, "train")
    with blamed_on(recipe, args):
        return _train(args, recipe)


def _train(args, recipe) -> int:
    if args.resume:
        given = [s.flag for s in settings_of(TrainConfig) if hasattr(args, s.name)]
        given += [flag for flag, on in (("--out", args.out), ("--overwrite", args.overwrite),
                                        ("--route-from", args.route_from)) if on]
        if given:
            raise ConfigError(f"--resume DIR goes on with that run's own saved settings and folder; leave out "
                             f"{', '.join(given)}")
        saved = load_checkpoint(args.resume)  # every check before any work
        if dry_run.requested():
            plan_run(saved["config"])
            dry_run.stop_here(f"resume {args.resume} after epoch {len(saved['epochs'])} of {saved['config'].epochs}")
        result, _ = train(None, args.resume, resume=True, progress=not args.quiet, log_dir=args.log_dir)
        print(run_summary(result, args.resume))
        return 0
    missing = [flag for flag, value in (("--epsilon", getattr(args, "epsilon", None)), ("--out", args.out))
               if value is None]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)} (or --resume DIR)"
                          + (f"; recipe {recipe.name} leaves {', '.join(missing)} to the command line"
                             if recipe else ""))
    if dry_run.requested():  # train() runs the same checks first
        inputs, plan = plan_run(config_from_args(args), args.out, args.overwrite)
        cfg = inputs.cfg
        dry_run.stop_here(f"train {cfg.method} on {len(inputs.train_indices)} {cfg.dataset} samples for {cfg.epochs} "
                          f"epochs at B = {cfg.batch_size}, lr {cfg.lr:g}, momentum {cfg.momentum:g}, "
                          f"σ={plan.noise_multiplier:.3f}, q={plan.sample_rate:.4g} (ε={cfg.epsilon:g}) into {args.out}"
                          + (f"; {start_line(start_report(cfg, inputs.data.num_classes))}"
                             if start_report(cfg, inputs.data.num_classes) else "") + adaptive_line(cfg, plan))
    result, _ = train(config_from_args(args), args.out, overwrite=args.overwrite, progress=not args.quiet,
                      log_dir=args.log_dir)
    print(run_summary(result, args.out))
    return 0


def adaptive_line(cfg, plan) -> str:
    """--clip-quantile, as a dry run says it (its count's noise refused here where it leaves the
    gradient nothing of σ, as the run would refuse it before its first step)."""
    from fedsd.clipping.adaptive import QuantileClip

    rule = QuantileClip.of(cfg)
    if rule is None:
        return ""
    return (f"; the clip starts at {cfg.clip:g} and follows the {rule.quantile:g} quantile of the per-sample norms "
            f"(rate {rule.lr:g}, σ_b = {rule.count_noise:g} on each step's count, the gradient's noise multiplier "
            f"{rule.gradient_noise_multiplier(plan.noise_multiplier):.4f} for the plan's σ)")


def add_train_parser(sub) -> None:
    p_train = sub.add_parser("train", help="central DP training (the papers' setup)")
    add_train_options(p_train, epsilon_required=False, out_required=False)
    add_recipe_option(p_train, "train")
    # Required unless --resume (argparse cannot say "one of"): its help must not show the
    # declared default, 3.0, which only `fedsd simulate` and a Flower run take.
    epsilon = next(a for a in p_train._actions if a.dest == "epsilon")
    epsilon.help = epsilon.help.split(" (default:")[0] + " (required, unless --resume or a recipe gives it)"
    p_train.add_argument("--resume", metavar="DIR", default=None,
                         help="continue the unfinished run in DIR (stopped at any moment) with its own saved "
                              "settings; it ends with the weights of a run that was never stopped")
    p_train.set_defaults(func=cmd_train)
