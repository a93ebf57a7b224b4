"""Every data-parallel mode trains to the single-process numbers, with the memory it promises.

One torchrun per layout; each layout's run serves both the parity and the memory assertions.
Global batch 16 in every run; micro batches below the per-rank batch turn on accumulation.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAST, launch, relative_error

pytestmark = pytest.mark.multirank

# name: (ranks, overrides). Each ZeRO stage appears with and without gradient accumulation.
LAYOUTS = {
    "dp2-zero0": (2, ["parallel.zero_stage=0", "train.micro_batch_size=8"]),
    "dp2-zero1-accum": (2, ["parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "dp2-zero2": (2, ["parallel.zero_stage=2", "train.micro_batch_size=8"]),
    "dp2-zero3-accum": (2, ["parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "dp4-zero0-accum": (4, ["parallel.zero_stage=0", "train.micro_batch_size=2"]),
    "dp4-zero1": (4, ["parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "dp4-zero2-accum": (4, ["parallel.zero_stage=2", "train.micro_batch_size=2"]),
    "dp4-zero3": (4, ["parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "hsdp2x2-zero2": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=2", "train.micro_batch_size=4"]),
    "hsdp2x2-zero3-accum": (4, ["parallel.dp_replicate=2", "parallel.fsdp_sharding_strategy=HYBRID_SHARD",
                                "train.micro_batch_size=2"]),
}

_runs: dict = {}


@pytest.fixture(params=list(LAYOUTS))
def layout_run(request, runs_root):
    name = request.param
    if name not in _runs:
        nproc, overrides = LAYOUTS[name]
        run = launch(runs_root / name, [*FAST, *overrides, "train.save_model=true"], nproc=nproc)
        run.assert_finished(10)
        _runs[name] = run
    return name, _runs[name]


def test_losses_and_final_weights_match_single_process(layout_run, reference_run):
    name, run = layout_run
    assert relative_error(run.losses, reference_run.losses) < 1e-5, (run.losses, reference_run.losses)
    norms, ref_norms = [r["grad_norm"] for r in run.metrics], [r["grad_norm"] for r in reference_run.metrics]
    assert relative_error(norms, ref_norms) < 1e-5
    weights = load_file(str(run.run_dir / "model.safetensors"))
    reference = load_file(str(reference_run.run_dir / "model.safetensors"))
    assert weights.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-5, atol=1e-5, msg=key)


def _ideal(reference: dict, stage: int, dp: int, dp_shard: int) -> dict:
    """Bytes per rank if each stage divided exactly what it shards, over the ranks it shards over."""
    full = {k: reference[k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes")}
    if stage == 0:
        return full
    if stage == 1:
        return {**full, "optim_state_bytes": full["optim_state_bytes"] / dp}
    return {k: v / dp_shard for k, v in full.items()}


def test_model_state_memory_is_ideal_for_the_zero_stage(layout_run, reference_run):
    name, run = layout_run
    nproc, overrides = LAYOUTS[name]
    stage = 3 if "zero3" in name else int(name.split("zero")[1][0])
    dp_shard = nproc // 2 if name.startswith("hsdp") else nproc
    measured, reference = run.metrics[0], reference_run.metrics[0]
    for key, ideal in _ideal(reference, stage, nproc, dp_shard).items():
        assert abs(measured[key] - ideal) / ideal < 0.02, f"{name} {key}: {measured[key]} vs ideal {ideal:.0f}"
