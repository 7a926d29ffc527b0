"""The async worker engine: take a ticket, pull, compute, push, once per batch, without
waiting for the other workers (bounded by ``train.max_staleness``)."""

from __future__ import annotations

import math
from typing import Any

from ...optim import clip_by_global_norm, learning_rate, sgd_deltas
from ...process import preemption
from ...process.log import detail, log
from ...process.waits import poll
from ...run.hooks import StepInfo
from ...store import NO_MORE_TICKETS, Windows, liveness, unreachable
from ..base import RunContext
from .store_worker import Staleness, StoreWorker


class AsyncWorker(StoreWorker):
    """One worker task: take a ticket, pull, compute, push, once per batch.

    With ``train.overlap_pull`` (GPU workers, copied pulls, no tables) the pull of the next step
    runs while the device computes this step's backward, once this step's loss is on the
    host (so its copies in are done and the pull buffers free): each update is then computed
    on variables one update older (its worker's own last one is not in them yet)."""

    def __init__(self, ctx: RunContext, windows: Windows):
        super().__init__(ctx, windows)
        client = self.client
        self.overlap = bool(self.tc.overlap_pull and not client.tables)  # (job.py: no zero copy)
        # the variables pulled ahead: global_step when they were read, and which pull it was
        self._ahead: tuple[int, int] | None = None
        if self.tc.overlap_pull and not self.overlap and self.role.task == 0:
            log(self.role, "train.overlap_pull: off (a model with tables pulls its batch's ids)")

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Take a ticket (or stop), pull, compute, push: one update of the global step."""
        ahead, self._ahead = self._ahead, None
        self.phases.begin()
        begun = self._ticket()
        if begun is None:
            return None
        ticket, pulled_at, lead = begun
        params, pulled_at, x, y, grads = self._pulled(ahead, pulled_at, x, y)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):
            self._not_finite(loss, pulled_at)
        # the loss is here, so every copy in before it is done: the pull buffers are free
        if self.overlap and ticket + 1 < (self.tc.steps or NO_MORE_TICKETS):
            self._pull_ahead()
        step = self._push(grads, ticket, pulled_at)
        self.clock, self.updates = self.clock + 1, self.updates + 1
        self.stats.add(lead, step - 1 - pulled_at)
        return StepInfo(step, loss, epoch, self.updates, lead, step - 1 - pulled_at)

    def _ticket(self) -> tuple[int, int, int] | None:
        """This step's ticket, the global_step its pull reads and its lead over the slowest
        worker (waited for beyond the bound); None: the run is over for this worker."""
        control = self.control
        if preemption.requested():  # every worker stops at its next ticket
            control.request_stop(preemption.requested())
            return None
        ticket, pulled_at, lead = control.begin_step(self.clock, self.role.task)
        if ticket >= (self.tc.steps or NO_MORE_TICKETS):
            control.release_ticket(self.role.task)
            if not (self.tc.steps and ticket < NO_MORE_TICKETS and self._reissued()):
                return None
            ticket = pulled_at = control.global_step()  # a dead worker's step, made here
        bound = self.mode.max_staleness
        if bound is not None and lead > bound:  # wait for the slowest worker
            lead = control.wait_for_slowest(self.clock, bound, self.watchdog.check)
            pulled_at = control.global_step()
        self.phases.mark("ticket and staleness wait")
        return ticket, pulled_at, lead

    def _reissued(self) -> bool:
        """Survive mode, the step target's tickets all claimed: whether this worker makes a
        step a dead worker claimed and never counted. It waits (sleeping, policed by the
        watchdog, which declares the dead) until every other worker is done or lost, taking
        any such step meanwhile; False when there is none left to make."""
        if not liveness.SURVIVAL.survivable:
            return False
        control, task = self.control, self.role.task
        self.client.settle()
        control.publish_clock(task, self.clock, done=True)  # (so nobody waits for it)
        taken, target = [False], self.tc.steps or NO_MORE_TICKETS

        def over() -> bool:
            everyone_done = bool(control.clocks()[1].all())  # (then read what is left)
            taken[0] = control.take_reissued(task, target)
            return taken[0] or (everyone_done and not control.reissue_pending(target))

        poll(over, math.inf, unreachable, self.watchdog.check)
        return taken[0]

    def _pulled(
        self, ahead: tuple[int, int] | None, pulled_at: int, x: Any, y: Any
    ) -> tuple[dict[str, Any], int, Any, Any, dict[str, Any]]:
        """The variables (pulled now, or during the last backward), the global_step they
        were read at, the batch where the model computes and its gradient buffers."""
        client, device = self.client, self.device
        x, ids = self.model.prepare(x)  # sparse models: the batch's unique ids (rows to pull)
        if ahead is not None and ahead[1] == client.pulls:  # pulled during the last backward
            pulled, pulled_at = client.params, ahead[0]
        else:  # (or a hook pulled since: a validation, the variables for a summary)
            pulled = client.pull(ids, step=True)
        self.phases.mark("pull")
        params = device.stage_in(pulled)
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        grads = device.mirrors(client.gradients())  # on the CPU: the push buffers themselves
        self.phases.mark("copy in", not device.on_host)
        return params, pulled_at, x, y, grads

    def _pull_ahead(self) -> None:
        """The next step's pull, while the device runs this step's backward."""
        self.phases.mark("compute")
        at = self.control.global_step()
        self.client.pull()
        self._ahead = (at, self.client.pulls)
        self.phases.mark("next pull, during backward")

    def _push(self, grads: dict[str, Any], ticket: int, pulled_at: int) -> int:
        """The update made of ``grads`` pushed (clipped; deltas for plain SGD); returns the
        global_step after it."""
        client, device = self.client, self.device
        clip_by_global_norm(list(grads.values()), self.oc.clip_norm)
        lr = learning_rate(self.oc, pulled_at)
        if not (self.optimizer.stateful or client.applies_in_place):
            sgd_deltas(grads.values(), lr)  # plain SGD: the PS Accumulates the deltas
        self.phases.mark("compute", not device.on_host)
        device.stage_out(grads, client.gradients())
        self.phases.mark("compute" if device.on_host else "copy out")
        # applied while this worker prepares its next batch; with a staleness bound it
        # waits, so the clock it publishes counts only updates every pull can see (zero
        # copy: applied here, as update ticket + 1, the count a PS task would give it)
        client.push(lr, wait=self.mode.max_staleness is not None, t=ticket + 1)
        step = self.control.end_step(self.role.task)  # global_step and this worker's clock
        self.phases.mark("push and ack")
        return step

    def _per_worker(self, staleness: list[dict[str, Any]]) -> None:
        for task, s in enumerate(staleness):
            if s["updates"]:
                detail(self.role, f"staleness of /job:worker/task:{task}: {Staleness.describe(s)}")
