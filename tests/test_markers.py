"""``-m "not multirank"`` starts no torchrun job and no rank processes: tests/harness/process_guard.py fails an
unmarked test that tries (through torchrun, mp.spawn or multiprocessing), and lets one process be."""

from __future__ import annotations

import ast
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import multiprocessing, subprocess, sys, time
import pytest
import torch.multiprocessing as mp

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "no_such.py"]


def test_unmarked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)


def test_unmarked_starts_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.multirank
def test_marked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)


def _rank(rank, seconds=60):
    time.sleep(seconds)  # waiting for its peers, as a rank at its rendezvous does


def test_unmarked_starts_ranks_through_multiprocessing():
    ranks = [multiprocessing.get_context("fork").Process(target=_rank, args=(r,)) for r in range(2)]
    for rank in ranks:
        rank.start()


def test_unmarked_starts_ranks_through_mp_spawn():
    mp.start_processes(_rank, nprocs=2, start_method="fork")


def test_unmarked_forks_one_process():
    one = multiprocessing.get_context("fork").Process(target=_rank, args=(0, 0))
    one.start()
    one.join()
    assert one.exitcode == 0
'''


def test_an_unmarked_test_that_starts_torchrun_or_ranks_fails_under_not_multirank(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")  # the suite's conftest and its harness
    shutil.copytree(TESTS / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multirank: several ranks\n")
    environ = {key: value for key, value in os.environ.items() if key != "P3D_TEST_CPU_LOG"}  # not the sample's
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA",
                           "-m", "not multirank", "test_sample.py"], capture_output=True, text=True, cwd=tmp_path, env=environ,
                          timeout=120)
    out = done.stdout
    assert "3 failed, 2 passed, 1 deselected" in out, out
    for test in ("starts_torchrun", "starts_ranks_through_multiprocessing", "starts_ranks_through_mp_spawn"):
        assert f"FAILED test_sample.py::test_unmarked_{test}" in out, out
    assert "not marked multirank but starts torchrun" in out, out
    assert out.count("not marked multirank but starts rank processes") >= 2, out  # one per test, repeated by -rA


@pytest.mark.fast
def test_no_test_skips_for_a_missing_dev_dependency():
    """pyproject's dev extra is what CI installs: a test that needs one of its packages imports it, so
    that a package missing fails the test instead of skipping it green (pytest.importorskip)."""
    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]
    dev = {re.split(r"[<>=!~\[ ;]", spec)[0].lower().replace("-", "_") for spec in project["optional-dependencies"]["dev"]}
    skipping = [f"{path.name}:{node.lineno} importorskip({node.args[0].value!r})"
                for path in sorted(TESTS.glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value.split(".")[0] in dev]
    assert not skipping, f"a dev dependency is imported, not skipped for: {skipping}"


# -- the fast tier: python -m pytest -m fast ---------------------------------------------------

PACKAGE = TESTS.parent / "parallel3d"


@functools.cache
def module_names() -> dict[str, Path]:
    """parallel3d's modules by dotted name (a package by its own name: its __init__.py)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def source_of(node: ast.ImportFrom, package: str) -> str:
    """The module an ``import from`` reads (relative ones from ``package``)."""
    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
    return ".".join(filter(None, [base, node.module]))


def imports_of(tree: ast.AST, package: str, *, top_level: bool) -> set[str]:
    """The parallel3d modules ``tree`` imports (``package``: where its relative imports start); a
    name imported from a package counts as the module it is, or the one the package re-exports
    it from. ``top_level``: only the imports that run when the module loads."""
    modules, found = module_names(), set()
    for node in (tree.body if top_level else ast.walk(tree)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and (source := source_of(node, package)) in modules:
            found.add(source)
            found |= {f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else
                      re_exported(source).get(alias.name, source) for alias in node.names}
    return found


def re_exported(package: str) -> dict[str, str]:
    """name -> module, for the names a package's __init__.py imports from its own modules."""
    modules, path = module_names(), module_names()[package]
    if path.name != "__init__.py":
        return {}
    return {alias.asname or alias.name: source for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.ImportFrom) and (source := source_of(node, package)) in modules
            for alias in node.names}


def marks_of(node: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).split("(")[0].removeprefix("pytest.mark.") for d in node.decorator_list}


@pytest.mark.fast
def test_the_fast_tier_loads_every_module_and_starts_no_ranks():
    """Every parallel3d module is loaded by a test file with fast tests: imported there, or imported
    when a module it imports loads (top-level imports, followed), so -m fast touches all of the
    package. And no fast test is multirank: the tier runs in-process (tests/harness/process_guard.py
    fails a test that starts ranks under -m fast)."""
    modules, direct, multirank = module_names(), set(), []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
        fast = [node for node in tests if "fast" in marks_of(node)]
        if fast:
            direct |= imports_of(tree, "tests", top_level=False)
            in_file = any("multirank" in ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign)
                          and ast.unparse(n.targets[0]) == "pytestmark")
            multirank += [f"{path.name}::{n.name}" for n in fast if in_file or "multirank" in marks_of(n)]
    loaded, todo = set(), list(direct)
    while todo:
        name = todo.pop()
        if name not in loaded:
            loaded.add(name)
            path = modules[name]
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            todo += imports_of(ast.parse(path.read_text()), package, top_level=True)
            todo += [parent for parent in [name.rpartition(".")[0]] if parent in modules]
    assert not multirank, f"fast tests must run in-process, these are multirank: {multirank}"
    missing = sorted(set(modules) - loaded)
    assert not missing, (f"no file with fast tests loads {missing}: mark a cheap in-process test of each "
                         "@pytest.mark.fast (README's Tests section: the fast tier)")
