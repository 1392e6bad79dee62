"""Each setting declared once: a dataclass field whose metadata holds its command-line flag,
its key in the flat form (Flower's run config, a round's ConfigRecord, a checkpoint), its
allowed values and one line of help. Its type comes from the annotation and its default from
the field. The command-line options and the flat form are derived from those declarations, so
a run's settings do not depend on the door it came through (`fedsd train`, `fedsd simulate`,
`flwr run`, a deployment).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field

from fedsd.errors import ConfigError

# An owner's default secagg-min-clients (its data service's node config): the fewest honest clients it
# assumes in a round, and the largest t of a server's plan it takes (fedsd.settings.federation uses it too).
OWNER_MIN_CLIENTS = 2

# In the flat form (TOML and Flower's records have no None): -1 / "" mean "not set", i.e. the
# paper's value for the data set. Never 0, since α = 0 is a real ablation.
_UNSET = {int: -1, float: -1.0, str: ""}


def declared_only(cls, saved: dict) -> dict:
    """The keys of `saved` that dataclass `cls` declares: settings saved by an older version
    (a run's result.json) read back after a setting was removed; one added since takes its
    default."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in saved.items() if k in names}


def check_choices(obj) -> None:
    """Every declared setting of `obj` with allowed values holds one of them (or is unset):
    ConfigError naming the option, what was given and what is allowed."""
    for s in settings_of(type(obj)):
        value = getattr(obj, s.name)
        if s.choices and value is not None and value not in s.choices:
            raise ConfigError(f"{s.flag}: unknown value {value!r}; choose one of {', '.join(map(str, s.choices))}")


def check_setting(condition: bool, option: str, allowed: str, value) -> None:
    """ConfigError naming the option as the user typed it, what is allowed and what was given."""
    if not condition:
        raise ConfigError(f"{option}: {allowed}, got {value!r}")


def setting(default, help: str, *, choices=None, flag: str | None = None, key: str | None = None,
            default_text: str | None = None, cli: bool = True, resolve=None, source: str = "",
            check: tuple | None = None):
    """A dataclass field declaring one setting. `flag` and `key` default to the field's name in
    kebab case; `default_text` describes a default of None (e.g. the paper's value per data
    set); `cli=False` keeps a setting off the command line (set by the server, or by another
    option).

    A method's setting (fedsd.methods) may say how an unset value is filled in: `resolve` is a
    value, a {data set: value} mapping, or a function of the run's config (its other settings
    resolved), and `source` where that value comes from ("the paper's", "chosen on
    validation"). `check` is (predicate, what is allowed): a set value that fails it is refused
    naming the option."""
    return field(default=default, metadata=dict(help=help, choices=choices, flag=flag, key=key,
                                                 default_text=default_text, cli=cli, resolve=resolve,
                                                 source=source, check=check))


@dataclass(frozen=True)
class Setting:
    name: str
    type: type  # int, float, str or bool
    optional: bool  # None allowed (it means: the paper's value for the data set)
    default: object
    help: str
    choices: tuple | None
    flag: str
    key: str
    default_text: str | None
    cli: bool
    resolve: object = None  # how an unset value is filled in (setting())
    source: str = ""
    check: tuple | None = None


def settings_of(cls) -> list[Setting]:
    """The declared settings of a dataclass, in declaration order (fields without a
    declaration, such as TrainConfig.extra, are not settings)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        typ, optional = _base_type(hints[f.name])
        kebab = f.name.replace("_", "-")
        found.append(Setting(f.name, typ, optional, f.default, meta["help"],
                             tuple(meta["choices"]) if meta["choices"] else None,
                             meta["flag"] or "--" + kebab, meta["key"] or kebab, meta["default_text"], meta["cli"],
                             meta.get("resolve"), meta.get("source", ""), meta.get("check")))
    return found


def _base_type(hint) -> tuple[type, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a setting has one type (or that type | None), got {hint}")
        return rest[0], True
    return hint, False


# -- the command line -------------------------------------------------------------------------
def add_options(parser: argparse.ArgumentParser, cls, *, required: tuple[str, ...] = (),
                skip: tuple[str, ...] = (), only: tuple[str, ...] = (), groups: dict | None = None) -> None:
    """One option per declared setting of `cls` (or only those named), in `groups[name]` (an
    argument group of the parser: where --help lists it) where one is given. An option not given
    stays unset (the dataclass's default applies), so the default is declared in one place."""
    for s in settings_of(cls):
        if not s.cli or s.name in skip or (only and s.name not in only):
            continue
        where = (groups or {}).get(s.name, parser)
        kwargs = dict(dest=s.name, default=argparse.SUPPRESS, help=_help_text(s))
        if s.type is bool:
            where.add_argument(s.flag, action="store_true", **kwargs)
            continue
        metavar = None if s.choices else {int: "N", float: "X"}.get(s.type, s.name.split("_")[-1].upper())
        where.add_argument(s.flag, type=s.type, choices=s.choices, metavar=metavar,
                           required=s.name in required, **kwargs)


def _help_text(s: Setting) -> str:
    text = s.help
    if s.choices:
        text += f"; one of {', '.join(map(str, s.choices))}"
    if s.default is None and s.default_text:
        return f"{text} (default: {s.default_text})"
    if s.type is bool:
        return text
    return f"{text} (default: {s.default!r})" if s.type is str else f"{text} (default: {s.default})"


def from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of `cls` from the options the user gave; the rest keep their defaults."""
    given = {s.name: getattr(args, s.name) for s in settings_of(cls) if hasattr(args, s.name)}
    return cls(**{**given, **overrides})


def given_flat(args: argparse.Namespace, *classes) -> dict:
    """The options the user gave, as flat keys (what `flwr run --run-config` would carry)."""
    return {s.key: getattr(args, s.name) for cls in classes for s in settings_of(cls) if hasattr(args, s.name)}


# -- the flat form ----------------------------------------------------------------------------
def to_flat(*objects) -> dict:
    """Kebab-case keys and plain values (no None) for every declared setting of the objects."""
    flat = {}
    for obj in objects:
        for s in settings_of(type(obj)):
            value = getattr(obj, s.name)
            flat[s.key] = _UNSET[s.type] if value is None else value
    return flat


def from_flat(flat: dict, *classes) -> tuple:
    """Instances of `classes` from a flat dict (a missing key keeps its default; -1 / "" for an
    optional setting means unset). Raises ConfigError naming the key of a value of the wrong
    type."""
    flat = {k.replace("_", "-"): v for k, v in flat.items()}
    out = []
    for cls in classes:
        values = {}
        for s in settings_of(cls):
            if s.key not in flat:
                continue
            value = flat[s.key]
            if s.optional and value in (-1, -1.0, ""):
                value = None
            elif s.type is bool:
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif value is not None:
                try:
                    value = s.type(value)
                except (TypeError, ValueError, OverflowError):  # int(inf) overflows
                    raise ConfigError(f"{s.key}: expects {s.type.__name__}, got {value!r}") from None
                if s.type is float and not math.isfinite(value):  # nan and inf are no setting's value
                    raise ConfigError(f"{s.key}: expects a finite number, got {value!r}")
            values[s.name] = value
        out.append(cls(**values))
    return tuple(out)


def flags_to_keys(message: str, *classes) -> str:
    """An error message about settings, with each `--flag` written as its run-config key: what
    a user of `flwr run --run-config` typed."""
    for cls in classes:
        for s in sorted(settings_of(cls), key=lambda s: -len(s.flag)):  # --tau-s before --tau
            message = message.replace(s.flag + ":", s.key + ":").replace(s.flag + " ", s.key + " ")
    return message


# -- a file of settings (a recipe) ------------------------------------------------------------
def typed_values(given: dict, *classes) -> dict[str, tuple[Setting, object]]:
    """Settings a file gives by key (the flat form's kebab-case key, or the flag's name where it
    differs, e.g. num-clients or clients), each checked as its flag would be: its type (TOML's:
    an int where an int is declared, an int or a float for a float, true or false for a switch;
    no string is read as a number) and its allowed values. Returns {setting name: (the setting,
    its value)}; ConfigError naming the key for an unknown key, a value of the wrong type or
    outside the allowed ones, one setting given twice, or a setting the command line does not
    take (set by the server, or named by another option)."""
    import difflib

    declared = {}
    for cls in classes:
        for s in settings_of(cls):
            declared[s.key] = declared[s.flag.removeprefix("--")] = s
    found: dict[str, tuple[Setting, object]] = {}
    for key, value in given.items():
        s = declared.get(key)
        if s is None:
            close = difflib.get_close_matches(key, declared, n=1)
            raise ConfigError(f"{key}: not a setting" + (f"; did you mean {close[0]}?" if close else "") +
                              " (the settings: fedsd train --help, fedsd simulate --help)")
        if not s.cli:
            raise ConfigError(f"{key}: not given by a command or a recipe ({s.help})")
        if s.name in found:
            raise ConfigError(f"{key}: given twice (as {s.key} and {s.flag.removeprefix('--')})")
        found[s.name] = (s, _typed(key, s, value))
    return found


def _typed(key: str, s: Setting, value):
    """`value` as setting `s` takes it from a file (see typed_values)."""
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}[s.type]
    if not ok:
        expects = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[s.type]
        raise ConfigError(f"{key}: expects {expects}, got {value!r}")
    if s.type is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expects a finite number, got {value!r}")
    if s.choices and value not in s.choices:
        raise ConfigError(f"{key}: unknown value {value!r}; choose one of {', '.join(map(str, s.choices))}")
    return value
