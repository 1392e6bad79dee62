"""Opacus, imported the first time for fedsd, without the root-logger handler it installs.

`opacus.utils.module_utils` calls `logging.basicConfig` when it is imported, which gives the
root logger a handler of its own. Every library logger that propagates (Flower's) then prints
each line twice: once in its own format and once more with a timestamp. Configuring the root
logger is the application's business, so a handler Opacus added is taken off again.
"""
import logging

_root = logging.getLogger()
_before = list(_root.handlers)
import opacus.utils.module_utils  # noqa: E402,F401  (the import that calls basicConfig)

for _handler in [h for h in _root.handlers if h not in _before]:
    _root.removeHandler(_handler)
