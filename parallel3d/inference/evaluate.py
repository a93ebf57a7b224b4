"""Held-out evaluation: the mean token loss over fixed batches, forward only, in every layout.

The eval batches are the first ``eval.batches`` global batches of the held-out windows in the
sampler's seeded order (a pure function of the seed), split over data-parallel ranks exactly like
training batches, so every layout averages the same tokens. Under pipeline parallelism the
pipeline's forward-only path (``Pipeline.forward_only``: the schedule's ``eval``) runs the micro
batches through the stages; the document ids and positions travel to every stage as the
schedule's per-micro-batch keyword inputs, as in training.

``open_evaluator`` builds it from a run's config, for training and for parallel3d-evaluate alike:
the held-out data read as training reads it (instruction records rendered into rows of
``train.seq_len + 1`` tokens with their trained-token flags, parallel3d/data/sft.py), so a
checkpoint evaluated later gives the val_loss its run logged.
"""

from __future__ import annotations

import contextlib
import math
import sys

import numpy as np
import torch

from parallel3d.data import BatchSpec, StepSampler, Workers, open_eval_corpus
from parallel3d.data.checks import check_heldout
from parallel3d.progress import Progress
from parallel3d.step import Setup, loss_parallel_context, rank_batch, reduce_loss, whole_loss


class Evaluator:
    """When to evaluate (every ``eval.every`` steps and at the last step) and how."""

    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, eval_cfg, last_step: int,
                 flags: np.ndarray | None = None, packed: bool = True, progress: Progress | None = None):
        """``flags``: held-out instruction rows (parallel3d/data/sft.py), evaluated on their trained
        targets. ``progress``: a bar over the batches on rank 0's terminal (a long evaluation)."""
        self.sampler = StepSampler(tokens, spec, seed, flags=flags, packed=packed)
        self.batches, self.every, self.last_step = eval_cfg.batches, eval_cfg.every, last_step
        self.progress = progress or Progress(enabled=False)

    def due(self, step: int) -> bool:
        return step == self.last_step or bool(self.every and step % self.every == 0)

    @torch.no_grad()
    def evaluate(self, setup: Setup, done: str | None = None) -> dict[str, float]:
        """``val_loss`` (mean token cross entropy over the eval batches) and ``val_perplexity``,
        the same on every rank. The loss is training's: a sum over a micro batch divided by the
        trained targets of a global batch per data-parallel x context-parallel rank. ``done``: a
        line for rank 0 to print when it is over (Progress.counter)."""
        total = torch.zeros((), device=setup.device)
        with self.progress.counter("evaluating", "batch", done=done) as update:
            for batch in range(1, self.batches + 1):
                setup.loss_fn.set_trained_tokens(self.sampler.trained_tokens(batch))
                total += _batch_loss(setup, self.sampler.micro_batches(batch))
                update(batch)
        _reshard(setup.model)
        val_loss = reduce_loss(setup.meshes, total).item() / self.batches
        return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss)}


def open_evaluator(c, spec: BatchSpec, workers: Workers, progress: Progress | None = None) -> Evaluator | None:
    """The evaluation of run config ``c`` (a Config), or None when it holds out nothing
    (``eval.sources`` empty and no ``eval.fraction`` of ``data.sources``). The held-out data is
    tokenized on first use, as training data is, and refused when it is shorter than one batch."""
    held_out = open_eval_corpus(c.data, c.eval, workers, seq_len=c.train.seq_len)
    if held_out is None:
        return None
    check_heldout(held_out, seq_len=c.train.seq_len, global_batch_size=c.train.global_batch_size, eval_cfg=c.eval)
    return Evaluator(held_out.tokens, spec, c.train.seed, c.eval, c.train.steps, held_out.flags, c.data.packing,
                     progress)


def _batch_loss(s: Setup, micro_batches) -> torch.Tensor:
    """This rank's loss on its share of one global batch (forward only; the caller disables grad).
    Each micro batch is prepared as training prepares it (``setup.rank_batch``: device, document
    inputs, the context-parallel share); under pp the pipeline runs them (``Pipeline.forward_only``)."""
    vocab_parallel = loss_parallel_context if s.meshes.tp is not None else contextlib.nullcontext
    loss_sum = torch.zeros((), device=s.device)
    with vocab_parallel():
        if s.pipeline is not None:
            for loss in s.pipeline.forward_only(micro_batches, lambda *batch: rank_batch(s, *batch)):
                loss_sum += whole_loss(loss)
            return loss_sum
        for micro_batch in micro_batches:
            inputs, targets, extra = rank_batch(s, *micro_batch)
            loss_sum += whole_loss(s.loss_fn(s.model(inputs, **extra), targets))
    return loss_sum


def _reshard(model: torch.nn.Module) -> None:
    """Put FSDP's sharded parameters back: a forward without backward leaves the root (and, with
    reshard_after_forward=False, every unit) holding its unsharded parameters, which are then the
    modules' registered parameters, not the optimizer's (a checkpoint saved next would miss them)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # never imported: nothing was sharded
    for module in model.modules() if fsdp is not None else ():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()

