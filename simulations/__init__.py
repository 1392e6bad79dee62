"""`simulations` moved into the one package `fedsd` (fedsd 0.2, docs/architecture.md).

Not installed: this folder only answers an old import from a checkout with the new place."""
_MOVED = """
    simulations                                   -> fedsd.cli
    simulations.benchmarks                        -> fedsd.benchmarks
    simulations.benchmarks.bench                  -> fedsd.benchmarks.bench
    simulations.benchmarks.distill_share          -> fedsd.benchmarks.distill_share
    simulations.benchmarks.secagg_cost            -> fedsd.benchmarks.secagg_cost
    simulations.benchmarks.secagg_protocol        -> fedsd.benchmarks.secagg_protocol
    simulations.benchmarks.soak                   -> fedsd.benchmarks.soak
    simulations.cli                               -> fedsd.cli.main
    simulations.commands                          -> fedsd.cli
    simulations.commands.audit_command            -> fedsd.cli.audit
    simulations.commands.dry_run                  -> fedsd.dry_run
    simulations.commands.ledger_command           -> fedsd.cli.ledger
    simulations.commands.parsing                  -> fedsd.settings.command_line
    simulations.commands.pretrain                 -> fedsd.cli.pretrain
    simulations.commands.privacy_check            -> fedsd.cli.check_privacy
    simulations.commands.runs                     -> fedsd.simulation.sweeps
    simulations.commands.secure_simulation        -> fedsd.simulation.secure_federation
    simulations.commands.simulate                 -> fedsd.cli.simulate
    simulations.commands.split_data               -> fedsd.cli.split_data
    simulations.commands.sweep                    -> fedsd.cli.sweep
    simulations.deployment                        -> fedsd.deployment
    simulations.deployment.deploy                 -> fedsd.deployment.deploy_local
    simulations.deployment.local_deployment       -> fedsd.deployment.local_deployment
    simulations.experiments                       -> fedsd.experiments
    simulations.experiments.distributed_table     -> fedsd.experiments.distributed_table
    simulations.experiments.features_table        -> fedsd.experiments.features_table
    simulations.experiments.federated_table       -> fedsd.experiments.federated_table
    simulations.experiments.paper_tables          -> fedsd.experiments.paper_tables
    simulations.experiments.pretrained_table      -> fedsd.experiments.pretrained_table
    simulations.experiments.readings              -> fedsd.experiments.readings
    simulations.experiments.reproduce             -> fedsd.experiments.reproduce
"""
raise ImportError("`simulations` moved into the package fedsd (the commands to fedsd.cli; benchmarks, deployment and experiments beside it). Old name -> new name:"
                  + _MOVED + "(docs/architecture.md)")
