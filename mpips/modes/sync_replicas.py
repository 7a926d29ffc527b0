"""``train.mode = "sync_replicas"``: TensorFlow's SyncReplicasOptimizer through the PS tasks.
Each worker posts its gradient for the PS tasks' current step; each PS task averages the
first ``train.replicas_to_aggregate`` gradients of a step, applies the mean once and moves
on (gradients that come later are dropped, so backup workers hide a slow one).

With backup workers and several PS tasks, each PS task chooses its step's gradients on its
own, as TensorFlow's accumulators (one per variable) do: two PS tasks may average different
workers' gradients for the same step. A worker posts only for a step every PS task is at
(common_step), so the PS tasks are never more than one step apart, each step waits for
gradients that are posted, and global_step (advanced by ps:0) counts every step once."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..data.batches import DatasetInfo, full_batches
from ..device.backend import Device
from ..errors import ConfigError, DataError
from ..job import Job
from ..optim import Optimizer, learning_rate
from ..placement.layout import Layout
from ..process import preemption
from ..process.log import log
from ..run.hooks import Hook, StepInfo
from ..run.session import TrainResult
from ..run.startup import Prepared
from ..store import Apply, Cluster, Windows
from .base import Mode
from .ps_store import close_store, open_store, run_ps, shard_count
from .store_worker import StoreWorker


class SyncReplicas(Mode):
    """PS tasks hold every variable and apply each step's averaged gradients once."""

    name = "sync_replicas"
    aggregates = True

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None:
        check_sync_replicas(job, cluster, info)
        super().check(job, cluster, model, info)

    def aggregate_count(self, job: Job, layout: Layout) -> int:
        """The gradients a PS task averages for each step."""
        return job.train.replicas_to_aggregate or layout.num_workers

    def step_note(self, info: StepInfo) -> str:
        return (
            "(the chief's batch; the PS tasks average the step's first "
            "replicas_to_aggregate gradients)"
        )

    def train(
        self,
        job: Job,
        cluster: Cluster,
        optimizer: Optimizer,
        prep: Prepared,
        hooks: list[Hook],
        device: Device,
    ) -> TrainResult:
        """Every rank: create the windows, then PS tasks aggregate and workers post their
        gradients until the chief ends the run."""
        windows = open_store(job, self, cluster, optimizer, prep)
        if cluster.is_ps:
            n, task = self.aggregate_count(job, cluster.layout), cluster.role.task

            def average(apply: Apply) -> Averager:
                return Averager(windows, task, apply, optimizer.slots, n)

            shards = shard_count(cluster.layout.num_ps, prep.model)
            result = run_ps(job, cluster, windows, optimizer, shards, prep.model, average)
        else:
            worker = ReplicasWorker(job, self, cluster, windows, optimizer, prep, device)
            result = worker.train(hooks)
        return close_store(cluster, windows, result)


class Averager:
    """SyncReplicasOptimizer's accumulator on PS ``task`` (store.StepPolicy): the first
    ``per_step`` gradients posted for a step are summed; their mean is applied once, to the
    variables and slots this task holds in its window."""

    def __init__(
        self, windows: Windows, task: int, apply: Apply, slot_names: Sequence[str], per_step: int
    ):
        self.variables, slot_views = windows.held(task)
        self.slots = {
            name: {s: slot_views[f"{name}/{s}"] for s in slot_names} for name in self.variables
        }
        self.total = {name: np.zeros_like(v) for name, v in self.variables.items()}
        self.apply_rule, self.per_step, self.count = apply, per_step, 0

    def add(self, grads: dict[str, np.ndarray]) -> bool:
        for name, grad in grads.items():
            self.total[name] += grad
        self.count += 1
        return self.count == self.per_step

    def apply(self, lr: float, step: int) -> None:
        for name, var in self.variables.items():
            self.total[name] /= self.per_step
            self.apply_rule(var, self.total[name], self.slots[name], lr, step + 1)
            self.total[name][...] = 0
        self.count = 0


class ReplicasWorker(StoreWorker):
    """A worker of ``train.mode = "sync_replicas"``, TensorFlow's SyncReplicasOptimizer
    through the PS: each step it pulls the variables of the PS tasks' current step, posts
    its gradient tagged with that step, and waits until every PS task has aggregated the
    step (the first ``train.replicas_to_aggregate`` gradients for it, averaged and applied
    once). A gradient that comes after its step was aggregated is dropped, so with backup
    workers (replicas_to_aggregate below the number of workers) a slow worker no longer
    slows every step: it catches up on the next one. Its tag is the same step on every PS
    task (common_step)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.dropped = 0
        # equal full batches on every worker, as sync replicas make them (checked > 0)
        self.per_epoch = full_batches(
            self.prep.info.rows["train"], self.cluster.layout.num_workers, self.tc.batch_size
        )

    def batches(self) -> Iterable[tuple[int, Any, Any]]:
        assert self.prep.train is not None
        return self.prep.train.batches(
            self.tc.batch_size,
            self.tc.seed,
            self.role.task,
            0,  # ends at train.steps
            start_batch=self.clock,
            per_epoch=self.per_epoch,
        )

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Post a gradient for the PS tasks' current step and wait until they move on."""
        control, client, model, device = self.control, self.client, self.model, self.device
        tl = self.timeline
        t = tl.now() if tl else 0.0
        if preemption.requested():
            control.request_stop(preemption.requested())
            return None
        if control.tickets_ended():  # a stop (a signal or a hook's) ends the tickets
            return None
        step = common_step(client.ps_steps, self._wait_past)
        if step is None or step >= self.tc.steps:
            return None
        tags = [step] * self.cluster.layout.num_ps
        x, _ = model.prepare(x)
        pulled = client.pull()
        if tl:
            t = tl.span("pull", t)
        params = device.stage_in(pulled)
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        grads = device.mirrors(client.gradients())
        if tl and not device.on_host:
            t = tl.span("copy in", t)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):
            self._not_finite(loss, tags[0])
        if tl and not device.on_host:
            t = tl.span("compute", t)
        device.stage_out(grads, client.gradients())
        if tl:
            t = tl.span("compute" if device.on_host else "copy out", t)
        if not client.push(learning_rate(self.oc, tags[0]), tags):
            self.dropped += 1
        if tl:
            t = tl.span("push and ack", t)
        client.wait_steps(tags, control.tickets_ended)
        if tl:
            tl.span("wait for the step", t)
        self.clock, self.updates = self.clock + 1, self.updates + 1
        control.publish_clock(self.role.task, self.clock)
        self.stats.add(0, 0)
        self.stats.dropped = self.dropped
        return StepInfo(tags[0] + 1, loss, epoch, self.updates)

    def _wait_past(self, tags: list[int]) -> bool:
        """Until every PS task ``p`` is past step ``tags[p]``; False if a stop ended it."""
        return self.client.wait_steps(tags, self.control.tickets_ended)

    def _per_worker(self, staleness: list[dict[str, Any]]) -> None:
        dropped = [s.get("dropped", 0) for s in staleness]
        log(self.role, "gradients dropped as late, per worker task: " + " ".join(map(str, dropped)))


def common_step(
    ps_steps: Callable[[], list[int]], wait_past: Callable[[list[int]], bool]
) -> int | None:
    """The step every PS task is at, the one a worker posts its next gradient for. A PS task
    that has not yet aggregated the step the others finished is waited for (``wait_past``
    (tags): until every PS task ``p`` is past ``tags[p]``; False if a stop ended the wait,
    then None): it will, since the gradients that finished it on the others were posted to
    it too. So no gradient is ever posted for two different steps at once, and the PS tasks
    never drift more than one step apart."""
    while True:
        steps = ps_steps()
        top = max(steps)
        if min(steps) == top:
            return top
        if not wait_past([top - 1] * len(steps)):
            return None


def check_sync_replicas(job: Job, cluster: Cluster, info: DatasetInfo) -> None:
    """What sync_replicas needs of the layout and the data: no more gradients a step than
    workers; a full batch a step on every worker."""
    aggregate, workers = job.train.replicas_to_aggregate, cluster.layout.num_workers
    if aggregate > workers:
        raise ConfigError(
            f"train.replicas_to_aggregate = {aggregate}: more than the {workers} worker(s) "
            f"of this layout"
        )
    if full_batches(info.rows["train"], workers, job.train.batch_size) == 0:
        raise DataError(
            f"{info.path}: {info.rows['train']} train rows make no full batch of "
            f"{job.train.batch_size} on each of {workers} workers (sync_replicas)"
        )
