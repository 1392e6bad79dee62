"""`FEDSD_DRY_RUN=1`: a command checks everything it checks before its first step (every option,
the data, every σ and budget, the result folder), says what it would run, and stops there,
having written nothing. The README's commands run this way in a test, exactly as written
(tests/project/test_readme.py), so the README cannot drift from what the commands accept."""
from __future__ import annotations

import os

ENV = "FEDSD_DRY_RUN"


class DryRun(Exception):
    """Raised where a command's work would begin; the message says what that work is."""


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def stop_here(what: str) -> None:
    """The point of no return: under a dry run, stop with `what` instead of going on."""
    if requested():
        raise DryRun(what)
