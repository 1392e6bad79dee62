"""The networks (networks), weights from a file and what is trained (pretrained), and a
released model loaded back (released)."""


def __getattr__(name):  # fedsd 0.1's fedsd.models module: its names are in fedsd.models.networks now
    from fedsd.errors import moved_from

    moved_from(__name__, "fedsd.models.networks", name)
