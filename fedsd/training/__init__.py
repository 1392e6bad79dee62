"""The one DP training loop (loop) and central training (central), physical batches,
seeds, callbacks, TensorBoard logs and what a finished run says (summary)."""


def __getattr__(name):  # fedsd 0.1's fedsd.training module: its names are in fedsd.training.loop now
    from fedsd.errors import moved_from

    moved_from(__name__, "fedsd.training.loop", name)
