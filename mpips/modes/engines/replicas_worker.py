"""The sync_replicas engines: the PS tasks' accumulator (SyncReplicasOptimizer's, one per PS
task) and the worker that posts its gradient for the PS tasks' current step and waits
until they move on."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ...data.batches import full_batches
from ...optim import learning_rate
from ...process import preemption
from ...process.log import log
from ...run.hooks import StepInfo
from ...store import Apply, Windows
from ..base import RunContext
from .store_worker import StoreWorker


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
        return self.count >= self.per_step

    def shrink(self, live: int) -> bool:
        self.per_step = min(self.per_step, max(live, 1))
        return self.count >= self.per_step

    def apply(self, lr: float, step: int) -> None:
        for name, var in self.variables.items():
            self.total[name] /= self.count  # per_step; fewer where workers died meanwhile
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

    def __init__(self, ctx: RunContext, windows: Windows):
        super().__init__(ctx, windows)
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
        self.phases.begin()
        step = self._common_step()
        if step is None:
            return None
        tags = [step] * self.cluster.layout.num_ps
        loss = self._post(x, y, tags)
        self.client.wait_steps(tags, self.control.tickets_ended)
        self.phases.mark("wait for the step")
        self.clock, self.updates = self.clock + 1, self.updates + 1
        self.control.publish_clock(self.role.task, self.clock)
        self.control.pushed(self.role.task, tags[0] + 1)  # (named should it die)
        self.stats.add(0, 0)
        self.stats.dropped = self.dropped
        return StepInfo(tags[0] + 1, loss, epoch, self.updates)

    def _common_step(self) -> int | None:
        """The step to post for (common_step); None: the run is over for this worker."""
        control = self.control
        if preemption.requested():
            control.request_stop(preemption.requested())
            return None
        if control.tickets_ended():  # a stop (a signal or a hook's) ends the tickets
            return None
        step = common_step(self.client.ps_steps, self._wait_past)
        return None if step is None or step >= self.tc.steps else step

    def _post(self, x: Any, y: Any, tags: list[int]) -> float:
        """Pull, compute and post this worker's gradient for step ``tags``; its loss."""
        client, device = self.client, self.device
        x, _ = self.model.prepare(x)
        pulled = client.pull()
        self.phases.mark("pull")
        params = device.stage_in(pulled)
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        grads = device.mirrors(client.gradients())
        self.phases.mark("copy in", not device.on_host)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):
            self._not_finite(loss, tags[0])
        self.phases.mark("compute", not device.on_host)
        device.stage_out(grads, client.gradients())
        self.phases.mark("compute" if device.on_host else "copy out")
        if not client.push(learning_rate(self.oc, tags[0]), tags):
            self.dropped += 1
        self.phases.mark("push and ack")
        return loss

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
