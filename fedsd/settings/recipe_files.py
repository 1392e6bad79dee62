"""The validated recipes, one TOML file a recipe in fedsd/recipes/ (package data): read for
`fedsd recipes`, and given to a command's options by `--recipe NAME` (`fedsd train`, `fedsd
simulate`, deploy-local).

A recipe holds settings only, each under its key in Flower's run config (pyproject.toml's
[tool.flwr.app.config]: the flag's name without its dashes), read as its flag is
(fedsd.settings.declared.typed_values). Its first comment line says what it is, and a comment
line `# validated: …` where it was validated (a results file and its row). Flags given on the
command line take the place of the recipe's values; a bad key or value is refused naming the
file and the key, before any work starts."""
from __future__ import annotations

import argparse
import difflib
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedsd.errors import ConfigError
from fedsd.settings.declared import Setting, settings_of, typed_values
from fedsd.settings.federation import FedConfig
from fedsd.settings.run import TrainConfig, renamed_keys

# The recipes are package data (pyproject.toml), so an installed wheel has them as a checkout does.
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
VALIDATED = "validated:"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    values: dict  # setting name -> (Setting, value)
    about: str  # the first comment line
    validated: str  # the `# validated: …` line

    @property
    def federated(self) -> list[str]:
        """The keys of a federation's settings (FedConfig) the recipe gives."""
        fed = {s.name for s in settings_of(FedConfig)}
        return [s.key for name, (s, _) in self.values.items() if name in fed]

    @property
    def command(self) -> str:
        return "simulate" if self.federated else "train"


def recipes_dir() -> Path:
    """The recipes folder; ConfigError saying where it looked when there is none (an install
    that is not a checkout of the repository)."""
    if not RECIPES_DIR.is_dir():
        raise ConfigError(f"no recipes folder at {RECIPES_DIR}: this installation of fedsd lacks its package data "
                          f"(fedsd/recipes/); give --recipe the path of a .toml file")
    return RECIPES_DIR


def recipe_path(name: str) -> Path:
    """The file --recipe NAME names: a path to a .toml, or NAME.toml in the recipes folder."""
    if name.endswith(".toml") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"--recipe {name}: no such file")
        return path
    folder = recipes_dir()
    path = folder / f"{name}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.toml"))
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(f"--recipe {name}: no recipe {path}" + (f"; did you mean {close[0]}?" if close else "") +
                          " (the recipes: fedsd recipes)")
    return path


def read_recipe(path: Path) -> Recipe:
    """A recipe file, every key and value checked; ConfigError naming the file (and the key)."""
    text = path.read_text()
    try:
        given = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not a TOML file: {e}") from None
    for key, value in given.items():
        if isinstance(value, dict):
            raise ConfigError(f"{path}: [{key}]: a recipe holds settings only, each as key = value, no tables")
    try:
        values = typed_values(renamed_keys(given), TrainConfig, FedConfig)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    if "resume_dir" in values:
        raise ConfigError(f"{path}: {values['resume_dir'][0].key}: a recipe starts a run; --resume DIR goes on "
                          "with one")
    comments = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    validated = next((c[len(VALIDATED):].strip() for c in comments if c.startswith(VALIDATED)), "")
    about = next((c for c in comments if c and not c.startswith(VALIDATED)), "")
    return Recipe(path.stem, path, values, about, validated)


def every_recipe() -> list[Recipe]:
    return [read_recipe(p) for p in sorted(recipes_dir().glob("*.toml"), key=lambda p: p.stem)]  # by name


def with_recipe(args: argparse.Namespace, command: str) -> Recipe | None:
    """Give `args` the values of the recipe --recipe names where the command line gave none
    (a flag given takes the recipe's place); None without --recipe."""
    if not getattr(args, "recipe", None):
        return None
    if getattr(args, "resume", None) or getattr(args, "resume_dir", None):
        raise ConfigError("--recipe starts a run; --resume DIR goes on with one, with its own saved settings: "
                          "give one of them")
    recipe = read_recipe(recipe_path(args.recipe))
    if command == "train" and recipe.federated:
        raise ConfigError(f"{recipe.path}: {', '.join(recipe.federated)}: a federation's settings; fedsd train "
                          f"runs one party's training (run this recipe with fedsd simulate --recipe {args.recipe})")
    args.from_recipe = {}
    for name, (s, value) in recipe.values.items():
        if not hasattr(args, name):
            setattr(args, name, value)
            args.from_recipe[name] = s
    return recipe


@contextmanager
def blamed_on(recipe: Recipe | None, args: argparse.Namespace):
    """A ConfigError about a setting the recipe gave (one its checks refuse: a value out of range, one
    that does not fit the data or the other settings) names the file and the key."""
    try:
        yield
    except ConfigError as e:
        if recipe is None:
            raise
        message = str(e)
        given: dict[str, Setting] = getattr(args, "from_recipe", {})
        for s in sorted(given.values(), key=lambda s: -len(s.flag)):  # --tau-s before --tau
            for sep in (": ", " "):
                if message.startswith(s.flag + sep):
                    raise ConfigError(f"{recipe.path}: {s.key}{sep}{message[len(s.flag) + len(sep):]}") from None
        raise


def add_recipe_option(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--recipe", metavar="NAME", default=None,
                   help="take the settings of a validated recipe (fedsd recipes lists them): NAME in the "
                        "fedsd/recipes/ (fedsd recipes lists them), or the path of a .toml file; "
                        "the flags given take the place "
                        "of its values" + (" (a recipe with a federation's settings runs with fedsd simulate)"
                                            if command == "train" else ""))


