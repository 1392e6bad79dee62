"""Privacy accounting: a run's calibration and accountant (accounting), an owner's
lifetime ledger (lifetime_ledger) and its record outside the state folder (owner_record), the
secret randomness noise is drawn from (secret_random) and a one-run canary audit (canary_audit)."""


def __getattr__(name):  # fedsd 0.1's fedsd.privacy module: its names are in fedsd.privacy.accounting now
    from fedsd.errors import moved_from

    moved_from(__name__, "fedsd.privacy.accounting", name)
