"""Hydra entry point and the training loop.

    python -m parallel3d.train [recipe=NAME] [key=value ...]              # one process
    torchrun --nproc-per-node N -m parallel3d.train [recipe=NAME] ...     # N ranks
    parallel3d-run --nproc-per-node N [recipe=NAME] ...                   # validates once, then torchrun

Data flow: compose -> validate (before any process group) -> mesh -> model on meta ->
parallelize -> materialize + deterministic init -> data on the dp view -> loop -> metrics.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel3d.checkpoint import Checkpointer, TrainState, save_full_model
from parallel3d.config import CONF_DIR, Config, register_configs
from parallel3d.base import ConfigError, resolve_device, world_size_from_env
from parallel3d.data import StepSampler, open_corpus
from parallel3d.metrics import MetricsLogger, max_memory_bytes, model_state_bytes, peak_flops, start_wandb
from parallel3d.models import Transformer, flops_per_token, num_params
from parallel3d.progress import Progress
from parallel3d.setup import Setup, build_setup, train_step
from parallel3d.validate import check


class TrainingDiverged(RuntimeError):
    pass


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank0_dir(path: str) -> str:
    """Hydra's output dir on rank 0; a scratch dir on other ranks (rank 0 shares its run_dir)."""
    return path if rank() == 0 else os.path.join(tempfile.gettempdir(), f"parallel3d-rank{rank()}")


def init_distributed(train, world_size: int) -> torch.device:
    if resolve_device(train.device) == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=train.dist_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device


def warn_about_restarts() -> None:
    """Under plain ``torchrun --max-restarts`` (torch >= 2.5) a restarted group reads its dead
    predecessor's addresses from the shared rendezvous store and fails (pytorch#135712)."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("parallel3d: warning: torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: "
              "restarts after a failure cannot connect (pytorch#135712). Launch with parallel3d-run, or "
              "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun", file=sys.stderr, flush=True)


def shared_run_dir(run_dir: str) -> Path:
    """Every rank writes under rank 0's run_dir (ranks may disagree on Hydra's timestamp)."""
    if dist.is_initialized():
        box = [run_dir]
        dist.broadcast_object_list(box, src=0)
        run_dir = box[0]
    path = Path(run_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def train(cfg: DictConfig) -> Path:
    """Train as ``cfg`` says; returns the run directory. Raises ConfigError before any process group."""
    world_size = world_size_from_env()
    cfg = check(cfg, world_size)  # resolved: dp_shard and zero_stage concrete
    device = init_distributed(cfg.train, world_size)
    is_rank0 = rank() == 0
    torch.manual_seed(cfg.train.seed + rank())  # the global RNG (checkpointed), reproducible per rank
    if is_rank0:
        warn_about_restarts()
    run_dir = shared_run_dir(str(cfg.run_dir))
    cfg.run_dir = str(run_dir)
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if is_rank0:
        (run_dir / "config.yaml").write_text(config_yaml)
    c: Config = OmegaConf.to_object(cfg)

    setup = build_setup(c, device)
    progress = Progress(enabled=is_rank0)  # bars on a terminal, plain lines otherwise
    checkpointer = Checkpointer(run_dir, c.checkpoint, timedelta(seconds=c.train.dist_timeout_s), progress=progress)
    state = TrainState(setup.parts, setup.optimizer, setup.scheduler)
    start_step, data_offset = restore(checkpointer, state, c, is_rank0)
    if c.checkpoint.create_seed:
        save_seed(checkpointer, setup, config_yaml, is_rank0)
        return run_dir
    sampler = StepSampler(load_corpus(c.data, is_rank0).tokens, setup.spec, c.train.seed, offset=data_offset)
    wandb_run = start_wandb(c.logging.wandb, run_dir, OmegaConf.to_container(cfg, resolve=True),
                            resumed=start_step > 0) if is_rank0 and c.logging.wandb.enabled else None
    logger = MetricsLogger(run_dir, c.train.steps, is_rank0, wandb_run, resumed_at=start_step, progress=progress)
    loop = TrainLoop(setup, sampler, checkpointer, state, logger, progress, config_yaml)
    if is_rank0:
        print_banner(c, setup, world_size, run_dir)
    loop.run(start_step)
    if c.train.save_model:
        save_full_model(setup.parts, setup.meshes.pp, run_dir / "model.safetensors", is_rank0)
    return run_dir


def load_corpus(data, is_rank0: bool):
    """Rank 0 tokenizes the corpus (once, into the cache); the others then read its cache."""
    if is_rank0:
        corpus = open_corpus(data)
    if dist.is_initialized():
        dist.barrier()
    return corpus if is_rank0 else open_corpus(data)


def save_seed(checkpointer: Checkpointer, setup: Setup, config_yaml: str, is_rank0: bool) -> None:
    """checkpoints/step_0: the initial weights, for every later layout to start from."""
    checkpointer.save(0, TrainState(setup.parts), {"samples_seen": 0}, config_yaml)
    checkpointer.wait()
    if is_rank0:
        print(f"parallel3d: seed checkpoint written to {checkpointer.root / 'step_0'}", flush=True)


def print_banner(c: Config, setup: Setup, world_size: int, run_dir: Path) -> None:
    with torch.device("meta"):  # the whole model's size, whatever part of it this rank holds
        size = num_params(Transformer(c.model))
    print(f"parallel3d | {c.recipe or 'custom'} | model {c.model.name} {size / 1e6:.2f}M params | "
          f"{world_size} ranks {setup.dims.sizes()} zero_stage {c.parallel.zero_stage} | {setup.device.type} | "
          f"run_dir {run_dir}", flush=True)


class TrainLoop:
    """The loop over optimizer steps. Extension points: ``step`` is one step's body (data in,
    loss and gradient norm out); ``after_step`` holds what follows it (metrics, checkpoints), in
    order. Work around the whole loop (signals, locks) wraps ``run``."""

    def __init__(self, setup: Setup, sampler: StepSampler, checkpointer: Checkpointer, state: TrainState,
                 logger: MetricsLogger, progress: Progress, config_yaml: str):
        self.setup, self.sampler, self.checkpointer, self.state = setup, sampler, checkpointer, state
        self.logger, self.progress, self.config_yaml = logger, progress, config_yaml
        self.meter = StepMeter(setup)
        self.after_step: list[Callable[[int, torch.Tensor, torch.Tensor, float], None]] = [
            self.log_metrics, self.save_checkpoint]

    def run(self, start_step: int) -> None:
        steps = self.setup.config.train.steps
        self.progress.start(steps, done=start_step)
        for step in range(start_step + 1, steps + 1):
            self.checkpointer.poll()
            lr = self.setup.scheduler.get_last_lr()[0]
            loss_sum, grad_norm = self.step(step)
            self.progress.update(step)
            for action in self.after_step:
                action(step, loss_sum, grad_norm, lr)
        self.checkpointer.wait()
        self.progress.close()
        self.logger.close()

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, grad_norm = train_step(self.setup, self.sampler.micro_batches(step))
        self.meter.stepped()  # measures the model state while the gradients still exist
        self.setup.model.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def log_metrics(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        c = self.setup.config
        if step % c.logging.log_every and step != c.train.steps:
            return
        loss_value, norm_value = global_loss(self.setup.meshes, loss_sum), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.progress.close()  # end the bar's line before the error message
            raise TrainingDiverged(f"loss is {loss_value} (grad norm {norm_value}) at step {step}: training "
                                   f"diverged. Lower optim.lr, raise optim.warmup_steps or set train.grad_clip")
        self.logger.log({"step": step, "loss": loss_value, "grad_norm": norm_value, "lr": lr, **self.meter.read()})

    def save_checkpoint(self, step: int, *_) -> None:
        c = self.setup.config
        every = c.checkpoint.every
        if every and (step % every == 0 or step == c.train.steps):
            layout = {**self.setup.dims.sizes(), "zero_stage": c.parallel.zero_stage,
                      "pp_schedule": c.parallel.pp_schedule}
            self.checkpointer.save(step, self.state, {"samples_seen": self.sampler.samples_seen(step), "layout": layout,
                                                      "global_batch_size": c.train.global_batch_size}, self.config_yaml)


def global_loss(meshes, loss_sum: torch.Tensor) -> float:
    """The step's loss over the global batch: the last pipeline stage's, averaged over dp."""
    loss = loss_sum.clone()
    if meshes.pp is not None:  # only the last stage computed a loss
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=meshes.pp.get_group())
    if meshes.dp is not None:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=meshes.dp.get_group())
    return loss.item()


class StepMeter:
    """Throughput, MFU and memory since the last read, the largest rank's memory over the world."""

    def __init__(self, setup: Setup):
        self.setup = setup
        t = setup.config.train
        self.global_tokens = t.global_batch_size * t.seq_len
        self.flops = flops_per_token(setup.config.model, t.seq_len)
        self.peak = peak_flops(setup.device, t.param_dtype)
        self.state_bytes: dict[str, int] = {}
        self.since, self.steps = time.perf_counter(), 0

    def stepped(self) -> None:
        if not self.state_bytes:  # the first step (of this process): the optimizer state now exists
            self.state_bytes = model_state_bytes(self.setup.model, self.setup.optimizer)
        self.steps += 1

    def read(self) -> dict:
        elapsed = time.perf_counter() - self.since
        step_time, tokens_per_sec = elapsed / self.steps, self.global_tokens * self.steps / elapsed
        self.since, self.steps = time.perf_counter(), 0
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
                "max_memory_bytes": memory[0], **dict(zip(self.state_bytes, memory[1:]))}


def restore(checkpointer: Checkpointer, state: TrainState, c: Config, is_rank0: bool) -> tuple[int, int]:
    """Resume (or load initial weights) as checkpoint.* says: the step done, and the data offset."""
    checkpointer.remove_incomplete()
    path = checkpointer.resume_from()
    if path is not None:
        meta = checkpointer.load(path, state)
        if is_rank0:
            print(f"parallel3d: resumed from {path} (saved at {meta['layout']})", flush=True)
        if meta["model_only"]:  # a seed checkpoint: its weights, then a fresh start
            return 0, 0
        return meta["step"], meta["samples_seen"] - meta["step"] * c.train.global_batch_size
    if c.checkpoint.init_from:
        checkpointer.load_weights(Path(c.checkpoint.init_from).expanduser(), state, c.model)
    return 0, 0


def output_dir_is_run_dir(argv: list[str]) -> list[str]:
    """With a literal ``run_dir=PATH`` and no ``hydra.run.dir``, make PATH Hydra's output dir as
    well: Hydra creates its run dir whatever run_dir says, leaving empty outputs/DATE/TIME folders."""
    from parallel3d.launch.run import run_dir_override
    from parallel3d.launch.sweep import MULTIRUN_FLAGS, key_of

    given = [a.split("=", 1)[1] for a in argv[1:] if key_of(a) == "run_dir"]
    if not given or "${" in given[-1] or any(key_of(a) == "hydra.run.dir" or a in MULTIRUN_FLAGS for a in argv):
        return argv
    return [*argv, run_dir_override(given[-1])]


def refuse_multirun_under_torchrun() -> None:
    """Hydra's --multirun runs every job in the process that parsed it: one process, not a
    torchrun group (each rank would sweep on its own, re-forming its process group per job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if world_size_from_env() > 1 and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("--multirun", "under torchrun", "Hydra runs a sweep inside one process",
                          "sweep with `parallel3d-run --nproc-per-node N --multirun ...` (one torchrun per job)")


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        refuse_multirun_under_torchrun()
        train(cfg)
    except (ConfigError, TrainingDiverged) as e:
        if rank() == 0:
            kind = "config error" if isinstance(e, ConfigError) else "training stopped"
            print(f"parallel3d: {kind}: {e}", file=sys.stderr, flush=True)
        else:  # torchrun kills the other ranks when one exits: let rank 0 say why first
            time.sleep(2)
        sys.exit(2 if isinstance(e, ConfigError) else 3)
    else:
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    register_configs()
    OmegaConf.register_new_resolver("p3d.rank0_dir", rank0_dir, replace=True)
    sys.argv = output_dir_is_run_dir(sys.argv)
    _hydra_main()
    if world_size_from_env() > 1:
        # The run is complete and its process group destroyed. gloo can still abort the process
        # in C++ static destructors ("terminate called without an active exception"), which
        # torchrun reports as a failed run (and --max-restarts would restart); skip them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
