"""Keys outside the schema, broken and external recipe files, Hydra's whole reason in one line."""

from __future__ import annotations

import pytest

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.config.strict import RECIPES_ENV, RecipeError
from parallel3d.launch.run import first_config_error, take_recipes_dir
from parallel3d.validate import check


@pytest.mark.fast
def test_a_key_added_with_plus_is_refused_with_the_nearest_key():
    with pytest.raises(ConfigError, match=r"^train.stepz=10: not a key of the config schema. Fix: use train.steps.$"):
        check(compose(["+train.stepz=10"]), 1)
    with pytest.raises(ConfigError, match="^wandb_project=x"):
        check(compose(["+wandb_project=x"]), 1)
    check(compose(["+slurm.env.NCCL_DEBUG=INFO"]), 1)  # a free-form map takes any key


def test_parallel3d_run_shows_hydras_whole_reason():
    error = first_config_error(["train.stepz=10"], [1])
    assert "Key 'stepz' not in 'TrainConfig'" in error and "\n" not in error


def test_a_broken_recipe_breaks_only_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "broken.yaml").write_text("train:\n  steps: [\n")
    (tmp_path / "mine.yaml").write_text("# @package _global_\ntrain:\n  steps: 7\nrecipe: mine\n")
    argv = take_recipes_dir(["--recipes-dir", str(tmp_path), "--nproc-per-node=1", "recipe=mine"])
    assert argv == ["--nproc-per-node=1", "recipe=mine"]
    monkeypatch.setenv(RECIPES_ENV, str(tmp_path))  # what take_recipes_dir exported, undone after the test
    assert compose(["recipe=mine"]).train.steps == 7
    assert compose(["recipe=tiny_cpu"]).recipe == "tiny_cpu"
    with pytest.raises(RecipeError, match=f"^recipe=broken: {tmp_path / 'broken.yaml'}: .*Fix: correct that YAML"):
        compose(["recipe=broken"])
    assert first_config_error(["recipe=broken"], [1]).startswith(f"recipe=broken: {tmp_path / 'broken.yaml'}")


def test_a_recipe_edited_between_two_composes_is_read_again(tmp_path, monkeypatch):
    """compose() parses the recipe files once per process while they stay the same
    (config/compose.py): an edit, a new file and a repaired one are seen by the next compose."""
    (tmp_path / "mine.yaml").write_text("# @package _global_\ntrain:\n  steps: 7\nrecipe: mine\n")
    (tmp_path / "broken.yaml").write_text("train:\n  steps: [\n")
    monkeypatch.setenv(RECIPES_ENV, str(tmp_path))
    assert compose(["recipe=mine"]).train.steps == 7
    (tmp_path / "mine.yaml").write_text("# @package _global_\ntrain:\n  steps: 9\nrecipe: mine\n")
    (tmp_path / "other.yaml").write_text("# @package _global_\ntrain:\n  steps: 5\nrecipe: other\n")
    (tmp_path / "broken.yaml").write_text("# @package _global_\ntrain:\n  steps: 3\nrecipe: broken\n")
    assert compose(["recipe=mine"]).train.steps == 9
    assert compose(["recipe=other"]).train.steps == 5
    assert compose(["recipe=broken"]).train.steps == 3
