"""Privacy accounting: a run's calibration and accountant (accounting), an owner's
lifetime ledger (lifetime_ledger), the secret randomness noise is drawn from (secret_random) and a
one-run canary audit (canary_audit)."""
