"""Every setting declared once (declared: the machinery), a run's settings (run) and a
federation's (federation)."""


def __getattr__(name):  # fedsd 0.1's fedsd.settings module: its names are in fedsd.settings.declared now
    from fedsd.errors import moved_from

    moved_from(__name__, "fedsd.settings.declared", name)
