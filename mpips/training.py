"""The training loop: chief init/restore, async workers, PS serving, end of run, evaluation."""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import checkpoint
from .backend import get_xp, pin_blas_threads, to_device, to_host
from .data import batches, load_split, open_dataset, resolve_path, shard_rows
from .errors import DataError
from .failure import set_role
from .hooks import CheckpointSaver, Hook, ProgressBar, StepInfo, StepLogger
from .job import Job, job_layout, job_placement
from .layout import Role
from .log import log
from .nn import MLP, build_model
from .optim import build_optimizer
from .placement import Placement
from .store import Cluster, StoreClient, Windows, agreed, allgather_json, serve, sleepy_barrier


@dataclass
class TrainResult:
    """What one rank saw. Evaluation fields are set on the chief only."""

    role: Role
    start_step: int
    global_step: int
    updates: int = 0               # updates this worker pushed
    examples: int = 0              # examples this worker trained on
    seconds: float = 0.0
    total_examples: int = 0        # over all workers (chief only)
    test_accuracy: float | None = None
    test_loss: float | None = None


@dataclass
class Run:
    """The state hooks can see."""

    job: Job
    role: Role
    client: StoreClient
    start_step: int
    target_steps: int

    @property
    def is_chief(self) -> bool:
        return self.role.is_chief


def train(job: Job, hooks: Iterable[Hook] = (), comm: MPI.Comm | None = None) -> TrainResult:
    """Run ``job`` on every rank of ``comm`` (collective): PS ranks serve, workers train."""
    comm = comm or MPI.COMM_WORLD
    layout = agreed(comm, lambda: job_layout(job, comm.size))
    cluster = Cluster(comm, layout)
    set_role(cluster.role)
    result = _train(job, cluster, list(hooks))
    cluster.free()  # collective: only on success (an error aborts the world instead)
    return result


def _prepare(job: Job, cluster: Cluster) -> dict[str, Any]:
    """Everything that can fail on bad input, done before any window exists."""
    info = open_dataset(resolve_path(job.data.path, job.data.builtin))
    prep: dict[str, Any] = {"info": info, "start_step": 0}
    model = build_model(job.model.kind, job.model.hidden, info.num_inputs, info.num_classes)
    if cluster.is_ps:
        return prep
    task, workers = cluster.role.task, cluster.layout.num_workers
    rows = shard_rows(info.rows["train"], workers, task)
    if rows[1] <= rows[0]:
        raise DataError(f"{info.path}: {info.rows['train']} train rows cannot feed "
                        f"{workers} workers")
    prep["rows"] = rows
    prep["train"] = load_split(info, "train", rows)
    if cluster.is_chief:
        prep["test"] = load_split(info, "test")
        latest = checkpoint.latest_checkpoint(job.checkpoint.dir) \
            if job.checkpoint.dir and job.checkpoint.restore else None
        if latest is not None:
            prep["start_step"], prep["values"] = checkpoint.restore(latest, model.variables())
            prep["restored"] = str(latest)
        else:
            prep["values"] = model.initial_values(job.model.init_seed)
    return prep


def _train(job: Job, cluster: Cluster, hooks: list[Hook]) -> TrainResult:
    prep = agreed(cluster.comm, lambda: _prepare(job, cluster))
    info = prep["info"]
    if not cluster.is_ps:
        pin_blas_threads(cluster.local_size)
    xp = agreed(cluster.comm, lambda: np if cluster.is_ps
                else get_xp(job.train.device, cluster.local_rank))
    model = build_model(job.model.kind, job.model.hidden, info.num_inputs, info.num_classes, xp)
    placement = job_placement(job, model.variables(), cluster.layout.num_ps)
    cluster.check_placement(placement)
    windows = Windows(cluster.comm, cluster.layout, placement)
    if cluster.is_ps:
        serve(cluster)
        result = TrainResult(cluster.role, 0, 0)
    else:
        result = _work(job, cluster, windows, placement, model, prep, hooks)
        sleepy_barrier(cluster.comm)  # releases the PS ranks
    windows.free()  # collective, so never in a finally: a failing rank must reach Abort
    return result


def _work(job: Job, cluster: Cluster, windows: Windows, placement: Placement, model: MLP,
          prep: dict[str, Any], hooks: list[Hook]) -> TrainResult:
    role, tc = cluster.role, job.train
    client = StoreClient(windows, placement)
    start_step = prep["start_step"]
    if cluster.is_chief:
        client.write(prep["values"])
        client.set_counters(start_step)
        client.raise_ready()
        if "restored" in prep:
            log(role, f"restored global_step {start_step} from {prep['restored']}")
        if tc.steps and start_step >= tc.steps:
            log(role, f"global_step {start_step} already reached train.steps = {tc.steps}: "
                      f"nothing to train (raise train.steps or use another checkpoint dir)")
    else:
        client.wait_ready()
        start_step = client.global_step()
    start, stop = prep["rows"]
    log(role, f"shard rows [{start}, {stop}) of {prep['info'].rows['train']} train rows, "
              f"batch {tc.batch_size}, pulls {client.nbytes / 1e6:.2f} MB per step from "
              f"{placement.num_ps} ps task(s)")

    all_hooks: list[Hook] = [StepLogger(tc.log_every)]
    if tc.progress:
        all_hooks.append(ProgressBar())
    if job.checkpoint.dir:
        c = job.checkpoint
        all_hooks.append(CheckpointSaver(c.dir, c.every_steps, c.every_secs, c.max_to_keep))
    all_hooks += hooks
    run = Run(job, role, client, start_step, tc.steps)
    for h in all_hooks:
        h.begin(run)

    optimizer = build_optimizer(job.optimizer.kind, job.optimizer.learning_rate)
    on_host = model.xp is np
    dev_grads = client.grads if on_host else {k: model.xp.empty_like(to_device(model.xp, v))
                                              for k, v in client.grads.items()}
    x_all, y_all = prep["train"]  # host memory; batches go to the device one at a time
    updates = examples = 0
    t0 = time.perf_counter()
    for epoch, x, y in batches(x_all, y_all, tc.batch_size, tc.seed, role.task, tc.epochs):
        if tc.steps and client.claim_ticket() >= tc.steps:
            break
        params = client.pull()
        if not on_host:
            params = {k: to_device(model.xp, v) for k, v in params.items()}
            x, y = to_device(model.xp, x), to_device(model.xp, y)
        loss = model.loss_and_grads(params, x, y, dev_grads)
        optimizer.deltas(dev_grads)
        if not on_host:
            for k, g in dev_grads.items():
                client.grads[k][...] = to_host(g)
        client.push()
        step = client.advance_step()
        updates += 1
        examples += len(y)
        info = StepInfo(step, loss, epoch, updates)
        for h in all_hooks:
            h.after_step(run, info)
    seconds = time.perf_counter() - t0
    log(role, f"done: {updates} updates, {examples} examples in {seconds:.1f} s")

    totals = allgather_json(cluster.workers, [examples, seconds])
    sleepy_barrier(cluster.workers)  # every push has landed: global_step is final
    for h in all_hooks:
        h.end(run)
    result = TrainResult(role, start_step, client.global_step(), updates, examples, seconds)
    if cluster.is_chief:
        _evaluate(model, client, prep["test"], result)
        result.total_examples = sum(e for e, _ in totals)
        wall = max(s for _, s in totals)
        rate = result.total_examples / wall if wall else 0.0
        log(role, f"final: global_step {result.global_step} test_accuracy "
                  f"{result.test_accuracy:.4f} test_loss {result.test_loss:.4f} "
                  f"({result.total_examples} examples on {cluster.layout.num_workers} workers "
                  f"in {wall:.1f} s, {rate:.0f} examples/s)")
    return result


def _evaluate(model: MLP, client: StoreClient, test: tuple[np.ndarray, np.ndarray],
              result: TrainResult) -> None:
    params = client.pull()
    xp = model.xp
    if xp is not np:
        params = {k: to_device(xp, v) for k, v in params.items()}
    x, y = (to_device(xp, a) for a in test)
    result.test_loss, result.test_accuracy = model.evaluate(params, x, y)
