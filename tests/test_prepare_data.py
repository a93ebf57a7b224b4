"""parallel3d-prepare-data over sources: worker processes, the training cache, resuming after a kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness.data_files import documents, write_jsonl, write_mixture

from parallel3d.config.compose import PROJECT_ROOT, compose
from parallel3d.data import TokenFile, load_tokenizer, open_sources, write_token_file
from parallel3d.data import sources as src
from parallel3d.data.shards import is_heldout, shard_files

TOOL = [sys.executable, "-m", "parallel3d.cli.prepare_data"]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env=_env())


def test_workers_fill_the_cache_that_training_reads(tmp_path):
    sources = write_mixture(tmp_path / "src")
    cache = tmp_path / "cache"
    args = [a for s in sources for a in ("--source", s)]
    proc = _prepare(*args, "--cache-dir", str(cache), "--workers", "2", "--eval-fraction", "0.1")
    assert proc.returncode == 0, proc.stderr
    assert "0 of 5 shards already done; tokenizing 5 with 2 workers" in proc.stdout
    assert sum(line.startswith("tokenized ") for line in proc.stdout.splitlines()) == 5
    assert "tokens/s" in proc.stdout
    cfg = compose([f"data.sources=[{','.join(sources)}]", f"data.cache_dir={cache}"]).data
    corpus = open_sources(sources, cfg, 0.1)  # finds every shard done: nothing tokenized again
    tok = load_tokenizer("byte")
    for source, path in zip(corpus.sources, sources):
        shards = src.resolve(path)
        metas = [TokenFile(shard_files(s, tok, "text", 0.1, cache).train).meta for s in shards]
        assert {m["tokenized_by"].split()[0] for m in metas} == {"worker"}
        got = np.concatenate([np.asarray(a) for a in source.arrays])
        training = [t for s in shards for t in src.documents(s, "text") if not is_heldout(t, 0.1)]
        reference = write_token_file(training, tok, tmp_path / "ref" / f"{source.name}.bin")
        assert np.array_equal(got, TokenFile(reference).tokens)
    again = _prepare(*args, "--cache-dir", str(cache), "--workers", "2", "--eval-fraction", "0.1")
    assert "5 of 5 shards already done; tokenizing 0" in again.stdout
    assert "held out no document" not in proc.stderr + again.stderr


def test_a_killed_run_resumes_without_redoing_finished_shards(tmp_path):
    for i in range(8):  # eight shards of ~1.5 MB: long enough to be killed part way through
        write_jsonl(tmp_path / "src" / f"part-{i}.jsonl", documents(f"p{i}", 6000, i))
    cache = tmp_path / "cache"
    args = [*TOOL, "--source", str(tmp_path / "src"), "--cache-dir", str(cache), "--workers", "2"]
    proc = subprocess.Popen(args, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    for line in proc.stdout:
        if line.startswith("tokenized "):  # the first shard is finished: kill tool and workers now
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    for _ in range(100):  # the workers die too (zombies until reaped: prepare_data._alive skips them)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    tok = load_tokenizer("byte")
    shards = src.resolve(str(tmp_path / "src"))
    files = [shard_files(s, tok, "text", 0.0, cache) for s in shards]
    finished = {f.train: f.train.stat().st_mtime_ns for f in files if f.done()}
    assert 1 <= len(finished) < 8, len(finished)
    rerun = subprocess.run(args, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, env=_env())
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(finished)} of 8 shards already done; tokenizing {8 - len(finished)}" in rerun.stdout
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # not redone
    assert all(f.done() for f in files)
    for shard, f in zip(shards, files):
        expected = [i for t in src.documents(shard, "text") for i in (*tok.encode(t), tok.eos_id)]
        assert TokenFile(f.train).tokens.tolist() == expected
    assert not list(cache.glob(".*.tmp"))  # the killed writers' temporary files are gone


def test_bad_input_is_one_line_naming_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    proc = _prepare("--source", str(tmp_path / "bad.jsonl"), "--cache-dir", str(tmp_path / "c"), "--workers", "1")
    assert proc.returncode == 2
    assert f"{tmp_path / 'bad.jsonl'} line 2" in proc.stderr and "Fix:" in proc.stderr


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _start_tokenizing(args: list[str]) -> tuple[subprocess.Popen, list[int]]:
    """prepare_data in a session of its own, once its workers run; with their pids."""
    proc = subprocess.Popen(args, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    assert "shards already done" in proc.stdout.readline()
    for _ in range(200):
        workers = _children(proc.pid)
        if len(workers) == 2:
            return proc, workers
        time.sleep(0.05)
    raise AssertionError(f"no workers under {proc.pid}")


def test_sigterm_stops_with_one_line_and_workers_die_with_their_parent(tmp_path):
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads the process table from /proc")
    for i in range(4):  # shards long enough to be stopped part way through
        write_jsonl(tmp_path / "src" / f"part-{i}.jsonl", documents(f"p{i}", 8000, i))
    cache = tmp_path / "cache"
    args = [*TOOL, "--source", str(tmp_path / "src"), "--cache-dir", str(cache), "--workers", "2"]
    proc, workers = _start_tokenizing(args)
    try:
        proc.send_signal(signal.SIGTERM)  # the tool only, as a scheduler's preemption would
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("prepare_data: stopped by SIGTERM: "), err
        assert "run the same command again" in lines[0]
        assert not [w for w in workers if _running(w)]
        assert not list(cache.glob(".*.tmp"))  # nothing half-written left behind
        proc, workers = _start_tokenizing(args)
        os.kill(proc.pid, signal.SIGKILL)  # the tool only: its workers must not run on as orphans
        proc.wait(timeout=60)
        for _ in range(100):
            if not [w for w in workers if _running(w)]:
                break
            time.sleep(0.05)
        assert not [w for w in workers if _running(w)], "workers outlived their parent"
    finally:
        for pid in (proc.pid, *workers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_empty_held_out_output_is_a_warning(tmp_path):
    web = write_jsonl(tmp_path / "web.jsonl", documents("web", 20))
    proc = _prepare("--source", str(web), "--cache-dir", str(tmp_path / "c"), "--workers", "1",
                    "--eval-fraction", "0.001")
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "warning" in x]
    assert "--eval-fraction 0.001 held out no document" in line and "eval.sources" in line, line
