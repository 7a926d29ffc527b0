"""What a synchronous replica's batch brings from the PS tasks, one class each: nothing
(DenseOnly: sync mode, every variable a replica's own) or table rows (TableRows: hybrid
mode, PERSIA-style: the embedding tables stay on the PS tasks and move row by row, as in
async mode, while the replicas train the dense part). Each also says how the run starts
and ends around the replicas, where a stop signal comes from and where a checkpoint goes."""

from __future__ import annotations

from typing import Any

from ...allreduce import stop_from_ps
from ...optim import sgd_deltas
from ...process import preemption
from ...process.log import log
from ...run.checkpoints import save_whole
from ...run.hooks import PendingSave
from ...store import StoreClient, Windows, start_limit
from ..base import RunContext
from .ps import save_from_ps


class DenseOnly:
    """Sync mode: the replicas hold every variable; the chief writes whole checkpoints."""

    vote_after_compute = False  # the replicas vote on stopping before compute (replica.py)
    pulls = False

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.listen_to_ps = ctx.cluster.is_chief and ctx.cluster.layout.num_ps > 0

    def start(self) -> None:
        """Before the chief's state is shared: nothing to wait for."""

    def end(self, clock: int) -> None:
        """After the replicas' last step: nothing to tell."""

    def inputs(
        self, x: Any, params: dict[str, Any], grads: dict[str, Any]
    ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """The batch as the model takes it, the parameters it reads and where its gradients
        go (the buckets)."""
        return x, params, grads

    def signal(self) -> int:
        """A stop signal this replica knows of: its own, or one a PS rank forwarded."""
        return preemption.requested() or (
            stop_from_ps(self.ctx.cluster.comm) if self.listen_to_ps else 0
        )

    def push(self, grads: dict[str, Any], lr: float, clock: int) -> None:
        """Rows' gradients to the PS tasks: none here."""

    def evaluated(self, x: Any, live: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The split's inputs and the parameters the model reads for them."""
        return x, live

    def save(
        self, step: int, variables: dict[str, Any], slots: dict[str, Any], clocks: list[int]
    ) -> PendingSave:
        """Chief: one shard of every variable and slot, committed at once."""
        return save_whole(self.ctx.job, self.ctx.cluster, step, variables, slots, clocks)


class TableRows:
    """Hybrid mode: each step pulls the rows of the batch's ids from the PS tasks and, once
    every replica's loss is known to be finite, pushes their gradients (Accumulate for
    SGD, the inbox for stateful optimizers; applied before the push returns), so every
    push has landed before any replica's next pull."""

    vote_after_compute = True  # the dense update is shared after the pushes
    pulls = True

    def __init__(self, ctx: RunContext, windows: Windows):
        # built before the Replica's collectives (its buckets): no collective call here
        self.ctx, self.windows = ctx, windows
        self.task = ctx.role.task
        self.client = StoreClient(windows, self.task, ctx.optimizer.stateful)
        self.client.serve_from(getattr(ctx.model, "table_offsets", dict)())
        self.client.on_new_buffers = ctx.device.pin  # (a GPU copies the rows from locked pages)
        self.control = self.client.control

    def start(self) -> None:
        """The PS tasks hold their tables (restored or fresh): the chief sets the counters
        and raises ready, the others wait for it."""
        if self.ctx.cluster.is_chief:
            self.control.set_counters(self.ctx.prep.start_step)
            self.control.raise_ready()
        else:
            self.control.wait_ready(start_limit(self.task))

    def end(self, clock: int) -> None:
        """This worker is done; the chief, after the last checkpoint and evaluation, ends
        the run (the PS tasks stop serving)."""
        self.control.publish_clock(self.task, clock, done=True)
        if line := self.client.cache_line():
            log(self.ctx.role, line)
        if self.ctx.cluster.is_chief:
            self.control.end_run()

    def inputs(
        self, x: Any, params: dict[str, Any], grads: dict[str, Any]
    ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        x, ids = self.ctx.model.prepare(x)
        rows = self.client.pull(ids, step=True)
        return x, {**params, **rows}, {**grads, **self.client.gradients()}

    def signal(self) -> int:
        """Its own signal, or one any task (a PS task included) set in the control window.
        Its own is set there too: every task, the PS ones included, reads the run's stop
        signal from the window at the end (and exits 3 by it)."""
        own = preemption.requested()
        if own and not self.control.stop_signal():
            self.control.request_stop(own)
        return own or self.control.stop_signal()

    def push(self, grads: dict[str, Any], lr: float, clock: int) -> None:
        """This worker's gradient rows (deltas for SGD) to the PS tasks, applied there before
        this returns (and so before the dense update is shared, and before any replica's
        next pull); the step's clock, for the PS tasks' watchdogs."""
        if not self.ctx.optimizer.stateful:
            tables = [*self.client.tables, *self.client.dynamic_tables]
            sgd_deltas([grads[table] for table in tables], lr)
        self.client.push(lr)
        self.control.publish_clock(self.task, clock + 1)

    def evaluated(self, x: Any, live: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, ids = self.ctx.model.prepare(x)
        return x, {**live, **self.client.pull(ids)}

    def save(
        self, step: int, variables: dict[str, Any], slots: dict[str, Any], clocks: list[int]
    ) -> PendingSave:
        """Ask every PS task for its shard of the tables, write the dense variables and
        their slots as one more shard, and commit once all are written."""
        return save_from_ps(self.ctx, self.windows, step, clocks, (variables, slots))
