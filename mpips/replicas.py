"""Synchronous replicas (``train.mode = "sync"``).

Every worker computes gradients on its own batch; the mean over all workers is taken with
bucketed, non-blocking allreduce that overlaps backward (sync.py); every replica then applies
the same update with the same optimizer code as the async path, so replicas stay bitwise
identical (checked every ``train.check_every`` steps and at the end). global_step advances
once per aggregated step, identically on every replica: no PS, no counter, no chief that can
run ahead. PS ranks, if the layout has any, hold nothing in this mode and sleep (passing on a
preemption signal they receive).
"""
from __future__ import annotations

import math
import time

import numpy as np

from . import preemption
from .data import batches, shard_rows
from .errors import AgreedError, AlreadyReported, NonFinite
from .hooks import Hook, StepInfo
from .job import Job, job_placement
from .log import log
from .nn import MLP
from .optim import Optimizer, clip_by_global_norm, learning_rate
from .store import Cluster, allgather_json
from .sync import (
    GradientBuckets,
    agree_max,
    broadcast,
    check_replicas,
    forward_stop,
    idle_until_end,
    replica_hash,
    stop_from_ps,
)
from .training import (
    PendingSave,
    Prepared,
    Run,
    TrainResult,
    build_hooks,
    loss_not_finite,
    report,
    save_whole,
    say_preempted,
)


def run_replicas(job: Job, cluster: Cluster, model: MLP, optimizer: Optimizer,
                 prep: Prepared, hooks: list[Hook]) -> TrainResult:
    """Train ``job`` as synchronous replicas on the workers (collective over the world).

    PS ranks, if the layout names any, hold nothing: they wait for the end of the run,
    passing a preemption signal they receive to the chief. At the end every rank agrees on
    the signal that stopped the run (if any), so every rank exits with the same code.
    """
    specs = model.variables()
    cluster.check_placement(job_placement(job, specs, 1))  # same variables on every rank
    comm, chief = cluster.comm, cluster.layout.chief_rank
    if cluster.is_ps:
        result = TrainResult(cluster.role, 0, 0)
        forwarded = [False]

        def forward() -> None:
            if preemption.requested() and not forwarded[0]:
                forward_stop(comm, chief, preemption.requested())
                forwarded[0] = True
        agreed_stop = idle_until_end(comm, preemption.requested(), forward)
        result.stopped_by = agreed_stop  # a signal too late to stop the run changes nothing
        return result
    result = _replica(job, cluster, model, optimizer, prep, hooks)
    # every rank, PS included, learns the signal that stopped the run: the same exit code
    result.stopped_by = agree_max(comm, [result.stopped_by or preemption.requested()],
                                  "the end of the run")[0]
    return result


def _batches_per_epoch(job: Job, rows: int, workers: int) -> int:
    """Full batches every worker can make each epoch (the same count on all replicas)."""
    b = job.train.batch_size
    per = min((stop - start) // b for start, stop in
              (shard_rows(rows, workers, k) for k in range(workers)))
    if per == 0:
        raise AgreedError(f"{rows} train rows give some of the {workers} workers less than "
                          f"one batch of {b}: lower train.batch_size")
    return per


def _replica(job: Job, cluster: Cluster, model: MLP, optimizer: Optimizer,
             prep: Prepared, hooks: list[Hook]) -> TrainResult:
    role, tc, oc = cluster.role, job.train, job.optimizer
    comm, workers = cluster.workers, cluster.layout.num_workers
    listen_to_ps = cluster.is_chief and cluster.layout.num_ps > 0
    specs = model.variables()
    params = {s.name: np.zeros(s.shape, s.dtype) for s in specs}
    slots = {s.name: {k: np.zeros(s.shape, s.dtype) for k in optimizer.slots} for s in specs}
    header = np.zeros(2, np.int64)  # start step, data position (batches used per worker)
    if cluster.is_chief:
        for name in params:
            params[name][...] = prep.values[name]
            for k in optimizer.slots:
                slots[name][k][...] = prep.slots[f"{name}/{k}"]
        clocks = prep.clocks
        same = clocks and len(clocks) == workers and len(set(clocks)) == 1
        header[:] = prep.start_step, clocks[0] if same else 0
        if prep.restored is not None:
            log(role, f"restored global_step {prep.start_step} from {prep.restored}")
    arrays = list(params.values()) + [a for s in slots.values() for a in s.values()]
    broadcast(comm, [header, *arrays])  # every replica starts from identical state
    step, clock = int(header[0]), int(header[1])
    start_step = step
    if cluster.is_chief and tc.steps and step >= tc.steps:
        log(role, f"global_step {step} already reached train.steps = {tc.steps}: nothing to "
                  f"train (raise train.steps or use another checkpoint dir)")

    per_epoch = _batches_per_epoch(job, prep.info.rows["train"], workers)
    start, stop = prep.rows
    buckets = GradientBuckets(comm, specs, tc.bucket_bytes)
    log(role, f"sync replica: shard rows [{start}, {stop}), {per_epoch} batches of "
              f"{tc.batch_size} an epoch, {len(buckets.buckets)} allreduce bucket(s)"
              + (f", resuming at batch {clock}" if clock else ""))

    def save() -> PendingSave:
        flat = {f"{n}/{k}": a for n, s in slots.items() for k, a in s.items()}
        return save_whole(job, cluster, step, params, flat, [clock] * workers)

    run = Run(job, role, start_step, tc.steps, lambda: step, save, params)
    all_hooks = build_hooks(job, hooks)
    for h in all_hooks:
        h.begin(run)
    updates = examples = 0
    t0 = time.perf_counter()
    stopped = 0
    assert prep.train is not None
    for epoch, x, y in batches(*prep.train, tc.batch_size, tc.seed, role.task, tc.epochs,
                               start_batch=clock, per_epoch=per_epoch):
        if tc.steps and step >= tc.steps:
            break
        buckets.start_step()
        loss = model.loss_and_grads(params, x, y, buckets.grads, ready=buckets.ready)
        mean = buckets.finish()
        # one small allreduce a step: a signal on any replica (or forwarded by a PS rank),
        # and the first replica whose loss is not finite, so all act on it together
        signal = preemption.requested() or (stop_from_ps(cluster.comm) if listen_to_ps else 0)
        stopped, bad = agree_max(comm, [signal, 0 if math.isfinite(loss) else role.task + 1])
        if bad:
            message = loss_not_finite(bad - 1, loss if bad - 1 == role.task else "not finite",
                                      step)
            raise NonFinite(message) if cluster.is_chief else AlreadyReported(message)
        if stopped:
            break  # this step's update is not applied: the checkpoint is exact at `step`
        clip_by_global_norm(list(mean.values()), oc.clip_norm)
        lr = learning_rate(oc, step)
        for name, var in params.items():
            optimizer.apply(var, mean[name], slots[name], lr, step + 1)
        step, clock, updates, examples = step + 1, clock + 1, updates + 1, examples + len(y)
        if tc.check_every and step % tc.check_every == 0:
            check_replicas(comm, arrays, step)
        info = StepInfo(step, loss, epoch, updates)
        for h in all_hooks:
            h.after_step(run, info)
    seconds = time.perf_counter() - t0
    check_replicas(comm, arrays, step)
    log(role, f"done: {updates} updates, {examples} examples in {seconds:.1f} s; replica "
              f"crc32 {replica_hash(arrays):08x}; {buckets.reduce_seconds:.2f} s waiting for "
              f"allreduce after backward")
    gathered = allgather_json(comm, [examples, seconds], "the replicas' summaries")
    for h in all_hooks:
        h.end(run)
    result = TrainResult(role, start_step, step, updates, examples, seconds, stopped_by=stopped)
    if cluster.is_chief:
        if stopped:
            say_preempted(role, stopped, job)
        assert prep.test is not None
        report(cluster, model, params, prep.test, result, gathered)
    return result
