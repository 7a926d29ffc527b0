"""Asynchronous training (``train.mode = "async"``): PS tasks serve the variables from their
windows; each worker pulls, computes gradients on its own batch and pushes an update
without waiting for the others (bounded by ``train.max_staleness``). The chief also
initialises or restores the variables, commits checkpoints and evaluates at the end."""

from __future__ import annotations

import math
from typing import Any

from ..device.backend import Device
from ..job import Job
from ..optim import Optimizer, clip_by_global_norm, learning_rate, sgd_deltas
from ..process import preemption
from ..process.log import detail, log
from ..run.hooks import Hook, StepInfo
from ..run.session import TrainResult
from ..run.startup import Prepared
from ..store import NO_MORE_TICKETS, Cluster
from .base import Mode
from .ps_store import close_store, open_store, run_ps, shard_count
from .store_worker import Staleness, StoreWorker


class Async(Mode):
    """PS tasks hold every variable; each worker steps on its own (TensorFlow's between-graph
    replication without SyncReplicasOptimizer), its lead bounded by ``max_staleness``."""

    name = "async"
    trains_tables = True
    takes_clip_norm = True
    chief_speaks_for_all = False
    has_staleness = True
    zero_copy_on_one_node = True  # measured faster on one node (docs/guide/modes.md)

    def step_note(self, info: StepInfo) -> str:
        return f"(update {info.local_updates} of this worker, pulled {info.delay} steps earlier)"

    def train(
        self,
        job: Job,
        cluster: Cluster,
        optimizer: Optimizer,
        prep: Prepared,
        hooks: list[Hook],
        device: Device,
    ) -> TrainResult:
        """Every rank: create the windows, then PS tasks serve and workers train until the
        chief ends the run."""
        windows = open_store(job, self, cluster, optimizer, prep)
        if cluster.is_ps:
            shards = shard_count(cluster.layout.num_ps, prep.model)
            result = run_ps(job, cluster, windows, optimizer, shards, prep.model)
        else:
            worker = AsyncWorker(job, self, cluster, windows, optimizer, prep, device)
            result = worker.train(hooks)
        return close_store(cluster, windows, result)


class AsyncWorker(StoreWorker):
    """One worker task: take a ticket, pull, compute, push, once per batch.

    With ``train.overlap_pull`` (GPU workers, copied pulls, no tables) the pull of the next step
    runs while the device computes this step's backward, once this step's loss is on the
    host (so its copies in are done and the pull buffers free): each update is then computed
    on variables one update older (its worker's own last one is not in them yet)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        client = self.client
        self.overlap = bool(self.tc.overlap_pull and not client.tables)  # (job.py: no zero copy)
        # the variables pulled ahead: global_step when they were read, and which pull it was
        self._ahead: tuple[int, int] | None = None
        if self.tc.overlap_pull and not self.overlap and self.role.task == 0:
            log(self.role, "train.overlap_pull: off (a model with tables pulls its batch's ids)")

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Take a ticket (or stop), pull, compute, push: one update of the global step."""
        control, client, model, tl = self.control, self.client, self.model, self.timeline
        ahead, self._ahead = self._ahead, None
        t = tl.now() if tl else 0.0  # the timeline's phases (summary.timeline), if on
        if preemption.requested():  # every worker stops at its next ticket
            control.request_stop(preemption.requested())
            return None
        ticket, pulled_at, lead = control.begin_step(self.clock)
        if ticket >= (self.tc.steps or NO_MORE_TICKETS):
            return None
        bound = self.mode.max_staleness
        if bound is not None and lead > bound:  # wait for the slowest worker
            lead = control.wait_for_slowest(self.clock, bound, self.watchdog.check)
            pulled_at = control.global_step()
        if tl:
            t = tl.span("ticket and staleness wait", t)
        x, ids = model.prepare(x)  # sparse models: the batch's unique ids (rows to pull)
        device = self.device
        if ahead is not None and ahead[1] == client.pulls:  # pulled during the last backward
            pulled, pulled_at = client.params, ahead[0]
        else:  # (or a hook pulled since: a validation, the variables for a summary)
            pulled = client.pull(ids, step=True)
        if tl:
            t = tl.span("pull", t)
        params = device.stage_in(pulled)
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        grads = device.mirrors(client.gradients())  # on the CPU: the push buffers themselves
        if tl and not device.on_host:
            t = tl.span("copy in", t)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):
            self._not_finite(loss, pulled_at)
        # the loss is here, so every copy in before it is done: the pull buffers are free
        if self.overlap and ticket + 1 < (self.tc.steps or NO_MORE_TICKETS):
            if tl:
                t = tl.span("compute", t)
            at = control.global_step()
            client.pull()  # (while the device runs backward)
            self._ahead = (at, client.pulls)
            if tl:
                t = tl.span("next pull, during backward", t)
        clip_by_global_norm(list(grads.values()), self.oc.clip_norm)
        lr = learning_rate(self.oc, pulled_at)
        if not (self.optimizer.stateful or client.applies_in_place):
            sgd_deltas(grads.values(), lr)  # plain SGD: the PS Accumulates the deltas
        if tl and not device.on_host:
            t = tl.span("compute", t)
        device.stage_out(grads, client.gradients())
        if tl:
            t = tl.span("compute" if device.on_host else "copy out", t)
        # applied while this worker prepares its next batch; with a staleness bound it
        # waits, so the clock it publishes counts only updates every pull can see (zero
        # copy: applied here, as update ticket + 1, the count a PS task would give it)
        client.push(lr, wait=bound is not None, t=ticket + 1)
        step = control.end_step(self.role.task)  # global_step and this worker's clock
        if tl:
            tl.span("push and ack", t)
        self.clock, self.updates = self.clock + 1, self.updates + 1
        self.stats.add(lead, step - 1 - pulled_at)
        return StepInfo(step, loss, epoch, self.updates, lead, step - 1 - pulled_at)

    def _per_worker(self, staleness: list[dict[str, Any]]) -> None:
        for task, s in enumerate(staleness):
            if s["updates"]:
                detail(self.role, f"staleness of /job:worker/task:{task}: {Staleness.describe(s)}")
