"""The parser every `fedsd` command is read with."""
from __future__ import annotations

import argparse
import difflib
import re


class Parser(argparse.ArgumentParser):
    """argparse, stricter and shorter: no abbreviated options (`--verbos` is not taken for
    `--verbose`), and a bad option or value answered in one line, with the nearest allowed one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = ""
        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            close = difflib.get_close_matches(m.group(1), [c.strip(" '") for c in m.group(2).split(",")], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        elif m := re.search(r"unrecognized arguments: (--[\w-]+)", message):
            options = [o for action in self._actions for o in action.option_strings]
            close = difflib.get_close_matches(m.group(1), options, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (all options: {self.prog} --help)\n")
