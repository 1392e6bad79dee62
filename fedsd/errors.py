"""fedsd's errors, in one place and light to import (a ClientApp's forwarder imports them
without torch).

Every error fedsd raises on purpose is a FedsdError. A UserError is one the user can fix (an
option, a file, a budget): its message names what to change, and a command prints it as one
line. Anything else is a bug and keeps its traceback. Each keeps the built-in type it had
(ValueError, FileNotFoundError, ...) so that `except ValueError` still catches it.
"""
from __future__ import annotations


class FedsdNote(UserWarning):
    """Something a user should know once, in fedsd's words (the `fedsd` command prints it as
    one line, `fedsd: note: …`; a library user sees a warning of this type)."""


class FedsdError(Exception):
    """An error fedsd raised on purpose."""


class UserError(FedsdError):
    """What the user can fix: the message names the option, file or budget, and what is allowed."""


class ConfigError(UserError, ValueError):
    """A setting that is not allowed; the message names the option and what is allowed."""


class BudgetError(UserError, ValueError):
    """A planned run that cannot fit its privacy budget."""


class BudgetRefused(UserError, ValueError):
    """A data holder's lifetime budget does not admit what a run asks for; nothing was spent."""


class LedgerSpent(BudgetRefused):
    """What the ledger has spent leaves too little for what a run asks: its message counts what
    was spent (other federations' runs too), so the owner's service tells the server only
    "budget" (fedsd.app.client.handler.ledger_refusals)."""


class StateRolledBack(UserError, RuntimeError):
    """An owner's state folder older than the owner's record of what it spent and joined (a
    restored copy): refused until the owner accepts it (fedsd.privacy.owner_record). The message
    says what was found, the ε a rollback would spend again and the flag that accepts it; it is
    for the owner's log, never the server (which is told only "refused: state")."""


class DataError(UserError, ValueError):
    """A holder's data that cannot be used; the message names the file and the problem."""


class DataNotFoundError(UserError, FileNotFoundError):
    """A built-in data set that is not where fedsd looks; the message says where it looked."""


class OutputExistsError(UserError, FileExistsError):
    """An output folder that holds something already (and no --overwrite)."""


class ResumeError(UserError, ValueError):
    """A --resume folder that is not an unfinished run this code can continue; says why."""


class ModelNotPrivateError(UserError, ValueError):
    """A network with a layer DP-SGD cannot train per sample (BatchNorm, ...)."""


class TrainingDiverged(UserError, ValueError):
    """The loss became non-finite or exploded: the run stops at once, naming the likely
    setting, instead of training on to chance accuracy. Nothing of it is released."""


class StateMismatch(FedsdError, ValueError):
    """A saved TrainState accounted under another mechanism (accountant, σ or q) than the run's."""


class BudgetExhausted(FedsdError, RuntimeError):
    """The next update would spend more than the planned (ε, δ); nothing was trained."""


def moved_from(package: str, module: str, name: str):
    """For a package's module-level __getattr__: fedsd 0.1's module `package` became a package in
    0.2 and its names moved to `module`; an old `from package import name` fails naming where
    `name` is now (ImportError, which `from … import` passes on as it is). A submodule or a name
    the old module never had is an ordinary AttributeError."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is None:
        if hasattr(importlib.import_module(module), name):
            raise ImportError(f"{package}.{name}: {package} is a package since fedsd 0.2, and {name} is in {module} "
                              f"(from {module} import {name}; docs/architecture.md)", name=name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
