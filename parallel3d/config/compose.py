"""A run's config composed as Hydra composes it: the shipped conf/ and recipes/, the ConfigStore, and
the keys a person set (which a Hugging Face folder in checkpoint.init_from must not override)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parallel3d.config.schema import Config

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _shipped(name: str) -> Path:
    """conf/ or recipes/: inside the installed package (a wheel), else at the top of the checkout."""
    from importlib.resources import files

    packaged = Path(str(files("parallel3d") / name))
    return packaged if packaged.is_dir() else PROJECT_ROOT / name


CONF_DIR = _shipped("conf")
RECIPES_DIR = _shipped("recipes")


# What the last register_configs stored: (the recipe files' state it read, the broken ones, the store).
_registered: tuple[tuple, dict[str, str], object] | None = None


def _recipe_files_state(dirs: list[Path]) -> tuple | None:
    """Every recipe file's name and bytes, folder by folder: all that decides what load_recipes
    reads (contents, not modification times: a file rewritten within the clock's tick counts);
    None where a folder is missing (load_recipes then raises, naming it)."""
    if not all(d.is_dir() for d in dirs):
        return None
    return tuple((str(d), tuple((p.name, p.read_bytes()) for p in sorted(d.glob("*.yaml")))) for d in dirs)


def register_configs(overrides: list[str] | tuple[str, ...] = ()) -> None:
    """Put the schema and every readable recipe into Hydra's ConfigStore (idempotent). A broken
    recipe file fails only when ``overrides`` select it (config/strict.py: RecipeError, naming it).
    Recipe files unchanged since the last call are not read and stored again: a process that
    composes many configs (tests, the planner's searches) pays for parsing them once."""
    global _registered
    from hydra.core.config_store import ConfigStore

    from parallel3d.config.strict import load_recipes, recipe_dirs, refuse_broken

    cs = ConfigStore.instance()
    dirs = recipe_dirs(RECIPES_DIR)
    state = _recipe_files_state(dirs)
    if state is None or _registered is None or _registered[0] != state or _registered[2] is not cs:
        cs.store(name="schema", node=Config)
        recipes, broken = load_recipes(dirs)
        for name, node in recipes.items():
            cs.store(group="recipe", name=name, node=node, package="_global_")
        _registered = (state, broken, cs)
    refuse_broken(_registered[1], list(overrides))


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose the config as ``python -m parallel3d.train OVERRIDES`` would, outside a run.

    Used by the launcher (validate once before starting torchrun) and by tests.
    Raises Hydra's and OmegaConf's own errors for unknown keys or wrong types.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from parallel3d.config.hf_folder import apply_hf_folder

    register_configs(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    return apply_hf_folder(cfg, user_set_keys(overrides))


def user_set_keys(overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The ``model.*`` and ``data.tokenizer`` keys a person set: on the command line (``model``
    alone for a model group chosen there) or in the selected recipe's own values. A group default
    (conf/config.yaml, a recipe's ``defaults``) is a starting point, not a choice: a Hugging Face
    folder in ``checkpoint.init_from`` replaces it (hf_folder.apply_hf_folder)."""
    from omegaconf import OmegaConf

    from parallel3d.config.strict import recipe_dirs, selected_recipe

    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o or o.startswith("~")}
    recipe = selected_recipe(list(overrides))
    path = next((d / f"{recipe}.yaml" for d in recipe_dirs(RECIPES_DIR) if (d / f"{recipe}.yaml").is_file()), None)
    if path is not None:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        keys |= {f"model.{key}" for key in _dotted(node.get("model") or {})}
        keys |= {"data.tokenizer"} if "tokenizer" in (node.get("data") or {}) else set()
    return {key for key in keys if key == "model" or key.startswith("model.") or key == "data.tokenizer"}


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    return [k for key, value in tree.items()
            for k in (_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"])]
