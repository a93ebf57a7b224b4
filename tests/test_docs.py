"""The manual quotes what the code prints and lists what the repository holds: these tests keep
the two equal. Texts the code writes (the sbatch script, the banner, config errors) are rendered
by the code itself and compared with the fenced blocks in README.md and docs/; lists (pages,
recipes, config options, paths) are compared with the files. No process group, no training."""

from __future__ import annotations

import importlib
import re
import runpy
import shlex
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallel3d.base import RunError, resolve_device
from parallel3d.checkpoint.commit import META
from parallel3d.checkpoint.resume import check_not_past_end
from parallel3d.config.compose import compose
from parallel3d.launch.run import first_config_error
from parallel3d.launch.slurm import script_for
from parallel3d.parallel.mesh import ParallelDims
from parallel3d.runtime.failures import report_failure
from parallel3d.observe.banner import banner
from parallel3d.validate import check

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def fenced_blocks(text: str) -> list[str]:
    """The contents of every fenced code block, without the fences."""
    return re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.S | re.M)


def test_launch_md_shows_the_script_parallel3d_slurm_writes():
    """docs/launch.md's SLURM command and the script it shows for it, as parallel3d-slurm
    --dry-run writes it (the job starting in /home/me/parallel3d, the doc's --chdir)."""
    blocks = fenced_blocks((DOCS / "launch.md").read_text())
    (command,) = [b for b in blocks if b.startswith("parallel3d-slurm ")]
    argv = shlex.split(command.replace("\\\n", " "), comments=True)[1:]
    (shown,) = [b for b in blocks if b.startswith("#!/bin/bash\n# Written by parallel3d-slurm")]
    _, script = script_for(argv, workdir=Path("/home/me/parallel3d"))
    assert shown == script


def test_readme_banner_is_what_a_run_of_the_default_recipe_prints():
    """The first line of the README's sample run: observe.banner for the default recipe on one rank,
    with the run_dir the sample shows."""
    (sample,) = [b for b in fenced_blocks(README.read_text()) if b.startswith("parallel3d | ")]
    shown = sample.splitlines()[0]
    run_dir = Path(shown.rsplit(" run_dir ", 1)[1])
    c = OmegaConf.to_object(check(compose([f"run_dir={run_dir}"]), 1))
    line = banner(c, ParallelDims.from_config(c.parallel), resolve_device(c.train.device, "cpu"), 1, run_dir)
    assert shown == line


def run_documented_command(command: str, capsys, monkeypatch) -> str:
    """What ``command`` (``python tools/X.py ...`` or a console script of pyproject.toml) prints,
    run in this process (its imports are paid already)."""
    argv = shlex.split(command)
    if argv[0] == "python":
        monkeypatch.setattr(sys, "argv", [str(ROOT / argv[1]), *argv[2:]])
        run = partial(runpy.run_path, str(ROOT / argv[1]), run_name="__main__")
    else:
        import tomllib  # Python 3.11+, as tests/test_packaging.py

        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        module, function = scripts[argv[0]].split(":")
        monkeypatch.setattr(sys, "argv", argv)
        run = getattr(importlib.import_module(module), function)
    try:
        returned = run()
        code = None if argv[0] == "python" else returned  # run_path returns the script's globals
    except SystemExit as e:
        code = e.code
    # None or 0 only: SystemExit("text") is an exit with status 1 that printed its text.
    assert code in (None, 0), f"{command} exited with {code!r}"
    return capsys.readouterr().out


def test_a_documented_command_that_exits_with_a_message_fails(tmp_path, capsys, monkeypatch):
    """sys.exit("text") is exit status 1: the manual's commands must not end that way and pass."""
    script = tmp_path / "refuses.py"
    script.write_text('import sys\nsys.exit("refused: and so exit status 1")\n')
    with pytest.raises(AssertionError, match="exited with 'refused: and so exit status 1'"):
        run_documented_command(f"python {script}", capsys, monkeypatch)


# planner.md's examples that take seconds; the 64-GPU searches rank many more layouts and are
# checked by hand when the planner changes.
PLANNER_EXAMPLES = ["--world-size 64", "--gpus 8 "]


@pytest.mark.parametrize("example", PLANNER_EXAMPLES)
def test_planner_md_shows_what_the_planner_prints(example, capsys, monkeypatch):
    blocks = [b for b in fenced_blocks((DOCS / "planner.md").read_text()) if b.startswith("$ ") and example in b]
    (block,) = blocks
    command, shown = block.split("\n", 1)
    assert run_documented_command(command[2:], capsys, monkeypatch) == shown


def quoted_config_errors() -> list[tuple[str, list[str], int, str]]:
    """(page, overrides, ranks, message) for every ``$ parallel3d-run --nproc-per-node N ...`` in docs/
    followed by the ``parallel3d: config error: ...`` line it prints."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        pattern = r"^\$ parallel3d-run --nproc-per-node (\d+) (.*)\nparallel3d: config error: (.*)$"
        for ranks, overrides, message in re.findall(pattern, page.read_text(), flags=re.M):
            found.append((page.name, shlex.split(overrides), int(ranks), message))
    return found


def test_docs_quote_at_least_one_config_error():
    assert quoted_config_errors()  # the pattern below still finds what configuration.md shows


@pytest.mark.parametrize("page, overrides, ranks, message", quoted_config_errors())
def test_quoted_config_error_is_what_validation_prints(page, overrides, ranks, message):
    assert first_config_error(overrides, [ranks]) == message, page


# A bad config for each row of troubleshooting.md's table of config errors, by the key the row
# starts with: (overrides, ranks). Rows that need files on disk or a Hydra sweep are in
# NOT_RENDERED, with the test that covers their message.
TROUBLESHOOTING_CASES = {
    "parallel.dp_shard": (["parallel.dp_shard=3"], 4),
    "train.global_batch_size": (["train.global_batch_size=3", "parallel=ddp"], 2),
    "parallel.tp": (["parallel.tp=3"], 3),
    "parallel.pp_microbatches": (["parallel.pp=2", "parallel.pp_schedule=1F1B", "train.global_batch_size=2",
                                  "train.micro_batch_size=2"], 2),
    "model.compile": (["model.compile=true", "parallel.tp=2"], 2),
    "model.vocab_size": (["model.vocab_size=10"], 1),
    "train.device": (["train.device=cuda"], 1),
}
NOT_RENDERED = {
    "checkpoint.resume": "a checkpoint on disk: tests/test_resume.py",
    "--multirun": "Hydra's multirun under torchrun: tests/test_launch_sweep.py",
}


def troubleshooting_rows() -> dict[str, str]:
    """{key: the message's start, as a regex} for each row of the config-error table."""
    text = (DOCS / "troubleshooting.md").read_text()
    table = text[text.index("| message starts with | fix |"):]
    table = table[:table.index("\n\n")]
    rows = {}
    for quoted in re.findall(r"^\| `(.+?)` \|", table, flags=re.M):
        pattern = re.escape(quoted).replace("…", ".+?").replace("KEY", r"\w+")
        rows[quoted.split("=", 1)[0]] = re.sub(r"\bN\b", r"\\d+", pattern)
    return rows


def test_troubleshooting_table_lists_each_case_once():
    assert sorted(troubleshooting_rows()) == sorted([*TROUBLESHOOTING_CASES, *NOT_RENDERED])


@pytest.mark.parametrize("key", list(TROUBLESHOOTING_CASES))
def test_troubleshooting_table_quotes_what_validation_prints(key, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # train.device=cuda on a CPU machine
    overrides, ranks = TROUBLESHOOTING_CASES[key]
    message = first_config_error(overrides, [ranks])
    assert message and re.match(troubleshooting_rows()[key], message), message


def test_troubleshooting_headings_quote_what_validation_prints(tmp_path):
    """The config errors troubleshooting.md has a section for, each from a bad config that needs
    a folder or file: an empty folder to resume from, a token file without its metadata."""
    (tmp_path / "corpus.bin").write_bytes(b"")
    cases = {"checkpoint.resume": [f"checkpoint.resume={tmp_path}"],
             "data.path": ["data=tokens", f"data.path={tmp_path / 'corpus.bin'}"]}
    text = (DOCS / "troubleshooting.md").read_text()
    headings = re.findall(r"^### `parallel3d: config error: ([a-z][\w.]*)(=.+)`$", text, flags=re.M)
    assert sorted(key for key, _ in headings) == sorted(cases)
    for key, rest in headings:
        pattern = re.escape(key + rest).replace("…", ".+?")
        message = first_config_error(cases[key], [1])
        assert message and re.fullmatch(pattern, message), message


def test_troubleshooting_example_failure_is_what_a_run_prints(tmp_path, monkeypatch, capsys):
    """troubleshooting.md's example of a failure's one line (shown wrapped): a resume past
    train.steps, reported by failures.report_failure in a run_dir named run."""
    text = (DOCS / "troubleshooting.md").read_text()
    example = text[text.index("A run that fails prints one line"):]
    shown = " ".join(line.strip() for line in re.findall(r"^    (\S.*)$", example[:example.index("\n- ")], flags=re.M))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PARALLEL3D_DEBUG", raising=False)
    checkpoint = Path("run/checkpoints/step_4")
    checkpoint.mkdir(parents=True)
    (checkpoint / META).write_text('{"step": 4, "model_only": false}')
    with pytest.raises(RunError) as error:
        check_not_past_end(checkpoint, 3)
    report_failure(error.value, "run", 0)
    assert capsys.readouterr().err.strip() == shown


def test_readme_manual_links_every_docs_page():
    readme = README.read_text()
    manual = readme[readme.index("## Manual"):]
    manual = manual[:manual.index("\n## ")]
    linked = set(re.findall(r"^\| \[docs/([^\]]+\.md)\]\(docs/\1\) \|", manual, flags=re.M))
    assert linked == {page.name for page in DOCS.glob("*.md")}


def configuration_table_cells(first_column: str) -> dict[str, str]:
    """{first cell: the rest of its row} of the table in docs/configuration.md headed first_column."""
    text = (DOCS / "configuration.md").read_text()
    table = text[text.index(f"| {first_column} |"):]
    table = table[:table.index("\n\n")]
    return dict(re.findall(r"^\| `(\w+)`[^|]* \| (.*) \|$", table, flags=re.M))


def test_configuration_md_lists_every_config_group_option():
    """Each group of conf/ is a row whose options (the bare names in backquotes) are its yaml files."""
    groups = configuration_table_cells("group")
    assert set(groups) == {d.name for d in (ROOT / "conf").iterdir() if d.is_dir()}
    for group, options in groups.items():
        named = set(re.findall(r"`([a-z0-9_]+)`", options))
        assert named == {y.stem for y in (ROOT / "conf" / group).glob("*.yaml")}, group


def test_configuration_md_lists_every_recipe():
    assert set(configuration_table_cells("recipe")) == {y.stem for y in (ROOT / "recipes").glob("*.yaml")}


PATH = r"\b((?:parallel3d|tools|tests|conf|recipes|docs)/[\w./-]*\w)(?![<{\w*])"
IN_THE_WHEEL = {"parallel3d/conf", "parallel3d/recipes"}  # conf/ and recipes/ as pyproject.toml maps them


@pytest.mark.fast
def test_every_path_the_docs_name_exists():
    """parallel3d/, tools/, tests/, conf/, recipes/ and docs/ paths in README.md, BENCHMARKS.md and
    docs/ (after a file moves, the manual must follow it)."""
    missing = set()
    for page in [README, ROOT / "BENCHMARKS.md", *DOCS.glob("*.md")]:
        # a path that goes on with a placeholder or a glob (tests/test_<module>.py) is a pattern
        for path in re.findall(PATH, page.read_text()):
            if not (ROOT / path).exists() and path not in IN_THE_WHEEL:
                missing.add(f"{page.name}: {path}")
    assert not missing


def test_readme_layout_names_every_module_and_subpackage():
    """Each parallel3d/NAME.py and parallel3d/NAME/ appears in the README's layout of the repository
    (as its path, or as NAME.py on the line of a module it shares a line with)."""
    readme = README.read_text()
    layout = readme[readme.index("## Layout of the repository"):]
    named = set(re.findall(r"\b(\w+\.py)\b", layout)) | set(re.findall(r"^parallel3d/(\w+)/", layout, flags=re.M))
    package = ROOT / "parallel3d"
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    assert (modules | subpackages) - named == set()


def test_architecture_md_names_every_module_on_its_floor():
    """docs/architecture.md's module table names every module of every wing, and its floors are the
    order tests/test_structure.py holds the imports to."""
    from test_structure import WINGS

    page = (DOCS / "architecture.md").read_text()
    package = ROOT / "parallel3d"
    rows = dict(re.findall(r"^\| `parallel3d/(\w+(?:\.py|/))` \| (.*) \|$", page, flags=re.M))
    missing = [f"{wing}{p.name}" for wing, cells in rows.items() if wing.endswith("/")
               for p in (package / wing).glob("*.py") if p.name != "__init__.py" and f"`{p.name}`" not in cells]
    wings = {p.parent.name + "/" for p in package.glob("*/__init__.py")} | {p.name for p in package.glob("*.py")}
    assert missing == [] and wings - {"__init__.py"} - set(rows) == set()
    floors = re.findall(r"^ *\d+ +(\w+)(?:\.py|/) ", page, flags=re.M)
    assert floors[::-1] == list(WINGS)
