"""The package's shape, read from its source with ``ast``: no import cycles between modules (any
import, those inside functions included), the wings (folders by job, and the few root modules)
importing only downwards in the order docs/architecture.md gives, a package root of at most eight
modules, no ``name_suffix.py`` family beside ``name.py`` (a family is a folder), and no function
over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import parallel3d

PACKAGE = Path(parallel3d.__file__).resolve().parent
MAX_FUNCTION_LINES = 60
MAX_ROOT_MODULES = 8
ENTRY_POINTS = ("parallel3d.train", "parallel3d.launch", "parallel3d.cli")
# The floors, ground first (docs/architecture.md): a wing imports only wings below it. A root
# module is a wing of its own.
WINGS = ("base", "progress", "data", "config", "models", "optim", "parallel", "hf", "checkpoint", "runtime",
         "step", "observe", "validate", "planner", "inference", "ft", "launch", "cli", "train")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    """Every dotted name an import statement may refer to (``from a import b``: a and a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: drop the module (or package) name and node.level - 1 parents
        base = module.split(".")[: len(module.split(".")) - node.level + is_package]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a parent package's own __init__ not counted)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(module, node, path.name == "__init__.py"):
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.fast
def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_library_modules_never_import_the_entry_points():
    upward = [f"{module} imports {target}" for module, targets in import_graph().items()
              if not module.startswith(ENTRY_POINTS) for target in targets if target.startswith(ENTRY_POINTS)]
    assert upward == []


@pytest.mark.fast
def test_no_function_over_60_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def wing_of(module: str) -> str:
    """``parallel3d.checkpoint.resume`` -> ``checkpoint``; a root module is its own wing."""
    return module.split(".")[1] if "." in module else module


def wing_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module == "parallel3d":
            continue
        graph.setdefault(wing_of(module), set()).update(
            wing_of(t) for t in targets if t != "parallel3d" and wing_of(t) != wing_of(module))
    return graph


def test_every_wing_has_a_floor():
    assert set(wing_graph()) - set(WINGS) == set(), "add the new wing to WINGS and docs/architecture.md"


@pytest.mark.fast
def test_wings_import_only_downwards():
    floor = {wing: i for i, wing in enumerate(WINGS)}
    upward = [f"{wing} imports {target}" for wing, targets in wing_graph().items() for target in targets
              if floor.get(target, -1) > floor.get(wing, len(WINGS))]
    assert upward == []


def test_the_package_root_keeps_at_most_eight_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_module_family_lies_beside_its_name():
    """``checkpoint.py`` beside ``checkpoint_checks.py``: the family belongs in a folder."""
    families = []
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.glob("*/__init__.py"))]:
        names = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        families += [f"{folder.name}/{other}.py beside {name}" for name in names for other in names
                     if other.startswith(name + "_")]
    assert families == []



# What a run imports only when it uses it: each is a second or so of CPU on every rank of every job
# (tools/bench_import.py measures the import; BENCHMARKS (p)).
IMPORTED_WHEN_USED = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                      "torch.distributed.pipelining", "torch._dynamo", "transformers", "datasets", "pyarrow",
                      "wandb", "tensorboard", "torchft", "torchao", "lm_eval", "peft", "jinja2", "tokenizers")


def test_importing_the_trainer_loads_nothing_a_run_may_not_use():
    """``import parallel3d.train`` (what every rank does first) leaves DTensor, FSDP, DCP, torch's
    pipelining and compiler, and the optional libraries to the runs that use them."""
    import json
    import subprocess
    import sys

    code = f"import json, sys; import parallel3d.train; print(json.dumps([m for m in {IMPORTED_WHEN_USED!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []


MAX_MODULE_LINES = 400


def test_no_module_over_400_lines():
    """A module a reader takes in at once: a longer one is split along a seam (one job per module)."""
    long = [f"{p.relative_to(PACKAGE.parent)} ({n} lines)" for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []
