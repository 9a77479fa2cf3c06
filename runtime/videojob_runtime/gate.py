"""Stage boundaries of one job on one rank: progress, injected faults, the agreed cancel vote.

The vote is a level every rank reduces with MAX (``progress``: 0 go on, 1
stop, 2 stop and checkpoint), so all ranks stop at the same boundary and
agree whether to save. Level 2 is a preemption:

* after denoising step k (not the last): the checkpoint of step k is saved
  now, every rank taking part (under xfuser's CogVideoX wrapper the save
  all-gathers the latents; rank 0 writes), unless the periodic schedule just
  wrote it or step k is one a resume replayed (the checkpoint it resumed from
  is on disk);
* at any other boundary (load, inputs, encode, before step 1, after the last
  step, before write): nothing new is saved;

then ``Preempted`` is raised with ``checkpointStep``: the step saved, else the
newest valid checkpoint on disk, else 0 (agreed with MIN over the ranks, so
every rank reports the same step even if rank 0's write failed).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from . import distributed
from .errors import Cancelled, InjectedOOM, Preempted
from .progress import STOP_AND_CHECKPOINT
from .request import FaultInjection, JobRequest

if TYPE_CHECKING:
    from .worker import RankWorker

log = logging.getLogger("videojob.runtime.worker")


class JobGate:
    """One job's boundaries on one rank (``generate.StageGate``)."""

    def __init__(self, worker: "RankWorker", req: JobRequest):
        self.worker, self.req = worker, req
        self.fault: FaultInjection | None = req.fault()
        self.stage = "load"
        self.step = 0
        self.resumed_from = 0  # the checkpoint step this run resumed from
        self.plan = None  # resume.StepCheckpointing, once the worker made it (None: no checkpoints)
        self.hooks = None  # resume._Hooks while the pipeline call runs (generate.py hands them over)

    def use_checkpoints(self, hooks) -> None:
        """The checkpoint hooks of the running pipeline call (None when it ends)."""
        self.hooks = hooks

    def _inject(self, stage: str, step: int | None = None) -> None:
        fault = self.fault
        if fault is None or not fault.applies(stage, self.worker.rank, step):
            return
        where = f"{stage}" + (f" after step {step}" if step else "") + f" on rank {self.worker.rank}"
        if fault.kind == "stall":
            # At most fault.seconds; over as soon as a cancel or preemption of this job
            # reached this rank (the vote after it then stops the job at once), or the
            # test released it.
            tokens, job_id = self.worker.tokens, self.req.job_id
            started = time.monotonic()
            ended = fault.stall(stop=lambda: tokens.level(job_id) > 0)
            log.info("injected stall in %s: %s after %.1fs", where, ended, time.monotonic() - started)
            return
        if fault.kind == "exit":
            log.error("injected fault: exiting the process in %s", where)
            os._exit(17)
        if fault.kind == "oom":
            raise InjectedOOM(f"injected out of memory ({where})")
        raise RuntimeError(f"injected fault in {where}")

    def enter(self, stage: str) -> None:
        """The boundary before ``stage``: the cancel vote, then the stage begins."""
        self.vote(stage)
        self.stage = stage
        progress = self.worker.progress
        progress.stage = stage
        if stage == "load":
            progress.state = "loading"
        elif stage in ("inputs", "encode", "denoise", "decode"):
            progress.state = "running"
        if stage != "write":  # a write fault fires between files (output.write_outputs)
            self._inject(stage)

    def step_done(self, index: int) -> None:
        step = index + 1
        self.step = step
        progress = self.worker.progress
        progress.step, progress.stage, self.stage = step, "denoise", "denoise"
        self._inject("denoise", step)
        self.vote("denoise", step)
        if step == self.req.steps:
            progress.stage = self.stage = "decode"
            self._inject("decode")

    def vote(self, stage: str, step: int | None = None) -> None:
        level = self.worker.agree_cancel(self.req.job_id)
        if not level:
            return
        if level >= STOP_AND_CHECKPOINT:
            self._preempt(stage, step)
        if step:
            raise Cancelled(f"cancelled after step {step} of {self.req.steps}", stage=stage, step=step)
        done = f" (after {self.stage})" if self.stage != stage else ""
        raise Cancelled(f"cancelled before {stage}{done}", stage=stage)

    # -- preemption ----------------------------------------------------------

    def _preempt(self, stage: str, step: int | None) -> None:
        saved = self._save_now(step) if step else None
        local = saved if saved is not None else self._newest_on_disk()
        checkpoint_step = self._agree_min(local)
        where = f"after step {step} of {self.req.steps}" if step else f"before {stage}"
        kept = (f"checkpoint of step {checkpoint_step}" + (" saved" if saved else " on disk")
                if checkpoint_step else "no checkpoint: the next attempt starts at step 0")
        raise Preempted(f"preempted {where}; {kept}", stage=stage, step=step or self.step,
                        checkpointStep=checkpoint_step)

    def _save_now(self, step: int) -> int | None:
        """Save step ``step``'s checkpoint (every rank calls this together); the step
        the next attempt resumes from, or None when nothing was saved here."""
        plan, hooks = self.plan, self.hooks
        if plan is None or hooks is None or step >= self.req.steps:
            return None  # no checkpoints for this job, or the last step: decode follows, no boundary
        if step <= plan.resume_step:
            return plan.resume_step  # a replayed step: its outputs are dummies; the resumed-from file is there
        if plan.written and plan.written[-1]["step"] == step:
            return step  # the periodic schedule wrote it a moment ago
        try:
            hooks.save_now(step)
        except OSError as exc:  # rank 0's write; the gather has run on every rank, so the group is fine
            log.error("preemption: the checkpoint of step %d could not be written: %s", step, exc)
            return None
        return step

    def _newest_on_disk(self) -> int:
        """The newest valid checkpoint of this job on disk, or 0."""
        store = self.plan.store if self.plan is not None else None
        if store is None:
            if not self.req.checkpoint_dir or self.req.steps < 2:
                return 0
            from .resume import job_store

            try:
                store = job_store(self.req)
            except Exception as exc:  # noqa: BLE001 - an input that cannot be read: no checkpoint to name
                log.warning("preemption: cannot look for checkpoints (%s)", exc)
                return 0
        found = store.newest()
        return found.checkpoint.step if found.checkpoint is not None else 0

    def _agree_min(self, value: int) -> int:
        worker = self.worker
        if worker.world_size == 1:
            return value
        return distributed.agree_min(value, worker.device)

