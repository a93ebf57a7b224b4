"""Keys outside the schema, and the recipe files: one broken file breaks only the run naming it.

Hydra applies ``+key=value`` with the struct flag lifted, so ``+train.stepz=10`` adds a key the
schema does not have and nothing reads: ``unknown_keys`` finds such keys after composition
(validate.check refuses them). Recipes are read one file at a time (``load_recipes``): a file that
does not parse is remembered with its error, and only a run that selects it fails, naming the file.

Recipes kept outside the repository: ``PARALLEL3D_RECIPES=DIR[:DIR...]`` (``parallel3d-run
--recipes-dir DIR`` sets it for its workers); a file there wins over a packaged one of the same name.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path

from omegaconf import OmegaConf

RECIPES_ENV = "PARALLEL3D_RECIPES"


class RecipeError(ValueError):
    """A recipe file that cannot be read; raised only for a run that selects it."""


def _dataclass_of(hint) -> type | None:
    """The dataclass a field's type names (unwrapping Optional), or None."""
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def unknown_keys(tree: dict, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``tree`` (a plain, unresolved container) that ``schema`` has no field for."""
    hints = typing.get_type_hints(schema)
    found = []
    for key, value in tree.items():
        if key not in hints:
            found.append(f"{prefix}{key}")
            continue
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, dict):
            found += unknown_keys(value, sub, f"{prefix}{key}.")
    return found


def closest_key(key: str, tree_schema: type) -> str | None:
    """The schema key nearest to a misspelled one (same section), for the fix."""
    section, _, name = key.rpartition(".")
    schema = tree_schema
    for part in filter(None, section.split(".")):
        schema = _dataclass_of(typing.get_type_hints(schema).get(part)) or schema
    match = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(schema)], n=1)
    return f"{section + '.' if section else ''}{match[0]}" if match else None


def recipe_dirs(packaged: Path) -> list[Path]:
    """Where recipes are read from: PARALLEL3D_RECIPES's folders first, then the packaged ones."""
    extra = [Path(p).expanduser() for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p]
    return [*extra, packaged]


def load_recipes(dirs: list[Path]) -> tuple[dict[str, object], dict[str, str]]:
    """(name -> config node, name -> error) for every recipe file; an earlier folder wins a name."""
    nodes, broken = {}, {}
    for folder in reversed(dirs):
        if not folder.is_dir():
            raise RecipeError(f"{RECIPES_ENV}: {folder} is not a folder. Fix: point it at a folder of recipe "
                              f"YAML files")
        for path in sorted(folder.glob("*.yaml")):
            try:
                node = OmegaConf.load(path)
                if not isinstance(node, dict) and not OmegaConf.is_dict(node):
                    raise ValueError("not a mapping of keys")
                nodes[path.stem] = node
                broken.pop(path.stem, None)
            except Exception as e:  # any parse error: kept for the run that selects this recipe
                broken[path.stem] = f"{path}: {' '.join(str(e).split())}"
                nodes.pop(path.stem, None)
    return nodes, broken


def selected_recipe(overrides: list[str], default: str = "tiny_cpu") -> str:
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "recipe"]
    return given[-1] if given else default


def refuse_broken(broken: dict[str, str], overrides: list[str]) -> None:
    name = selected_recipe(overrides)
    if name in broken:
        raise RecipeError(f"recipe={name}: {broken[name]}. Fix: correct that YAML file")
