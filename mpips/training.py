"""The training loop: chief init/restore, async workers, PS serving, end of run, evaluation."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from . import checkpoint, preemption
from .backend import get_xp, pin_blas_threads, to_device, to_host
from .data import batches, load_split, open_dataset, resolve_path, shard_rows
from .errors import DataError
from .failure import set_role
from .hooks import CheckpointSaver, Hook, ProgressBar, StepInfo, StepLogger
from .job import Job, job_layout, job_placement
from .layout import Role
from .log import log
from .nn import MLP, build_model
from .optim import Optimizer, build_optimizer, clip_by_global_norm, learning_rate
from .placement import slot_placement
from .store import Cluster, Counters, StoreClient, Windows, agreed, allgather_json, serve, sleepy_barrier
from .store.cluster import POLL_SECONDS, node_of_each_rank
from .store.counters import NO_MORE_TICKETS
from .watchdog import Watchdog


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
    test_auc: float | None = None  # sparse CTR models
    staleness: list[dict[str, Any]] | None = None  # per worker task (chief: all workers)
    stopped_by: int = 0            # signal that stopped the run early (preemption), else 0


@dataclass
class Run:
    """What hooks can see and do, the same in async and sync mode."""

    job: Job
    role: Role
    start_step: int
    target_steps: int
    global_step: Callable[[], int]
    save: Callable[[], tuple[int, Path]]  # chief: commit a checkpoint -> (global_step, manifest)
    params: dict[str, Any] | None = None  # sync mode: this replica's variables

    @property
    def is_chief(self) -> bool:
        return self.role.is_chief


def build_hooks(job: Job, hooks: list[Hook]) -> list[Hook]:
    """The standard hooks of a job (logging, progress bar, checkpoints), then the caller's."""
    out: list[Hook] = [StepLogger(job.train.log_every)]
    if job.train.progress:
        out.append(ProgressBar())
    if job.checkpoint.dir:
        c = job.checkpoint
        out.append(CheckpointSaver(c.every_steps, c.every_secs))
    return out + hooks


def manifest_meta(job: Job, cluster: Cluster, clocks: list[int]) -> dict[str, Any]:
    """What a checkpoint manifest records besides the variables: the job, the layout and
    the data position (updates, i.e. batches, each worker task has used)."""
    layout = cluster.layout
    return {"job": job.source, "job_sha256": checkpoint.job_digest(job),
            "layout": {"world_size": cluster.comm.size, "ps": layout.num_ps,
                       "workers": layout.num_workers, "mode": job.train.mode},
            "clocks": clocks,
            "data": {"path": job.data.path or f"builtin:{job.data.builtin}",
                     "batch_size": job.train.batch_size, "seed": job.train.seed}}


def save_whole(job: Job, cluster: Cluster, step: int, variables: dict[str, Any],
               slots: dict[str, Any], clocks: list[int]) -> tuple[int, Path]:
    """Chief, holding every variable: write one shard and commit it."""
    c = job.checkpoint
    checkpoint.write_shard(c.dir, step, 0, 1, variables, slots)
    return step, checkpoint.commit(c.dir, step, 1, checkpoint.whole_index(variables),
                                   checkpoint.whole_index(slots),
                                   manifest_meta(job, cluster, clocks), c.max_to_keep)


def say_preempted(role: Role, signum: int, step: int, job: Job) -> None:
    saved = (f"checkpoint at global_step {step} in {job.checkpoint.dir}; rerun the same "
             f"command to resume" if job.checkpoint.dir else "no checkpoint.dir: not saved")
    log(role, f"stopped early by {preemption.name(signum)}: {saved} "
              f"(exit code {preemption.EXIT_PREEMPTED})")


def report(cluster: Cluster, model: Any, params: dict[str, Any], test: tuple[Any, Any],
           result: TrainResult, gathered: list[Any]) -> None:
    """Chief: evaluate on the test split and print the final line."""
    role = cluster.role
    xp = model.xp
    if xp is not np:
        params = {k: to_device(xp, v) for k, v in params.items()}
        test = tuple(to_device(xp, a) for a in test)
    metrics = model.evaluate(params, *test)
    result.test_loss, result.test_accuracy = metrics["loss"], metrics["accuracy"]
    result.test_auc = metrics.get("auc")
    result.total_examples = sum(g[0] for g in gathered)
    wall = max(g[1] for g in gathered)
    rate = result.total_examples / wall if wall else 0.0
    auc = f" test_auc {result.test_auc:.4f}" if result.test_auc is not None else ""
    log(role, f"final: global_step {result.global_step} test_accuracy "
              f"{result.test_accuracy:.4f} test_loss {result.test_loss:.4f}{auc} "
              f"({result.total_examples} examples on {cluster.layout.num_workers} workers "
              f"in {wall:.1f} s, {rate:.0f} examples/s)")


def train(job: Job, hooks: Iterable[Hook] = (), comm: MPI.Comm | None = None) -> TrainResult:
    """Run ``job`` on every rank of ``comm`` (collective): PS ranks serve, workers train."""
    comm = comm or MPI.COMM_WORLD
    nodes = node_of_each_rank(comm)
    layout = agreed(comm, lambda: job_layout(job, comm.size, nodes))
    cluster = Cluster(comm, layout)
    set_role(cluster.role)
    preemption.install()
    # if a process is killed, the launcher speaks only of pids: this line maps pids to tasks
    log(cluster.role, f"rank {cluster.rank}, pid {os.getpid()} on {socket.gethostname()}")
    result = _train(job, cluster, list(hooks))
    cluster.free()  # collective: only on success (an error aborts the world instead)
    return result


def _prepare(job: Job, cluster: Cluster, optimizer: Optimizer) -> dict[str, Any]:
    """Everything that can fail on bad input, done before any window exists.

    Restoring, each PS task reads the variables and slots it will hold (in parallel; table
    partitions re-sliced from the whole tables); in sync mode the chief reads them all.
    Starting afresh, each PS task initialises its table partitions and their slots.
    """
    info = open_dataset(resolve_path(job.data.path, job.data.builtin))
    prep: dict[str, Any] = {"info": info, "start_step": 0, "clocks": None}
    c = job.checkpoint
    latest = checkpoint.latest_checkpoint(c.dir) if c.dir and c.restore else None
    ckpt = checkpoint.Checkpoint(latest) if latest else None
    if ckpt is not None:
        prep.update(start_step=ckpt.step, restored=str(latest), clocks=ckpt.clocks)
    model = build_model(job.model, info)
    specs = model.variables()
    if cluster.is_ps:
        if job.train.mode == "async":
            prep["local"] = _ps_fill(job, cluster, model, optimizer, ckpt)
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
        slot_specs = [e.spec for e in slot_placement(job_placement(job, specs, 1),
                                                     optimizer.slots)]
        if ckpt is None:
            values = model.initial_values(job.model.init_seed)
            prep["values"] = values
            prep["slots"] = {f"{name}/{slot}": array for name, v in values.items()
                             for slot, array in optimizer.init_slots(v).items()}
        elif job.train.mode == "sync":
            values = ckpt.read(specs, slot_specs)
            prep["values"] = {s.name: values[s.name] for s in specs}
            prep["slots"] = {s.name: values[s.name] for s in slot_specs}
    return prep


def _ps_fill(job: Job, cluster: Cluster, model: Any, optimizer: Optimizer,
             ckpt: checkpoint.Checkpoint | None) -> dict[str, np.ndarray]:
    """What PS ``task`` writes into its own memory before training, by variable name:
    restoring, all it holds; afresh, its table partitions and their slots."""
    task = cluster.role.task
    placement = job_placement(job, model.variables(), cluster.layout.num_ps, model.tables())
    mine = placement.on_ps(task)
    slots = slot_placement(placement, optimizer.slots).on_ps(task)
    if ckpt is None:
        out = {}
        for e in mine:
            if e.whole is not None:
                out[e.name] = model.initial_rows(e.name, e.rows, job.model.init_seed)
                for slot, value in optimizer.init_slots(out[e.name]).items():
                    out[f"{e.name}/{slot}"] = value
        return out
    return ckpt.read([e.whole or e.spec for e in mine], [e.whole or e.spec for e in slots],
                     rows={e.name: e.rows for e in mine + slots if e.rows})


def _train(job: Job, cluster: Cluster, hooks: list[Hook]) -> TrainResult:
    optimizer = build_optimizer(job.optimizer)
    prep = agreed(cluster.comm, lambda: _prepare(job, cluster, optimizer))
    info = prep["info"]
    if not cluster.is_ps:
        pin_blas_threads(cluster.local_size)
    xp = agreed(cluster.comm, lambda: np if cluster.is_ps
                else get_xp(job.train.device, cluster.local_rank))
    model = build_model(job.model, info, xp)
    if job.train.mode == "sync":
        from .replicas import run_replicas
        return run_replicas(job, cluster, model, optimizer, prep, hooks)
    placement = job_placement(job, model.variables(), cluster.layout.num_ps, model.tables())
    cluster.check_placement(placement)
    slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
    windows = Windows(cluster.comm, cluster.layout, placement, slots, optimizer.stateful,
                      row_capacity=job.train.batch_size * max(1, info.max_nnz))
    if prep.get("local"):  # a PS task: restored state or fresh table partitions
        for held in windows.held(cluster.role.task):
            for name, view in held.items():
                if name in prep["local"]:
                    view[...] = prep["local"][name]
        windows.params.Sync()
    sleepy_barrier(cluster.comm)  # filled everywhere before the chief raises ready
    if cluster.is_ps:
        def write_shard(step: int, variables: dict[str, Any], slots: dict[str, Any]) -> None:
            checkpoint.write_shard(job.checkpoint.dir, step, cluster.role.task,
                                   cluster.layout.num_ps, variables, slots)
        serve(cluster, windows, optimizer, write_shard if job.checkpoint.dir else None)
        result = TrainResult(cluster.role, 0, 0)
    else:
        result = _work(job, cluster, windows, model, optimizer, prep, hooks)
        sleepy_barrier(cluster.comm)  # releases the PS ranks
    result.stopped_by = Counters(windows).stop_signal()
    windows.free()  # collective, so never in a finally: a failing rank must reach Abort
    return result


def _start(job: Job, cluster: Cluster, client: StoreClient, prep: dict[str, Any]) -> tuple[int, int]:
    """Chief: write variables and slots, set counters, raise ready. Others: wait for it.

    Returns (start global_step, this worker's clock = batches of its shard already used).
    """
    counters, role, tc = client.counters, cluster.role, job.train
    workers = cluster.layout.num_workers
    if cluster.is_chief:
        clocks = prep["clocks"]
        if "restored" not in prep:  # else the PS tasks have restored their shards
            client.write(prep["values"], prep["slots"])
        counters.set_counters(prep["start_step"], clocks if clocks and len(clocks) == workers
                              else None)
        counters.raise_ready()
        if "restored" in prep:
            log(role, f"restored global_step {prep['start_step']} from {prep['restored']}")
            if clocks and len(clocks) != workers:
                log(role, f"data position not restored: the checkpoint was written by "
                          f"{len(clocks)} workers, this run has {workers} (shards start afresh)")
        if tc.steps and prep["start_step"] >= tc.steps:
            log(role, f"global_step {prep['start_step']} already reached train.steps = "
                      f"{tc.steps}: nothing to train (raise train.steps or use another "
                      f"checkpoint dir)")
    else:
        counters.wait_ready()
    return counters.global_step(), int(counters.clocks()[0][role.task])


def _work(job: Job, cluster: Cluster, windows: Windows, model: MLP, optimizer: Optimizer,
          prep: dict[str, Any], hooks: list[Hook]) -> TrainResult:
    role, tc, oc = cluster.role, job.train, job.optimizer
    client = StoreClient(windows, role.task, optimizer.stateful)
    counters = client.counters
    start_step, clock = _start(job, cluster, client, prep)
    start, stop = prep["rows"]
    log(role, f"shard rows [{start}, {stop}) of {prep['info'].rows['train']} train rows, "
              f"batch {tc.batch_size}, pulls {client.nbytes / 1e6:.2f} MB per step from "
              f"{windows.placement.num_ps} ps task(s)"
              + (f", resuming at batch {clock}" if clock else ""))

    all_hooks = build_hooks(job, hooks)

    def save() -> tuple[int, Path]:
        """Every PS task writes its shard (in parallel), then the chief commits."""
        step, clocks = counters.global_step(), [int(c) for c in counters.clocks()[0]]
        num_ps = windows.placement.num_ps
        counters.wait_shards(counters.request_checkpoint(step) * num_ps)
        index = checkpoint.index_of(windows.placement, windows.slots)
        return step, checkpoint.commit(job.checkpoint.dir, step, num_ps, *index,
                                       manifest_meta(job, cluster, clocks),
                                       job.checkpoint.max_to_keep)

    run = Run(job, role, start_step, tc.steps, counters.global_step, save)
    for h in all_hooks:
        h.begin(run)

    on_host = model.xp is np
    dev_grads = client.grads if on_host else {k: model.xp.empty_like(to_device(model.xp, v))
                                              for k, v in client.grads.items()}
    x_all, y_all = prep["train"]  # host memory; batches go to the device one at a time
    stats = Staleness()
    watchdog = Watchdog(counters, cluster.layout, role.task)
    updates = examples = 0
    t0 = time.perf_counter()
    for epoch, x, y in batches(x_all, y_all, tc.batch_size, tc.seed, role.task, tc.epochs,
                               start_batch=clock):
        if preemption.requested():  # every worker stops at its next ticket
            counters.request_stop(preemption.requested())
            break
        if counters.claim_ticket() >= (tc.steps or NO_MORE_TICKETS):
            break
        lead = _wait_for_slowest(counters, clock, tc.max_staleness, watchdog)
        pulled_at = counters.global_step()
        x, ids = model.prepare(x)  # sparse models: the batch's unique ids (rows to pull)
        params = client.pull(ids)
        if on_host:
            dev_grads = client.gradients()
        else:
            params = {k: to_device(model.xp, v) for k, v in params.items()}
            x, y = to_device(model.xp, x), to_device(model.xp, y)
        loss = model.loss_and_grads(params, x, y, dev_grads)
        clip_by_global_norm(list(dev_grads.values()), oc.clip_norm)
        lr = learning_rate(oc, pulled_at)
        if not optimizer.stateful:
            for g in dev_grads.values():
                g *= -lr  # plain SGD: push the delta, Accumulate adds it on the PS
        if not on_host:
            for k, g in dev_grads.items():
                client.grads[k][...] = to_host(g)
        client.push(lr)
        step = counters.advance_step()
        clock += 1
        counters.publish_clock(role.task, clock)
        stats.add(lead, step - 1 - pulled_at)
        updates += 1
        examples += len(y)
        info = StepInfo(step, loss, epoch, updates, lead, step - 1 - pulled_at)
        for h in all_hooks:
            h.after_step(run, info)
    counters.publish_clock(role.task, clock, done=True)
    seconds = time.perf_counter() - t0
    log(role, f"done: {updates} updates, {examples} examples in {seconds:.1f} s")

    sleepy_barrier(cluster.workers, watchdog.check)  # every push has landed: global_step final
    gathered = allgather_json(cluster.workers, [examples, seconds, stats.summary()])
    for h in all_hooks:
        h.end(run)
    result = TrainResult(role, start_step, counters.global_step(), updates, examples, seconds,
                         staleness=[stats.summary()])
    stopped = counters.stop_signal()
    if cluster.is_chief:
        if stopped:
            say_preempted(role, stopped, result.global_step, job)
        result.staleness = [g[2] for g in gathered]
        for task, s in enumerate(result.staleness):
            if s["updates"]:
                log(role, f"staleness of /job:worker/task:{task}: {Staleness.describe(s)}")
        x_test, ids = model.prepare(prep["test"][0])
        report(cluster, model, client.pull(ids), (x_test, prep["test"][1]), result, gathered)
    return result


def _wait_for_slowest(counters: Counters, clock: int, bound: int | None,
                      watchdog: Watchdog) -> int:
    """This worker's lead over the slowest running worker, after waiting (sleeping) until
    it is at most ``bound`` (None: no bound, plain async; 0: lock-step)."""
    lead = counters.lead(clock)
    while bound is not None and lead > bound:
        watchdog.check()
        time.sleep(POLL_SECONDS / 10)
        lead = counters.lead(clock)
    return lead


class Staleness:
    """Per-worker distribution of two staleness measures of its updates.

    * lead: how many updates this worker was ahead of the slowest running worker when it
      pulled (what ``train.max_staleness`` bounds: stale-synchronous-parallel clocks);
    * delay: how many global steps other workers applied between its pull and its push.
    """

    def __init__(self) -> None:
        self.leads: list[int] = []
        self.delays: list[int] = []

    def add(self, lead: int, delay: int) -> None:
        self.leads.append(lead)
        self.delays.append(delay)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"updates": len(self.leads)}
        for name, values in (("lead", self.leads), ("delay", self.delays)):
            if values:
                a = np.asarray(values)
                out[name] = {"mean": round(float(a.mean()), 3), "p50": int(np.percentile(a, 50)),
                             "p90": int(np.percentile(a, 90)), "max": int(a.max())}
        return out

    @staticmethod
    def describe(s: dict[str, Any]) -> str:
        def one(d: dict[str, Any]) -> str:
            return f"mean {d['mean']:.2f} p50 {d['p50']} p90 {d['p90']} max {d['max']}"
        return (f"{s['updates']} updates; lead over slowest worker {one(s['lead'])}; "
                f"delay in global steps {one(s['delay'])}")
