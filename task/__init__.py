"""`task` moved into the one package `fedsd` (fedsd 0.2, docs/architecture.md).

Not installed: this folder only answers an old import from a checkout with the new place."""
_MOVED = """
    task                                          -> fedsd.app
    task.partition                                -> fedsd.app.partition
    task.records                                  -> fedsd.app.records
    task.secure_sum                               -> fedsd.app.secure_sum
    task.simulated_shards                         -> fedsd.app.simulated_shards
"""
raise ImportError("`task` is now `fedsd.app`: every module of it moved into the package fedsd. Old name -> new name:"
                  + _MOVED + "(docs/architecture.md)")
