"""One replica group's side of fault tolerance: torchft's Manager, per step.

Each rank of the group runs a Manager (the group's rank 0 also runs its ManagerServer, which speaks
for the group to the lighthouse). Every step: ``begin`` asks for the quorum (synchronously, so a
group that is behind heals from a live peer before its forward: ``heal_state`` over torchft's HTTP
transport, rank k from the peer's rank k), then sums the roster (membership.py) over the quorum;
``average_gradients`` averages this rank's gradient shards, after the group's own reduction, with
the same rank of every other group in one flat all-reduce of torchft's reconfigurable process group
(gloo; NCCL on CUDA);
``commit`` is torchft's two-phase vote: a step any participant failed (an all-reduce error, a
peer gone, too few groups) is discarded by all and trained again. A group that was behind and
voted differently heals at the next quorum (the quorum's highest step wins). Under
``ft.semi_sync=diloco`` the quorum comes once a period and ``after_update`` does the sync
(diloco.py); the steps between stay inside the group.

torchft's own wrappers (its DDP, OptimizerWrapper, the FSDP hook torchtitan installs) hook one
module per group; here a step may be pipeline stages or several parts, and the guard and the MoE
routers need the averaged values before the update, so the step calls these hooks itself.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.base import local_tensor
from parallel3d.config.fault_tolerance import lighthouse_address
from parallel3d.ft import FTError
from parallel3d.ft.diloco import OuterStep
from parallel3d.ft.lighthouse import check_reachable
from parallel3d.ft.membership import MembershipLog, Roster, config_fingerprint, roster_row
from parallel3d.ft.state import RunState, apply_heal_state, heal_state, snapshot_state, state_digest


class ReplicaGroup:
    """The hooks the training loop and ``train_step`` call (step.ReplicaSync), for one rank."""

    def __init__(self, c, run_dir: Path, run: RunState, *, group_rank: int, group_size: int, start_step: int,
                 device: torch.device = torch.device("cpu")):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's native side logs every quorum at info
        logging.getLogger("torchft.manager").addFilter(_no_flight_recorder_note)
        ft = c.ft
        self.ft, self.run, self.group_rank, self.device = ft, run, group_rank, device
        self.alone_sleep_s, self.fail_steps = c.debug.ft_alone_sleep_s, set(c.debug.ft_fail_steps)  # test-only
        self.address = lighthouse_address(ft)
        check_reachable(self.address, timeout_s=ft.connect_timeout_s)
        self.manager = self._manager(group_rank, group_size, device)
        # DiLoCo: the groups sync every inner_steps steps; torchft's step counts syncs, not steps
        self.inner_steps = ft.diloco.inner_steps if ft.semi_sync == "diloco" else 0
        self.outer: OuterStep | None = None
        if self.inner_steps:
            params = [q for group in run.train.optimizer.param_groups for q in group["params"]]
            self.outer = OuterStep(params, lr=ft.diloco.outer_lr, momentum=ft.diloco.outer_momentum)
            self.manager.register_state_dict_fn("diloco", self.outer.load_state_dict, self.outer.state_dict)
        self.manager.load_state_dict({"step": start_step // (self.inner_steps or 1), "batches_committed": 0})
        self.last_step = start_step
        self.log = MembershipLog(run_dir, replicas=ft.replicas, global_batch_size=c.train.global_batch_size,
                                 enabled=group_rank == 0)
        self.newcomer, self.healed_from, self.committed = True, None, False
        self.discarded = 0  # attempts at the step to commit next that some group failed
        self.healed_uncommitted = False  # healed since its last commit (a discarded step keeps the mark)
        self.roster: Roster | None = None
        self.ready_at = time.time()  # start-up done: what follows until the first commit is joining

    def _manager(self, group_rank: int, group_size: int, device: torch.device):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        ft, timeout = self.ft, timedelta(seconds=self.ft.timeout_s)
        self._store, host, port = _group_store(group_rank)
        try:
            return Manager(
                pg=(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout),
                load_state_dict=self._load, state_dict=lambda: heal_state(self.run),
                min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
                connect_timeout=timedelta(seconds=ft.connect_timeout_s), rank=group_rank, world_size=group_size,
                store_addr=host, store_port=port, lighthouse_addr=self.address,
                replica_id=f"parallel3d_{ft.replica_id}", init_sync=False)
        except RuntimeError as e:
            raise FTError(f"ft.lighthouse={self.address}: {_first_line(e)}. Fix: start parallel3d-lighthouse "
                          f"first, or raise ft.connect_timeout_s") from None

    # -- the loop's hooks -------------------------------------------------------------------

    def begin(self) -> int:
        """This step's quorum (a heal included) and roster; returns the step to train, which a heal
        moves to the live peers' next. Raises FTError (one line) for a refused group or a lost
        lighthouse."""
        self.healed_from, self.committed = None, False
        if self.inner_steps and self.last_step % self.inner_steps:  # inside a DiLoCo period: no quorum
            self.step = self.last_step + 1
            return self.step
        if self.roster is not None and len(self.roster.participants) < self.ft.replicas:
            time.sleep(self.alone_sleep_s)
        try:
            self.manager.start_quorum()
        except FTError:
            raise
        except Exception as e:  # torchft raises what its quorum RPC raised
            raise self._quorum_failure(e) from None
        self.step = step = self.manager.current_step() * (self.inner_steps or 1) + 1
        summed = roster_row(replicas=self.ft.replicas, replica_id=self.ft.replica_id, newcomer=self.newcomer,
                            healed=self.healed_uncommitted, fingerprint=self.run.fingerprint).to(self.device)
        self.manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM).wait()
        self.roster = None if self.manager.errored() else Roster.read(summed, replicas=self.ft.replicas)
        if self.roster is not None:
            refusal = self.roster.refusal(replica_id=self.ft.replica_id, newcomer=self.newcomer)
            if refusal:
                raise FTError(refusal)
            if not self.roster.clean:  # a refused group is in this quorum: no gradient crosses to it
                self.manager.report_error(RuntimeError("a refused replica group is in the quorum"))
        if self.inner_steps:  # what a failed sync at the period's end goes back to
            self.period_start = snapshot_state(self.run)
        if self.healed_from is not None and self.group_rank == 0:
            print(f"parallel3d: ft: healed from replica group {self.healed_from} at step {step - 1} in "
                  f"{self.heal_s:.2f} s (weights, optimizer, lr schedule, RNG, data position, guard): "
                  f"training on at step {step}", flush=True)
        return step

    @property
    def writes_checkpoints(self) -> bool:
        """Only the quorum's lowest replica id writes the persistent checkpoint (in its own run_dir)."""
        return self.roster is not None and self.roster.participants[:1] == [self.ft.replica_id]

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # -- the step's hooks (step.ReplicaSync) -------------------------------------------------

    @torch.no_grad()
    def average_gradients(self, params: list[torch.Tensor], loss_sum: torch.Tensor) -> None:
        """One flat all-reduce per dtype, with the groups' health (``_mean_with_health``): a failure
        on any group's side discards the step on every group, not only that one."""
        if self.inner_steps:  # DiLoCo's inner steps stay inside the group
            return
        self._mean_with_health([local_tensor(p.grad) for p in params if p.grad is not None] + [loss_sum])

    def average(self, tensor: torch.Tensor) -> None:
        if not self.inner_steps:
            self.manager.allreduce(tensor).wait()

    def commit(self) -> bool:
        if self.inner_steps:  # an inner step: this group's own
            self.committed, self.last_step = True, self.step
            return True
        self.committed = self.manager.should_commit()
        if not self.committed:
            self.discarded += 1
            return False
        self.log.write(self.manager.current_step(), self.roster, self.ft.replica_id, discarded=self.discarded,
                       joined_after_s=round(time.time() - self.ready_at, 3) if self.newcomer else None,
                       state_digests=self._digests() if self.roster.healed else None)
        self.newcomer, self.discarded, self.healed_uncommitted = False, 0, False
        return True

    @torch.no_grad()
    def after_update(self) -> None:
        """DiLoCo, after a period's last inner step: the pseudo-gradients averaged over the quorum
        and the outer step; voted down, every group goes back to the period's start (weights,
        optimizer, schedule, RNG, guard) and trains it again (its log lines say it was dropped;
        the new ones supersede them)."""
        if not self.inner_steps or self.step % self.inner_steps:
            return
        averaged = self.outer.pseudo_gradients()
        self._mean_with_health(averaged)
        synced = self.manager.should_commit() and self.roster is not None
        if synced:
            self.outer.step(averaged)
        else:  # the period again, from its start: torchft's step (the sync count) did not move
            apply_heal_state(self.run, self.period_start)
        first = self.step - self.inner_steps + 1
        roster = self.roster or Roster(participants=[], healed=[], duplicates=[], mismatched=[], reference=None)
        for step in range(first, self.step + 1):
            self.log.write(step, roster, self.ft.replica_id, trained=synced,
                           joined_after_s=round(time.time() - self.ready_at, 3) if self.newcomer and synced else None)
        if synced:
            self.newcomer, self.healed_uncommitted = False, False

    # -- inside ------------------------------------------------------------------------------

    def _digests(self) -> list[str]:
        """Every rank's state digest, in rank order (a collective of the group): at a step someone
        healed, every group logs them before the update, and they must be the same in every group."""
        mine = state_digest(self.run)
        if not dist.is_initialized():
            return [mine]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every

    def _mean_with_health(self, tensors: list[torch.Tensor]) -> None:
        """``tensors`` averaged over the quorum, with each group's health (1: its part is sound) as
        one more element: a group whose side failed (``debug.ft_fail_steps`` injects it) still takes
        part, and every group reads the failure from the average and votes the step (or sync) down."""
        failed = self.step in self.fail_steps
        self.fail_steps.discard(self.step)  # once: the step trained again succeeds
        health = torch.tensor([0.0 if failed else 1.0], device=tensors[-1].device)
        self._mean_over_groups([*tensors, health])
        if health.item() != 1.0:
            self.manager.report_error(RuntimeError(f"a replica group's all-reduce failed at step {self.step}"))

    @torch.no_grad()
    def _mean_over_groups(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor averaged over the quorum's groups in place: one flat all-reduce per dtype."""
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in same])
            self.manager.allreduce(flat).wait()
            for part, t in zip(flat.split([t.numel() for t in same]), same):
                t.copy_(part.view_as(t))

    def _load(self, sent: dict) -> None:
        start = time.perf_counter()
        apply_heal_state(self.run, sent)
        self.healed_from, self.heal_s = sent["replica_id"], time.perf_counter() - start
        self.healed_uncommitted = True

    def _quorum_failure(self, e: Exception) -> FTError:
        if self.newcomer:
            return FTError(f"ft: no quorum from the lighthouse at {self.address} within ft.quorum_timeout_s="
                            f"{self.ft.quorum_timeout_s:g} ({_first_line(e)}). Fix: start enough replica groups "
                            f"for its --min-replicas, or check ft.lighthouse")
        return FTError(f"ft: lost the lighthouse at {self.address}, or fewer groups live than its --min-replicas "
                       f"({_first_line(e)}): no quorum within ft.quorum_timeout_s={self.ft.quorum_timeout_s:g}. Fix: "
                       f"restart parallel3d-lighthouse at that address (or the missing groups) and restart the groups "
                       f"with the same commands")


def join_replicas(c, run_dir: Path, *, train, guard, sampler, start_step: int, device: torch.device) -> ReplicaGroup:
    """This rank's ReplicaGroup for a validated config with ft.enabled (the torchrun job is the group)."""
    run = RunState(train=train, guard=guard, sampler=sampler, fingerprint=config_fingerprint(c),
                   replica_id=c.ft.replica_id, float8_all_gather=c.train.float8_fsdp_all_gather)
    group_size = dist.get_world_size() if dist.is_initialized() else 1
    group_rank = dist.get_rank() if dist.is_initialized() else 0
    return ReplicaGroup(c, run_dir, run, group_rank=group_rank, group_size=group_size, start_step=start_step,
                        device=device)


def _no_flight_recorder_note(record: logging.LogRecord) -> bool:
    """torchft warns at each new quorum that it cannot reset NCCL's flight recorder: true of gloo, always."""
    return "flight recorder" not in record.getMessage()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _group_store(group_rank: int):
    """A TCPStore for the group's managers, hosted by its rank 0 (its port shared over the group's
    process group): the store the other groups reach this one's cross-group process group through."""
    from torch.distributed import TCPStore

    host = socket.gethostname()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if group_rank == 0 else None
    box = [(host, store.port) if store is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return store, *box[0]
