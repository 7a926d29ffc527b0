"""``train.mode = "hybrid"`` (PERSIA-style): the embedding tables stay on the PS tasks and
move row by row, asynchronously, as in async mode; the dense part of the model (wide &
deep's MLP, biases) is trained by the workers as synchronous replicas, as in sync mode.

A step of every worker: pull the rows of its batch's ids from the PS tasks, forward and
backward (the dense gradients' reduction starts during it across nodes), agree on stopping
and on every replica's loss being finite (so every replica has pulled, and nothing of a
step whose loss is not finite is pushed), push its rows' gradients to the PS tasks
(Accumulate for SGD, the inbox for stateful optimizers; applied before the push returns),
then update its part of the dense variables and share it (which waits for every replica,
so every push has landed before any replica's next pull: unlike sync mode, no part is
shared during backward). The tables thus see the workers' gradients in lockstep, each
worker's applied on its own (as in async mode), while every replica's dense variables stay
identical (checked every ``train.check_every`` steps); one step is one global step.

A checkpoint holds the tables' partitions in the PS tasks' shards and the dense variables
(with their slots) in one more shard the chief writes, so it restores in any mode.
"""

from __future__ import annotations

from typing import Any

from ..data.batches import DatasetInfo
from ..device.backend import Device, StagedGradients
from ..errors import ConfigError
from ..job import Job
from ..optim import Optimizer, sgd_deltas
from ..placement.layout import Layout
from ..process import preemption
from ..run.hooks import Hook, PendingSave, StepInfo
from ..run.session import TrainResult, evaluate_on, report
from ..run.startup import Prepared
from ..store import Cluster, StoreClient, Windows, start_limit
from .base import Mode, replica_bytes
from .device_replica import DeviceReplica
from .ps_store import close_store, open_store, run_ps, save_from_ps, shard_count
from .replica import Replica


class Hybrid(Mode):
    """The tables on the PS tasks, row by row; the dense variables on the workers, as
    synchronous replicas."""

    name = "hybrid"
    dense_on_ps = False
    chief_holds_dense = True
    trains_tables = True

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None:
        if not model.tables():
            raise ConfigError(
                f'train.mode = "hybrid": {type(model).__name__} has no tables to keep on the '
                f'PS tasks; train its dense variables with mode = "sync" (or "async")'
            )
        super().check(job, cluster, model, info)

    def rank_bytes(
        self,
        job: Job,
        layout: Layout,
        model: Any,
        optimizer: Optimizer,
        info: DatasetInfo,
        zero_copy: bool | None = None,
    ) -> list[int]:
        """The PS tasks' windows of the tables; the workers' buffers, and the dense part
        each holds as a replica."""
        replica = replica_bytes(model, optimizer)
        per_rank = super().rank_bytes(job, layout, model, optimizer, info, zero_copy)
        return [n + (0 if layout.role(r).job == "ps" else replica) for r, n in enumerate(per_rank)]

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
        """Every rank: the windows of the tables; PS tasks serve them, workers train as
        synchronous replicas of the dense part until the chief ends the run."""
        windows = open_store(job, self, cluster, optimizer, prep)
        num_shards = shard_count(cluster.layout.num_ps, prep.model, chief_writes=True)
        if cluster.is_ps:
            result = run_ps(job, cluster, windows, optimizer, num_shards, prep.model)
        else:
            kind = HybridReplica if device.on_host else DeviceHybridReplica
            replica = kind(job, self, cluster, optimizer, prep, device, windows)
            result = replica.train(hooks)
        return close_store(cluster, windows, result)


class HybridReplica(Replica):
    """A synchronous replica of the dense variables that pulls and pushes table rows."""

    def __init__(
        self,
        job: Job,
        mode: Mode,
        cluster: Cluster,
        optimizer: Optimizer,
        prep: Prepared,
        device: Device,
        windows: Windows,
    ):
        super().__init__(job, mode, cluster, optimizer, prep, device)
        self.windows = windows
        self.vote_after_compute = True  # the dense update is shared after the pushes
        self.client = StoreClient(windows, self.role.task, optimizer.stateful)
        self.client.on_new_buffers = device.pin  # (a GPU copies the rows from locked pages)
        self.control = self.client.control

    def train(self, extra_hooks: list[Hook]) -> TrainResult:
        result = super().train(extra_hooks)
        self.control.publish_clock(self.role.task, self.clock, done=True)
        if self.cluster.is_chief:
            self.control.end_run()  # after the last checkpoint and evaluation: PS tasks stop
        return result

    def _start(self) -> int:
        """The PS tasks hold their tables (restored or fresh): the chief sets the counters
        and raises ready, the others wait for it; then the dense part is broadcast."""
        control = self.control
        if self.cluster.is_chief:
            control.set_counters(self.prep.start_step)
            control.raise_ready()
        else:
            control.wait_ready(start_limit(self.role.task))
        return super()._start()

    def _inputs(self, x: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        x, ids = self.model.prepare(x)
        rows = self.client.pull(ids, step=True)
        return x, {**self.params, **rows}, {**self.grads, **self.client.gradients()}

    def _signal(self) -> int:
        """Its own signal, or one any task (a PS task included) set in the control window.
        Its own is set there too: every task, the PS ones included, reads the run's stop
        signal from the window at the end (and exits 3 by it)."""
        own = preemption.requested()
        if own and not self.control.stop_signal():
            self.control.request_stop(own)
        return own or self.control.stop_signal()

    def _push_rows(self, grads: dict[str, Any], lr: float) -> None:
        """This worker's gradient rows (deltas for SGD) to the PS tasks, applied there before
        this returns (and so before the dense update is shared, and before any replica's
        next pull); the step's clock, for the PS tasks' watchdogs."""
        if not self.optimizer.stateful:
            sgd_deltas([grads[table] for table in self.client.tables], lr)
        self.client.push(lr)
        self.control.publish_clock(self.role.task, self.clock + 1)

    def _validate(self) -> dict[str, float]:
        assert self.prep.val is not None
        return self._evaluate(self.prep.val)

    def _evaluate(self, split: tuple[Any, Any]) -> dict[str, float]:
        x, ids = self.model.prepare(split[0])
        return evaluate_on(
            self.model, self.device, {**self.live, **self.client.pull(ids)}, (x, split[1])
        )

    def _report(self, result: TrainResult, gathered: list[Any]) -> None:
        assert self.prep.test is not None
        x, ids = self.model.prepare(self.prep.test[0])
        params = {**self.live, **self.client.pull(ids)}
        report(
            self.cluster, self.model, self.device, params, (x, self.prep.test[1]), result, gathered
        )

    def save(self) -> PendingSave:
        """Ask every PS task for its shard of the tables, write the dense variables and
        their slots as one more shard, and commit once all are written."""
        slots = self.whole_slots()
        clocks = [self.clock] * self.workers
        return save_from_ps(
            self.job,
            self.cluster,
            self.windows,
            self.step_count,
            clocks,
            ({**self.host_params(), **self.model.state()}, slots),  # (and the chief's buffers)
        )


class DeviceHybridReplica(HybridReplica, DeviceReplica):
    """Hybrid mode on a GPU: the dense variables and their slots on the device (as a sync
    replica's there); the batch's table rows pulled into (kept, page-locked) host buffers
    and copied in, their gradients copied out (with the dense ones, each as backward says
    it is ready) and pushed from the host."""

    def _on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]:
        device = self.device
        rows = [name for name in params if name not in self.live]
        x, y = device.to_device(x, "x"), device.to_device(y, "y")
        params = {**self.live, **device.stage_in({n: params[n] for n in rows})}
        grads = {**self.device_grads, **device.mirrors({n: host_grads[n] for n in rows})}
        return x, y, params, grads, device.staged(grads, host_grads)
