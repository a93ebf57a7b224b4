"""Hydra entry point and the training loop.

    python -m parallel3d.train [recipe=NAME] [key=value ...]              # one process
    torchrun --nproc-per-node N -m parallel3d.train [recipe=NAME] ...     # N ranks
    parallel3d-run --nproc-per-node N [recipe=NAME] ...                   # validates once, then torchrun

Data flow: compose -> validate (before any process group) -> mesh -> model on meta ->
parallelize -> materialize + deterministic init -> data on the dp view -> loop -> metrics.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel3d.base import ConfigError, is_checkpoint_exception, rank, world_size_from_env
from parallel3d.checkpoint.checkpointer import Checkpointer, full_model_state
from parallel3d.checkpoint.resume import load_verified, restore
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.compose import CONF_DIR, register_configs, user_set_keys
from parallel3d.config.hf_folder import apply_hf_folder
from parallel3d.config.schema import Config
from parallel3d.config.strict import RecipeError
from parallel3d.data import Prefetcher, StepSampler, Workers, build_train_data
from parallel3d.data.checks import check_corpus
from parallel3d.data.tokenizer import tokenizer_hash
from parallel3d.ft.replica import ReplicaGroup, join_replicas
from parallel3d.hf.export import save_run_model
from parallel3d.hf.lora import merged_state, save_run_adapter, split_adapters
from parallel3d.inference.evaluate import Evaluator, open_evaluator
from parallel3d.observe.banner import print_banner
from parallel3d.observe.meter import StepMeter
from parallel3d.observe.metrics import MetricsLogger, start_tensorboard, start_wandb
from parallel3d.observe.profiling import StepProfiler
from parallel3d.parallel.expert import expert_metrics
from parallel3d.parallel.float8 import precompute_float8_scales
from parallel3d.progress import Progress
from parallel3d.runtime import watchdog
from parallel3d.runtime.failures import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_REQUEUE, SweepFailures, ensure_rank_log,
                                         exit_if_stopped_before, note_stopped, report_failure, warnings_to_log)
from parallel3d.runtime.guard import BadStepGuard, TrainingDiverged
from parallel3d.runtime.process_group import init_distributed, report_hangs_in
from parallel3d.runtime.rundir import (agree_on_run_dir, output_dir_is_run_dir, own_run_dir, register_rank0_dir,
                                       release_run_dir, unwritable_run_dir)
from parallel3d.runtime.signals import Interrupted, Stopped, StopSignals, interruptible, resume_command
from parallel3d.step import Setup, build_setup, reduce_loss, train_step
from parallel3d.validate import check

SWEEP_FAILURES = SweepFailures()


def train(cfg: DictConfig) -> Path:
    """Train as ``cfg`` says; returns the run directory. Raises ConfigError before any process group."""
    world_size = world_size_from_env()
    cfg = apply_hf_folder(cfg, user_set_keys(command_line()))  # checkpoint.init_from=HF_DIR defines the model
    cfg = check(cfg, world_size)  # resolved: dp_shard and zero_stage concrete
    device = init_distributed(cfg.train, world_size)
    is_rank0 = rank() == 0
    torch.manual_seed(cfg.train.seed + rank())  # the global RNG (checkpointed), reproducible per rank
    run_dir = agree_on_run_dir(str(cfg.run_dir))
    cfg.run_dir = str(run_dir)
    own_run_dir(run_dir, fresh_start=cfg.checkpoint.resume == "none")  # released by run_job
    report_hangs_in(run_dir)
    if not is_rank0:  # rank 0 shows each warning once; the others' go to run_dir/logs/rank<N>.log
        warnings_to_log(ensure_rank_log(run_dir, rank()))
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if is_rank0:
        (run_dir / "config.yaml").write_text(config_yaml)
    c: Config = OmegaConf.to_object(cfg)

    setup = build_setup(c, device)
    progress = Progress(enabled=is_rank0)  # bars on a terminal, plain lines otherwise
    checkpointer = Checkpointer(run_dir, c.checkpoint, timedelta(seconds=c.train.dist_timeout_s), progress=progress)
    state = TrainState(setup.parts, setup.optimizer, setup.scheduler)
    guard = BadStepGuard.for_run(c.train, c.debug)
    start = restore(checkpointer=checkpointer, state=state, c=c, announce=is_rank0, config_yaml=config_yaml)
    guard.load_state_dict(start.guard)
    start_step, data_offset = start.step, start.data_offset
    if c.checkpoint.create_seed:
        save_seed(checkpointer, setup, config_yaml, is_rank0)
        return run_dir
    # Ranks split the tokenization of data.sources (or rank 0 builds the default corpus), then wait.
    workers = Workers(rank(), world_size, dist.barrier if dist.is_initialized() else None)
    with interruptible("preparing the data"):
        corpus, sampler = build_train_data(c.data, c.eval, setup.spec, c.train.seed, data_offset, workers)
        check_corpus(corpus, c.train.seq_len, c.data)
        evaluator = open_evaluator(c, setup.spec, workers, progress)  # parallel3d-evaluate builds it alike
    wandb_run = start_wandb(c.logging.wandb, run_dir, OmegaConf.to_container(cfg, resolve=True),
                            resumed=start_step > 0) if is_rank0 and c.logging.wandb.enabled else None
    tensorboard = start_tensorboard(run_dir, start_step) if is_rank0 and c.logging.tensorboard else None
    logger = MetricsLogger(run_dir, c.train.steps, is_rank0, wandb_run, resumed_at=start_step, progress=progress,
                           tensorboard=tensorboard)
    replicas = join_replicas(c, run_dir, train=state, guard=guard, sampler=sampler, start_step=start_step,
                             device=device) if c.ft.enabled else None  # fault tolerance across groups
    loop = TrainLoop(setup, sampler, checkpointer, state, logger, progress, config_yaml, evaluator, guard, replicas)
    if is_rank0:
        print_banner(c, setup, world_size, run_dir)
    try:
        loop.run(start_step)
    finally:
        if replicas is not None:
            replicas.close()
    if c.train.save_model:
        save_final_model(c, setup, run_dir, is_rank0)
    return run_dir


def save_final_model(c: Config, setup: Setup, run_dir: Path, is_rank0: bool) -> None:
    """train.save_model: run_dir/hf/ (and, with LoRA, PEFT's adapter folder run_dir/hf_adapter/)."""
    state = full_model_state(setup.parts, setup.meshes.pp)  # a collective: every rank
    if is_rank0 and c.model.lora.rank:  # the adapters in PEFT's format, and merged into the weights
        print(save_run_adapter(run_dir, split_adapters(state)[1], c.model, c.checkpoint.init_from or None),
              flush=True)
        state = merged_state(state, c.model.lora)
    if is_rank0:
        print(save_run_model(run_dir, state, model_cfg=c.model, tokenizer=c.data.tokenizer,
                             chat_template=c.data.chat_template), flush=True)


def save_seed(checkpointer: Checkpointer, setup: Setup, config_yaml: str, is_rank0: bool) -> None:
    """checkpoints/step_0: the initial weights, for every later layout to start from."""
    checkpointer.save(0, TrainState(setup.parts), {"samples_seen": 0}, config_yaml)
    checkpointer.wait()
    if is_rank0:
        print(f"parallel3d: seed checkpoint written to {checkpointer.root / 'step_0'}", flush=True)


def planned_peaks(setup: Setup) -> list[int]:
    """The planner's peak bytes of each pipeline rank (profile.memory compares them with the measured)."""
    from parallel3d.planner import predict

    return [r.peak_bytes for r in predict(setup.config, setup.dims.world_size).ranks]


class TrainLoop:
    """The loop over optimizer steps. Extension points: ``step`` is one step's body (data in,
    loss and gradient norm out); ``after_step`` holds what follows it (metrics, checkpoints), in
    order. Work around the whole loop (signals, locks) wraps ``run``."""

    def __init__(self, setup: Setup, sampler: StepSampler, checkpointer: Checkpointer, state: TrainState,
                 logger: MetricsLogger, progress: Progress, config_yaml: str, evaluator: Evaluator | None = None,
                 guard: BadStepGuard | None = None, replicas: ReplicaGroup | None = None):
        self.setup, self.sampler, self.checkpointer, self.state = setup, sampler, checkpointer, state
        self.replicas = replicas  # ft.enabled: the quorum of replica groups (parallel3d/ft/)
        self.guard = guard or BadStepGuard.for_run(setup.config.train, setup.config.debug)
        self.logger, self.progress, self.config_yaml = logger, progress, config_yaml
        self.meter = StepMeter(setup, warn=progress.write)
        self.profiler = StepProfiler(setup.config, Path(setup.config.run_dir), rank(), setup.dims.world_size,
                                     setup.device, say=progress.write, planned_peaks=lambda: planned_peaks(setup))
        self.tokenizer = tokenizer_hash(setup.config.data.tokenizer)  # in each checkpoint: a resume must match it
        self.evaluator, self.evaluation = evaluator, {}
        self.after_step: list[Callable[[int, torch.Tensor, torch.Tensor, float], None]] = [
            self.evaluate, self.log_metrics, self.save_checkpoint]

    def run(self, start_step: int) -> None:
        t = self.setup.config.train
        self.progress.start(t.steps, done=start_step)
        # SIGTERM/SIGUSR1 (preemption) and Ctrl-C: finish the step, save, exit to be requeued.
        stop = StopSignals.for_run(self.checkpointer.root, rank() == 0, timedelta(seconds=t.dist_timeout_s)).install()
        self.batches = Prefetcher(self.sampler, start_step + 1, t.steps)  # the next step's, while this one runs
        step = start_step
        while step < t.steps:
            step += 1
            if self.replicas is not None:  # a heal moves this group to its live peers' step
                step = self.join_quorum()
            watchdog.mark(step)  # a stall from here on is named when a collective times out
            self.checkpointer.poll()
            lr = self.setup.scheduler.get_last_lr()[0]
            self.profiler.step_begins(step)
            try:
                loss_sum, grad_norm = self.step(step)
            except torch.cuda.OutOfMemoryError as e:  # dumps the allocator's snapshot when profile.memory says
                raise self.profiler.out_of_memory(step) from e
            if self.replicas is not None and not self.replicas.committed:  # discarded by every group: again
                step -= 1
                continue
            if self.guard.rollback_due:  # train.max_bad_steps bad steps in a row (every rank agrees)
                step = self.roll_back(step)
                continue
            self.progress.update(step)
            for action in self.after_step:
                action(step, loss_sum, grad_norm, lr)
            with self.meter.paused():  # writing a trace is not training
                self.profiler.step_ends(step)
            if stop.should_stop(step):  # every rank agrees (one tiny all_reduce per step)
                self.save_checkpoint(step, force=True)
                self.checkpointer.wait()
                self.progress.close()
                raise Stopped(step, self.checkpointer.root / f"step_{step}", stop.received)
        stop.restore()
        self.batches.close()
        self.checkpointer.wait()
        self.progress.close()
        self.logger.close()

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        micro_batches, waited = self.batches.get(step)
        self.meter.start()
        self.guard.begin(step)
        loss_sum, grad_norm, expert_loads = train_step(self.setup, micro_batches, guard=self.guard,  # may skip the update
                                                       trained_tokens=self.sampler.trained_tokens(step),
                                                       replicas=self.replicas)
        self.moe_stats = expert_metrics(expert_loads, dp=self.setup.dims.dp)  # {} for a dense model
        self.meter.stepped(waited)  # measures the model state while the gradients still exist
        self.setup.optimizer.zero_grad(set_to_none=True)  # every trainable parameter, without walking the modules
        return loss_sum, grad_norm

    def join_quorum(self) -> int:
        """ft.enabled: the step's quorum; after a heal or a discarded step the batches restart at the step."""
        step = self.replicas.begin()
        if self.replicas.healed_from is not None or step != self.batches.next_step:
            self.batches.close()
            self.batches = Prefetcher(self.sampler, step, self.setup.config.train.steps)
        return step

    def evaluate(self, step: int, *_) -> None:
        """val_loss on the held-out batches when eval.every says (and at the last step)."""
        self.evaluation = {}
        if self.evaluator is None or not self.evaluator.due(step):
            return
        start, s = time.perf_counter(), self.setup
        self.evaluation = self.evaluator.evaluate(s)
        self.meter.since += time.perf_counter() - start  # step time and throughput count training only

    def log_metrics(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        c, guard = self.setup.config, self.guard
        if guard.skipped:  # a skipped step is always logged, and said once on the console
            self.progress.write(f"parallel3d: step {step} skipped: {guard.reason} (train.on_bad_step=skip; "
                                f"{guard.skipped_steps} skipped so far)")
        elif step % c.logging.log_every and step != c.train.steps and not self.evaluation:
            return
        loss_value, norm_value = reduce_loss(self.setup.meshes, loss_sum).item(), grad_norm.item()
        self.logger.log({"step": step, "loss": loss_value, "grad_norm": norm_value, "lr": lr, **self.meter.read(step),
                         "skipped": guard.skipped, "skipped_steps": guard.skipped_steps,
                         **self.sampler.tokens_consumed(step), **self.sampler.batch_fill(step), **self.evaluation, **self.moe_stats})

    def save_checkpoint(self, step: int, *_, force: bool = False) -> None:
        c = self.setup.config
        every = c.checkpoint.every
        if self.guard.skipped and not force and step != c.train.steps:
            return  # a rollback's target must come from before a run of bad steps
        if self.replicas is not None and not self.replicas.writes_checkpoints:
            return  # one replica group writes the persistent checkpoint
        if force or (every and (step % every == 0 or step == c.train.steps)):
            layout = {**self.setup.dims.sizes(), "zero_stage": c.parallel.zero_stage,
                      "pp_schedule": c.parallel.pp_schedule}
            self.checkpointer.save(step, self.state, {"samples_seen": self.sampler.samples_seen(step), "layout": layout,
                                                      "global_batch_size": c.train.global_batch_size,
                                                      "tokenizer": self.tokenizer, "guard": self.guard.state_dict()}, self.config_yaml)

    def roll_back(self, step: int) -> int:
        """After train.max_bad_steps bad steps in a row up to ``step``: the newest checkpoint's state,
        and from its step on the data after ``step`` (the data position is saved with the next
        checkpoint, the rollback in its meta.json: a resume continues the same tokens). Returns the
        checkpoint's step; raises TrainingDiverged when there is none, or it was rolled back to before."""
        c = self.setup.config
        self.batches.close()
        self.checkpointer.wait()
        found = load_verified(checkpointer=self.checkpointer, state=self.state, resume="auto",
                              verify=c.checkpoint.verify, announce=rank() == 0)
        meta = found[1] if found is not None else None
        if meta is None or meta["model_only"]:
            raise self.guard.nothing_to_roll_back_to(at_step=step, every=c.checkpoint.every)
        if c.train.float8_fsdp_all_gather:  # the loaded weights' float8 scales, not the abandoned ones'
            precompute_float8_scales([self.setup.model])
        to_step = meta["step"]
        line = self.guard.rolled_back(at_step=step, to_step=to_step, global_batch_size=c.train.global_batch_size)
        self.sampler.offset = self.sampler.samples_seen(step) - to_step * c.train.global_batch_size
        self.logger.rewind(to_step)
        self.progress.update(to_step)
        self.progress.write(line)
        self.batches = Prefetcher(self.sampler, to_step + 1, c.train.steps)
        return to_step


def command_line() -> list[str]:
    """This run's command-line overrides (none outside a Hydra run: config.compose applied them)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


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
    with SWEEP_FAILURES.job():  # a failed job of a one-process Hydra --multirun: noted, the sweep goes on
        run_job(cfg)


def run_job(cfg: DictConfig) -> None:
    """One run, every way it can end: done, a config error, divergence, a stop signal (requeue), or
    a failure (one line here, the traceback in run_dir/logs; see failures.py)."""
    exit_if_stopped_before(_known_run_dir(cfg), rank())  # torchrun --max-restarts: nothing to retry
    try:
        refuse_multirun_under_torchrun()
        train(cfg)
    except (ConfigError, TrainingDiverged) as e:
        if rank() == 0:
            kind = "config error" if isinstance(e, ConfigError) else "training stopped"
            print(f"parallel3d: {kind}: {e}", file=sys.stderr, flush=True)
            note_stopped(_known_run_dir(cfg), code=2 if isinstance(e, ConfigError) else 3, line=f"{kind}: {e}")
        else:  # torchrun kills the other ranks when one exits: let rank 0 say why first
            time.sleep(2)
        sys.exit(2 if isinstance(e, ConfigError) else 3)
    except (Stopped, Interrupted) as e:
        if rank() == 0:  # the command with its run_dir: without it a new start makes a new folder
            resume = resume_command(overrides=command_line(), run_dir=_known_run_dir(cfg))
            print(f"parallel3d: {e}; resume with: {resume}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REQUEUE)
    except KeyboardInterrupt:  # a second Ctrl-C
        sys.exit(EXIT_INTERRUPTED)
    except BaseException as e:  # an Exception, or DCP's CheckpointException (a BaseException)
        if not (isinstance(e, Exception) or is_checkpoint_exception(e)):
            raise
        report_failure(watchdog.explain(e), _known_run_dir(cfg), rank())  # a hang: names the rank
        if rank() != 0:
            time.sleep(2)
        sys.exit(EXIT_FAILED)
    else:
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        watchdog.stop()
        release_run_dir(_known_run_dir(cfg))
        if dist.is_initialized():
            dist.destroy_process_group()


def _known_run_dir(cfg: DictConfig) -> str | None:
    try:
        return str(cfg.run_dir)
    except Exception:  # an interpolation that cannot resolve: no run_dir to write to
        return None


def main() -> None:
    try:
        register_configs(sys.argv[1:])
    except RecipeError as e:
        print(f"parallel3d: config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    register_rank0_dir()
    problem = unwritable_run_dir(sys.argv)
    if problem:
        print(f"parallel3d: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    sys.argv = output_dir_is_run_dir(sys.argv)
    _hydra_main()
    SWEEP_FAILURES.exit_if_any()
    if world_size_from_env() > 1:
        # The run is complete and its process group destroyed. gloo can still abort the process
        # in C++ static destructors ("terminate called without an active exception"), which
        # torchrun reports as a failed run (and --max-restarts would restart); skip them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
