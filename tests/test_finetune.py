"""Supervised fine-tuning on chat records: the loss of a run equals a hand-written loop around
transformers' LlamaForCausalLM, and every layout equals one process.

The run starts from a Hugging Face folder (checkpoint.init_from) and packs rendered chats into
rows; the reference takes each step's samples (the rows' segments), runs every sample on its own
through transformers' model (its own positions, no other sample in view), sums the cross entropy
of the trained targets (labels -100 elsewhere) and divides by the global batch's trained targets.
Some rows hold only an over-long prompt: a micro batch with no trained token must add exactly 0.
The layouts also hold val_loss (held-out chats, over their assistant tokens) to one process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness.chat_files import chat_records, llama_folder, write_jsonl
from harness.parity import assert_matches
from harness.runs import launch_batch, launch_measured, relative_error

STEPS, GLOBAL_BATCH = 10, 8
# A constant lr without weight decay: the reference's AdamW is torch's, as configured here.
TRAIN = [f"train.steps={STEPS}", f"train.global_batch_size={GLOBAL_BATCH}", "train.seq_len=64", "optim.eps=1e-6",
         "optim.warmup_steps=0", "optim.schedule=constant", "optim.weight_decay=0", "train.grad_clip=1.0",
         "data.format=chat"]
# One 4-rank launch: dp4 ZeRO-3 (two micro batches a rank), and dp2 with tp2, pp2 and cp2.
LAYOUTS = {
    "dp4-zero3": ["parallel.zero_stage=3", "train.micro_batch_size=1"],
    "dp2-tp2": ["parallel.tp=2", "train.micro_batch_size=2"],
    "dp2-pp2": ["parallel.pp=2", "parallel.pp_schedule=1F1B", "train.micro_batch_size=1"],
    "dp2-cp2": ["parallel.cp=2", "train.micro_batch_size=2"],
}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = llama_folder(root / "model")
    data = write_jsonl(root / "chats.jsonl", chat_records(90, long_prompts=10))
    heldout = write_jsonl(root / "heldout.jsonl", chat_records(40, seed=1))
    # The folder alone defines the model and the tokenizer (and its chat template): no model.* key.
    overrides = [*TRAIN, f"data.sources=[{data}]", f"eval.sources=[{heldout}]", "eval.batches=1",
                 f"data.cache_dir={root / 'cache'}", f"checkpoint.init_from={model}"]
    # the one-process run, and the tolerance its own sensitivity implies (tests/harness/tolerance.py)
    run, tolerance = launch_measured(root, [*overrides, "train.micro_batch_size=1"], STEPS, name="one",
                                     metrics=("loss", "grad_norm", "val_loss"), weights=False)
    return root, overrides, run, tolerance


def batch_loss(model, inputs, targets, samples) -> tuple[torch.Tensor, int]:
    """The mean cross entropy over a batch's trained targets, each sample run on its own; and how
    many rows of it train nothing."""
    total, empty_rows = torch.zeros(()), 0
    for row in range(len(inputs)):
        empty_rows += bool((targets[row] == -100).all())
        for k in samples[row].unique():
            labels = targets[row][samples[row] == k]
            if (labels != -100).any():
                logits = model(inputs[row][samples[row] == k][None]).logits[0]
                total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    return total / (targets != -100).sum(), empty_rows


def reference_losses(root, overrides) -> tuple[list[float], float, int]:
    """transformers' model trained by hand on the run's samples: the losses, the val_loss after
    the last step, and how many rows trained nothing."""
    from transformers import LlamaForCausalLM

    from parallel3d.config.compose import compose
    from parallel3d.data import BatchSpec, StepSampler, build_train_data, open_eval_corpus

    c = compose(overrides)
    spec = BatchSpec(GLOBAL_BATCH, GLOBAL_BATCH, 64)
    _, sampler = build_train_data(c.data, c.eval, spec, c.train.seed)
    model = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.optim.lr, betas=(0.9, 0.95), eps=1e-6, weight_decay=0)
    losses, empty_rows = [], 0
    for step in range(1, STEPS + 1):
        loss, empty = batch_loss(model, *sampler.micro_batches(step)[0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        empty_rows += empty
    heldout = open_eval_corpus(c.data, c.eval, seq_len=64)
    with torch.no_grad():
        val_loss, _ = batch_loss(model, *StepSampler(heldout.tokens, spec, c.train.seed, flags=heldout.flags)
                                 .micro_batches(1)[0])
    return losses, val_loss.item(), empty_rows


def test_sft_loss_equals_a_transformers_loop(sft):
    """Another implementation is another order of the same sums: held to the run's own tolerance."""
    root, overrides, run, tolerance = sft
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        expected, val_loss, empty_rows = reference_losses(root, overrides)
    finally:
        torch.set_num_threads(threads)
    assert empty_rows > 0, "no micro batch without a trained token: the data does not exercise it"
    assert relative_error(run.losses, expected) <= tolerance["loss"], (run.losses, expected, tolerance.explain("loss"))
    assert relative_error([run.metrics[-1]["val_loss"]], [val_loss]) <= tolerance["val_loss"]
    assert "truncated" in run.stdout, run.stdout[-500:]  # the count of over-long samples is on the console
    assert "% sample tokens)" in run.stdout  # and how full packing left the rows
    fills = [m["row_fill"] for m in run.metrics if "loss" in m]  # each step's global batch
    assert len(fills) == STEPS and all(0 < f <= 1 for f in fills) and len(set(fills)) > 1, fills


@pytest.mark.multirank
def test_sft_layouts_equal_one_process(sft):
    root, overrides, reference, tolerance = sft
    runs = launch_batch(root, {name: [*overrides, *layout] for name, layout in LAYOUTS.items()}, nproc=4)
    assert set(runs) == set(LAYOUTS), f"failed: {set(LAYOUTS) - set(runs)}"
    for run in runs.values():
        assert_matches(reference, run, tolerance=tolerance, metrics=("loss", "grad_norm", "val_loss"))
