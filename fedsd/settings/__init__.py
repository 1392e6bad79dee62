"""Every setting declared once (declared: the machinery), a run's settings (run) and a
federation's (federation)."""
