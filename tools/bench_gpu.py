#!/usr/bin/env python
"""Throughput, MFU and peak memory on one GPU in bf16: parallel3d's training loop without and
with ``torch.compile`` of its blocks and loss, beside a plain PyTorch loop of the same model,
batches and optimizer (eager, and model and loss compiled as one graph, nanoGPT's way), all in
one process; parallel3d compiled with float8 matmuls (torchao, tensorwise and rowwise scaling,
``train.float8``); each peak beside the planner's prediction.

    python tools/bench_gpu.py [--case 1b] [--case 8b-blocks] [--steps 30] [--log-every 10] [key=value ...]

Tokens/s is the median over the log intervals after the first (which holds compilation and the
allocator's warm-up), each interval timed as parallel3d's metrics.jsonl times it: wall time
between two host syncs. MFU = tokens/s x FLOPs per token / the device's peak
(``parallel3d.observe.metrics.PEAK_FLOPS``: dense bf16, for the float8 loops too, as torchtitan reports
them), with FLOPs per token counted both ways (``flop_counts``): 6 per matmul weight plus attention
scores without the causal half (PaLM's and torchtitan's count), and with it.
The peak is the allocator's (``torch.cuda.max_memory_allocated``); the planner predicts eager
kernels, so the compiled loops' peaks, whose fused kernels keep fewer intermediates, are shown
beside it for what they are. Trailing ``key=value`` overrides apply to every case (on a machine
without a GPU, ``train.device=cpu model=tiny`` exercises the tool).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench_common import heading  # noqa: E402
from bench_overhead import ours_records, plain_records  # noqa: E402

from parallel3d.base import GIB  # noqa: E402
from parallel3d.config.compose import compose  # noqa: E402
from parallel3d.models import flops_per_token  # noqa: E402
from parallel3d.observe.metrics import peak_flops  # noqa: E402
from parallel3d.planner import predict  # noqa: E402

BF16 = ["train.param_dtype=bfloat16", "checkpoint.every=0", "model.activation_checkpoint=none", "optim.warmup_steps=1"]
# name: (what it is, overrides). The recipes' own batches: 1B trains 8 micro batches of 4 x 2048
# tokens a step; 8B's blocks 4 micro batches of 8192 tokens, with as many blocks as fit 80 GB.
CASES = {
    "1b": ("Llama 3.2 1B", ["recipe=llama3_1b", *BF16]),
    "8b-blocks": ("Llama 3 8B shapes, 8 of its 32 blocks", ["recipe=llama3_8b", "model.n_layers=8",
                                                            "train.global_batch_size=4", *BF16]),
}
FLOAT8 = ["train.float8=tensorwise"], ["train.float8=rowwise"]
LOOPS = {  # name: (its records of a run with these overrides in this run_dir, model.compile, overrides)
    "parallel3d": (ours_records, False, []),
    "parallel3d, compiled blocks and loss": (ours_records, True, []),
    "parallel3d, float8 tensorwise, compiled": (ours_records, True, FLOAT8[0]),
    "parallel3d, float8 rowwise, compiled": (ours_records, True, FLOAT8[1]),
    "plain PyTorch": (lambda overrides, run_dir: plain_records(overrides), False, []),
    "plain PyTorch, compiled whole": (lambda overrides, run_dir: plain_records(overrides), True, []),
}


def flop_counts(model, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token counted both ways: 6N plus all of attention's score and value
    matmuls (PaLM's and torchtitan's count, ``flops_per_token``), and with only the causal half of
    them, which is what a causal kernel computes (the FlashAttention papers' count)."""
    full = flops_per_token(model, seq_len)
    attention = 12 * model.n_layers * model.dim * seq_len  # n_heads x head_dim = dim
    return {"6N + attention": full, "6N + causal half": full - attention / 2}


def float8_layers(overrides: list[str], device_type: str) -> str:
    """How many of the model's linears the float8 loops convert (torchao's filter, head skipped)."""
    from parallel3d.models import Transformer
    from parallel3d.parallel.float8 import Float8Plan, apply_float8

    cfg = compose([*overrides, *FLOAT8[0], "run_dir=unused"])
    with torch.device("meta"):
        model = Transformer(OmegaConf.to_object(cfg.model))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    counts = []
    for recipe in FLOAT8:
        cfg = compose([*overrides, *recipe, "run_dir=unused"])
        with torch.device("meta"):
            t = cfg.train
            plan = Float8Plan(t.float8, t.float8_skip_small, t.float8_fsdp_all_gather, device_type)
            counts.append(len(apply_float8(Transformer(OmegaConf.to_object(cfg.model)), plan)))
    return f"float8 converts {counts[0]} (tensorwise) and {counts[1]} (rowwise) of {linears} linears"


def measure(loop: str, overrides: list[str], run_dir: Path) -> dict:
    """One loop's run: its records, median tokens/s past the first interval, and allocator peak."""
    runs, compiled, extra = LOOPS[loop]
    overrides = [*overrides, *extra, f"model.compile={str(compiled).lower()}"]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    records = runs(overrides, run_dir)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    torch._dynamo.reset()  # the next loop compiles afresh, with nothing held from this one
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    timed = records[1:] or records
    return {"losses": [r["loss"] for r in records], "peak": peak,
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
            "step_time_s": statistics.median(r["step_time_s"] for r in timed)}


# Loss differences stated under the table: (what, loop, the loop it is compared with).
GAPS = [("plain, eager", "plain PyTorch", "parallel3d"),
        ("plain, compiled", "plain PyTorch, compiled whole", "parallel3d, compiled blocks and loss"),
        ("float8 tensorwise", "parallel3d, float8 tensorwise, compiled", "parallel3d, compiled blocks and loss"),
        ("float8 rowwise", "parallel3d, float8 rowwise, compiled", "parallel3d, compiled blocks and loss")]


def report(case: str, overrides: list[str], tmp: Path, loops: list[str]) -> list[str]:
    cfg = compose([*overrides, "run_dir=unused"])
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu")
    peak_flop_s = peak_flops(device, cfg.train.param_dtype)
    flops = flop_counts(cfg.model, cfg.train.seq_len)
    planned = predict(cfg, 1).ranks[0].peak_bytes
    results = {}
    for i, loop in enumerate(loops):
        print(f"bench_gpu: {case}: {loop} ...", file=sys.stderr, flush=True)
        results[loop] = measure(loop, overrides, tmp / f"{case}-{i}")

    def loss_gap(a: str, b: str) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(results[a]["losses"], results[b]["losses"]))

    t = cfg.train
    per_token = " or ".join(f"{v / 1e9:.2f} ({k})" for k, v in flops.items())
    gaps = ", ".join(f"{what} {loss_gap(a, b):.1e}" for what, a, b in GAPS if a in results and b in results)
    rows = [f"**{CASES[case][0]}**: {t.global_batch_size // t.micro_batch_size} micro batches of "
            f"{t.micro_batch_size} x {t.seq_len} tokens a step, GFLOP per token {per_token}; planner peak "
            f"{planned / GIB:.2f} GiB; {float8_layers(overrides, device.type)}. Largest relative loss difference from "
            f"parallel3d (bf16, eager or compiled as the loop): {gaps}.\n",
            "| loop | step s | tokens/s | MFU (6N + attention) | MFU (causal half) | peak GiB | planner vs peak |",
            "|---|---|---|---|---|---|---|"]
    for loop, r in results.items():
        mfu = [f"{r['tokens_per_sec'] * f / peak_flop_s:.1%}" if peak_flop_s else "–" for f in flops.values()]
        peak = f"{r['peak'] / GIB:.2f}" if r["peak"] else "–"
        gap = f"{planned / r['peak'] - 1:+.1%}" if r["peak"] else "–"
        rows.append(f"| {loop} | {r['step_time_s']:.3f} | {r['tokens_per_sec']:,.0f} | {mfu[0]} | {mfu[1]} | "
                    f"{peak} | {gap} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=list(CASES), help="model(s) to run (default: all)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per loop")
    parser.add_argument("--log-every", type=int, default=5, help="steps per timed interval")
    parser.add_argument("--loop", action="append", choices=list(LOOPS), help="loop(s) to run (default: all)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every case, e.g. train.seq_len=4096")
    args = parser.parse_args(argv)
    print(heading("Throughput, MFU and memory on one GPU", "bench_gpu.py", argv, "bf16 (FSDP mixed precision), fused AdamW"))
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.case or list(CASES):
            overrides = [*CASES[case][1], f"train.steps={args.steps}", f"logging.log_every={args.log_every}",
                         *args.overrides]
            print("\n" + "\n".join(report(case, overrides, Path(tmp), args.loop or list(LOOPS))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
