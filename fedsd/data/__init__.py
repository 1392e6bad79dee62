"""Data sets (datasets), a data holder's own files (client_data) and features computed once
per data set: ScatterNet's and a frozen pretrained backbone's (features)."""


def __getattr__(name):  # fedsd 0.1's fedsd.data module: its names are in fedsd.data.datasets now
    from fedsd.errors import moved_from

    moved_from(__name__, "fedsd.data.datasets", name)
