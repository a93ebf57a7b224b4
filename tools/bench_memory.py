#!/usr/bin/env python
"""Peak memory per rank: the dry run's measurement (parallel3d/planner/dryrun.py: the real program on fake
tensors, every tensor storage followed by torch's MemTracker) against the planner's prediction,
for the layouts the README recommends and the 405B recipe. Prints a Markdown table.

    python tools/bench_memory.py            # ~10 minutes on 2 CPU cores
    python tools/bench_memory.py --quick    # the 8B-shaped 4-block matrix of tests/test_dryrun.py
    python tools/bench_memory.py --moe      # Qwen3-30B-A3B-shaped, 4 blocks: experts by ep and ZeRO stage

The planner is asked for CPU kernels (``train.device=cpu``), which is what the dry run executes;
its GPU figure (fused RMSNorm and attention kernels) is shown beside it, unverified here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench_common import print_dry_run_table  # noqa: E402

from parallel3d.base import GIB  # noqa: E402
from parallel3d.config.compose import compose  # noqa: E402
from parallel3d.planner import predict  # noqa: E402
from parallel3d.planner.dryrun import dry_run  # noqa: E402

BF16 = ["train.param_dtype=bfloat16", "train.reduce_dtype=float32", "train.seq_len=8192", "train.micro_batch_size=1"]
# name: (world size, overrides, ranks). Without pipelining the peak does not depend on the number
# of micro batches, so 70B runs 8 of them instead of 128.
LAYOUTS = {
    "8B, 8 GPUs: dp8 ZeRO-2, ac=op": (8, ["recipe=llama3_8b", *BF16, "train.global_batch_size=128",
                                          "parallel.dp_shard=8", "parallel.zero_stage=2",
                                          "model.activation_checkpoint=op"], [0]),
    "8B, 64 GPUs: dp64 ZeRO-2": (64, ["recipe=llama3_8b", *BF16, "train.global_batch_size=1024",
                                      "parallel.dp_shard=64", "parallel.zero_stage=2",
                                      "model.activation_checkpoint=none"], [0]),
    "70B, 64 GPUs: dp8 tp8 ZeRO-2, ac=op": (64, ["recipe=llama3_70b", *BF16, "train.global_batch_size=64",
                                                 "parallel.dp_shard=8", "parallel.tp=8", "parallel.zero_stage=2",
                                                 "model.activation_checkpoint=op"], [0]),
    "405B recipe: tp8 pp8 dp8 ZeRO-3, ac=full": (512, ["recipe=llama3_405b"], [0, 64, 448]),
    "405B recipe, ac=none": (512, ["recipe=llama3_405b", "model.activation_checkpoint=none"], [0]),
}
# Qwen3-30B-A3B's shapes (128 experts of 768, top 8) cut to 4 blocks, bf16, 1024 tokens: where
# experts sit in the data-parallel units (expert_dp > 1) or cast themselves (expert_dp = 1).
MOE_BASE = ["model=qwen3_30b_a3b", "model.n_layers=4", "train.seq_len=1024", "train.micro_batch_size=1",
            "train.global_batch_size=8", "train.param_dtype=bfloat16"]
MOE = {
    "dp2 ZeRO-3": (2, ["parallel.zero_stage=3"]),
    "ep2 dp2 ZeRO-3": (2, ["parallel.ep=2", "parallel.zero_stage=3"]),
    "ep2 dp2 ZeRO-3, ac=op": (2, ["parallel.ep=2", "parallel.zero_stage=3", "model.activation_checkpoint=op"]),
    "ep2 dp2 ZeRO-1, every 2nd block": (2, ["parallel.ep=2", "parallel.zero_stage=1", "model.moe.every=2"]),
    "ep2 dp4 ZeRO-2": (4, ["parallel.ep=2", "parallel.zero_stage=2"]),
    "ep2 dp4 ZeRO-3": (4, ["parallel.ep=2", "parallel.zero_stage=3"]),
    "ep2 dp2 pp2 ZeRO-3": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=3"]),
}


# Llama 3 8B's shapes (vocabulary 128K) cut to 4 blocks, bf16, 4096 tokens: each layout's busiest
# ranks in seconds (tests/test_dryrun.py asserts the planner within 10% on each). With so few blocks
# the vocabulary-sized tensors (embedding, output, loss) weigh more than in any real model, and what
# coincides at the peak varies most; the planner models the peak as all of them at once.
QUICK_BASE = ["model=llama3_8b", "model.n_layers=4", "train.seq_len=4096", "train.micro_batch_size=1",
              "train.global_batch_size=8", "train.param_dtype=bfloat16"]
QUICK = {
    "ddp": (4, ["parallel.zero_stage=0"]),
    "zero1": (4, ["parallel.zero_stage=1"]),
    "zero2": (4, ["parallel.zero_stage=2"]),
    "zero3-ac-op": (4, ["parallel.zero_stage=3", "model.activation_checkpoint=op"]),
    "tp4": (4, ["parallel.tp=4"]),
    "dp2-tp2-zero3": (4, ["parallel.tp=2", "parallel.zero_stage=3"]),
    "dp2-pp2-1F1B-zero2": (4, ["parallel.pp=2", "parallel.zero_stage=2"]),
    "dp2-tp2-pp2-interleaved-zero3": (8, ["parallel.pp=2", "parallel.tp=2", "parallel.zero_stage=3",
                                          "parallel.pp_schedule=Interleaved1F1B"]),
}


def table(layouts: dict) -> list[str]:
    rows = ["| layout | rank | dry run peak GiB | planner (CPU kernels) GiB | difference | planner (GPU kernels) GiB |",
            "|---|---|---|---|---|---|"]
    for name, (world, overrides, ranks) in layouts.items():
        plans = {device: predict(compose([*overrides, f"train.device={device}", "run_dir=."]), world)
                 for device in ("cpu", "cuda")}
        for report in dry_run(overrides, world, ranks):
            pp = report.coords.get("pp", 0)
            cpu, gpu = (plans[d].ranks[pp].peak_bytes for d in ("cpu", "cuda"))
            rows.append(f"| {name} | {report.rank} | {report.peak_bytes / GIB:.2f} | {cpu / GIB:.2f} | "
                        f"{cpu / report.peak_bytes - 1:+.1%} | {gpu / GIB:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small matrix of tests/test_dryrun.py instead")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts matrix instead")
    args = parser.parse_args(argv)
    quick = {f"8B-shaped, 4 blocks: {name}": (world, [*QUICK_BASE, *overrides], None)
             for name, (world, overrides) in QUICK.items()}
    moe = {f"Qwen3-30B-A3B-shaped, 4 blocks: {name}": (world, [*MOE_BASE, *overrides], None)
           for name, (world, overrides) in MOE.items()}
    return print_dry_run_table("Peak memory per rank, measured and planned", "bench_memory.py", argv,
                               lambda: table(quick if args.quick else moe if args.moe else LAYOUTS))


if __name__ == "__main__":
    sys.exit(main())
