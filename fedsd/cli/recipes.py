"""`fedsd recipes`: the validated recipes (fedsd.settings.recipe_files), one line each."""
from __future__ import annotations

from fedsd.settings.recipe_files import every_recipe, recipes_dir


def cmd_recipes(args) -> int:
    recipes = every_recipe()
    print(f"{len(recipes)} recipes in {recipes_dir()} (fedsd train --recipe NAME, or fedsd simulate --recipe NAME "
          f"for a federation's):")
    width = max((len(r.name) for r in recipes), default=0) + 2
    for r in recipes:
        print(f"  {r.name.ljust(width)}{r.command.ljust(10)}{r.about}; validated: {r.validated or '(not said)'}")
    return 0


def add_recipes_parser(sub) -> None:
    p = sub.add_parser("recipes", help="the validated recipes, one line each: name, command, what it is, where it "
                                       "was validated")
    p.set_defaults(func=cmd_recipes)

