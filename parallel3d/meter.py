"""What a step measures: throughput, MFU and memory since the last logged step."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel3d.metrics import max_memory_bytes, model_state_bytes, peak_flops
from parallel3d.models import flops_per_token
from parallel3d.step import Setup


class StepMeter:
    """Throughput, MFU and memory since the last read, the largest rank's memory over the world."""

    def __init__(self, setup: Setup):
        self.setup = setup
        t = setup.config.train
        self.global_tokens = t.global_batch_size * t.seq_len
        self.flops = flops_per_token(setup.config.model, t.seq_len)
        self.peak = peak_flops(setup.device, t.param_dtype)
        self.state_bytes: dict[str, int] = {}
        self.since, self.steps, self.data_wait_s = time.perf_counter(), 0, 0.0

    def stepped(self, data_wait_s: float) -> None:
        if not self.state_bytes:  # the first step (of this process): the optimizer state now exists
            self.state_bytes = model_state_bytes(self.setup.model, self.setup.optimizer)
        self.steps += 1
        self.data_wait_s += data_wait_s

    def read(self) -> dict:
        elapsed = time.perf_counter() - self.since
        step_time, tokens_per_sec = elapsed / self.steps, self.global_tokens * self.steps / elapsed
        data_wait_s = self.data_wait_s / self.steps  # time a step waited for its batches
        self.since, self.steps, self.data_wait_s = time.perf_counter(), 0, 0.0
        device = self.setup.device
        per_rank_max = torch.tensor([max_memory_bytes(device), *self.state_bytes.values()], dtype=torch.float64,
                                    device=device)  # NCCL reduces device tensors only
        world_size = 1
        if dist.is_initialized():  # the largest rank is what has to fit
            dist.all_reduce(per_rank_max, op=dist.ReduceOp.MAX)
            world_size = dist.get_world_size()
        memory = [int(v) for v in per_rank_max.tolist()]
        return {"tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
                "mfu": tokens_per_sec * self.flops / (self.peak * world_size) if self.peak else None,
                "max_memory_bytes": memory[0], **dict(zip(self.state_bytes, memory[1:])), "data_wait_s": data_wait_s}
