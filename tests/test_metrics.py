"""What a run reports: wandb's offline record (read back from its transaction log), its resume,
and the peak FLOPs that MFU divides by."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from harness.runs import FAST, Run, env, launch, tensorboard_scalars

from parallel3d.observe.metrics import peak_flops


def wandb_records(path: Path):
    """The protobuf records of a ``run-<id>.wandb`` file (wandb 0.31 ships no Python reader).

    The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB
    blocks of chunks, each ``crc32c(4) length(2) type(1) data``; type 1 is a whole record, 2/3/4
    its first/middle/last piece. A block's tail shorter than a chunk header is padding.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:header]
    pos, pieces = header, []
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + header])
        if kind == 0:  # zeroed space after the last record
            break
        pieces.append(data[pos + header : pos + header + length])
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def offline_run(run_dir: Path) -> list[dict]:
    """Per offline run dir (oldest first): its id, config and history rows."""
    runs = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        found = {"id": None, "config": {}, "history": []}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["id"] = record.run.run_id
                found["config"] = _items(record.run.config.update)
            elif kind == "history":
                found["history"].append(_items(record.history.item))
        runs.append(found)
    return runs


def _items(items) -> dict:
    return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in items}


class ConnectionCatcher:
    """An HTTP(S) proxy on loopback that only counts who tries to use it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.requests.append(conn.recv(200))
                except OSError:
                    self.requests.append(b"?")


def test_wandb_offline_records_the_run_and_continues_it_after_resume(tmp_path, monkeypatch):
    """No API key: offline, no network attempt; the record holds the config and every logged
    metric; a resumed run continues the same wandb run id, a fresh start gets a new one."""
    catcher = ConnectionCatcher()
    clean = env()
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_ERROR_REPORTING", "NO_PROXY", "no_proxy"):
        clean.pop(key, None)
    home = tmp_path / "home"  # no ~/.netrc login, and wandb's cache stays in the test
    home.mkdir()
    clean.update(HOME=str(home), **{k: catcher.url for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")})
    monkeypatch.setattr("harness.runs.env", lambda: clean)

    run_dir = tmp_path / "run"
    base = [*FAST, "logging=wandb", "logging.wandb.tags=[ci,offline]", "checkpoint.every=3", "optim.warmup_steps=1"]
    first = launch(run_dir, [*base, "train.steps=4"])
    first.assert_finished(4)
    resumed = launch(run_dir, [*base, "train.steps=6"])
    resumed.assert_finished(6)
    assert "resumed from" in resumed.stdout

    runs = offline_run(run_dir)
    assert len(runs) == 2, list(run_dir.rglob("*.wandb"))
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert [r["id"] for r in runs] == [run_id, run_id]
    # The first run logged steps 1-4 and saved at its last step; the second went on from there.
    assert [h["step"] for h in runs[0]["history"]] == [1, 2, 3, 4]
    assert [h["step"] for h in runs[1]["history"]] == [5, 6]
    metrics = Run(run_dir, 0, "", "").metrics
    logged = {h["step"]: h for h in runs[1]["history"]}
    for row in metrics[4:]:
        for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "max_memory_bytes", "param_bytes"):
            assert logged[row["step"]][key] == pytest.approx(row[key], rel=1e-12), key
    assert "mfu" not in logged[6]  # null on CPU: not logged as a number
    config = runs[1]["config"]
    assert config["train"]["steps"] == 6 and config["run_dir"] == str(run_dir)
    assert config["logging"]["wandb"]["tags"] == ["ci", "offline"]
    assert catcher.requests == [], catcher.requests  # offline means no network, not even telemetry

    fresh = launch(run_dir, [*base, "train.steps=4", "checkpoint.resume=none"])
    fresh.assert_finished(4)
    new_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert new_id != run_id and offline_run(run_dir)[-1]["id"] == new_id


@pytest.mark.fast
@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),  # not the SXM part's figure
    ("NVIDIA H200", "float32", 494.7e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA GeForce RTX 3090", "bfloat16", None),  # unknown: no made-up MFU
])
def test_peak_flops_by_device_name(monkeypatch, name, dtype, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == expected
    assert peak_flops(torch.device("cpu"), dtype) is None


@pytest.mark.parametrize("environ, configured, expected", [
    ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, None, "offline"),  # the key does not turn it online
    ({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}, "online", "offline"),  # offline said anywhere wins
    ({"WANDB_API_KEY": "k"}, "offline", "offline"),
    ({"WANDB_API_KEY": "k"}, "disabled", "disabled"),
    ({"WANDB_API_KEY": "k"}, None, "online"),
    ({}, None, "offline"),
    ({}, "online", "online"),
])
def test_an_explicit_offline_wandb_mode_always_wins(monkeypatch, environ, configured, expected):
    from parallel3d.observe.metrics import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert wandb_mode(configured) == expected


def test_wandb_online_without_a_server_continues_offline(tmp_path, monkeypatch, capsys):
    """An API key and no reachable server (a closed port on loopback): offline, with a warning. The
    warning comes from our reachability check, before wandb.init: so no online init waits for its
    timeout (how long it takes: tools/bench_timeouts.py, BENCHMARKS (o))."""

    from parallel3d.config.schema import WandbConfig
    from parallel3d.observe.metrics import start_wandb

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    run = start_wandb(WandbConfig(enabled=True, mode="online"), tmp_path, {"a": 1})
    try:
        assert run.settings.mode == "offline"
        assert "wandb server unreachable: logging offline" in capsys.readouterr().err
    finally:
        run.finish()
    assert "x" * 40 not in "".join(p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file())


def test_wandb_online_with_a_silent_server_continues_offline(tmp_path, monkeypatch, capsys):
    """A server on loopback that accepts connections and never answers (server_reachable passes):
    wandb.init times out and the run goes on offline, with one line that names the timeout it waited
    (how long it takes: tools/bench_timeouts.py, BENCHMARKS (o))."""
    from parallel3d.config.schema import WandbConfig
    from parallel3d.observe.metrics import start_wandb

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(1.0)
    stop, accepted = threading.Event(), []

    def accept_and_say_nothing():
        deadline = time.monotonic() + 120  # bounded: it stops by itself
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    try:
        run = start_wandb(WandbConfig(enabled=True, mode="online"), tmp_path, {"a": 1})
        try:
            assert run.settings.mode == "offline" and accepted  # it did connect, and heard nothing
            (line,) = [x for x in capsys.readouterr().err.splitlines() if "parallel3d" in x]
            assert "did not answer within 3 s" in line and "logging offline" in line, line
            run.log({"loss": 1.0}, step=1)
        finally:
            run.finish()
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        server.close()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_tensorboard_holds_the_logged_metrics_and_a_resume_continues_the_curves(tmp_path):
    run_dir = tmp_path / "run"
    base = [*FAST, "logging=tensorboard", "checkpoint.every=3", "optim.warmup_steps=1"]
    launch(run_dir, [*base, "train.steps=4"]).assert_finished(4)
    resumed = launch(run_dir, [*base, "train.steps=6"])
    resumed.assert_finished(6)
    assert "resumed from" in resumed.stdout
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    metrics = Run(run_dir, 0, "", "").metrics
    assert [row["step"] for row in metrics] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "step_time_s", "step_time_max_s", "data_wait_max_s", "slowest_rank"):
        assert [step for step, _ in scalars[key]] == [1, 2, 3, 4, 5, 6], key  # appended, nothing twice
        assert [value for _, value in scalars[key]] == pytest.approx([row[key] for row in metrics], rel=1e-6), key
    assert "mfu" not in scalars  # null on CPU
