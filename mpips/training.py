"""The training loop: chief init/restore, async workers, PS serving, end of run, evaluation."""
from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from . import checkpoint, preemption
from .backend import get_xp, pin_blas_threads, to_device, to_host
from .data import DatasetInfo, batches, load_split, open_dataset, resolve_path, shard_rows
from .errors import AlreadyReported, CheckpointError, ConfigError, DataError, NonFinite
from .failure import set_role
from .hooks import CheckpointSaver, Hook, ProgressBar, StepInfo, StepLogger
from .job import Job, job_layout, job_placement
from .layout import Role
from .log import log
from .memory import check_fits
from .nn import MLP, build_model
from .optim import Optimizer, build_optimizer, clip_by_global_norm, learning_rate
from .placement import slot_placement
from .store import Cluster, Counters, StoreClient, Windows, agreed, allgather_json, barrier, serve
from .store.cluster import STALL_TIMEOUT, node_of_each_rank, stall_limit, start_limit, wait
from .store.counters import NO_MORE_TICKETS
from .store.watchdog import Watchdog
from .store.window import WindowPlan


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
    start_save: Callable[[], PendingSave]  # chief: begin a checkpoint (see CheckpointSaver)
    params: dict[str, Any] | None = None  # sync mode: this replica's variables
    save_seconds: float = 0.0             # chief: time spent writing checkpoints so far

    @property
    def is_chief(self) -> bool:
        return self.role.is_chief


@dataclass
class PendingSave:
    """A checkpoint at ``step`` being written; ``commit(block)`` commits its manifest once
    every shard is in place and returns it (None while shards are still being written, unless
    ``block``: then it waits, with a deadline naming the PS task that does not write)."""

    step: int
    commit: Callable[[bool], Path | None]


@dataclass
class Prepared:
    """Everything read or made at start-up, before any window exists (see _prepare)."""

    info: DatasetInfo
    start_step: int = 0
    restored: Path | None = None         # the manifest restored from, if any
    clocks: list[int] | None = None      # restored data position (updates per worker)
    rows: tuple[int, int] = (0, 0)       # worker: its shard of the train rows
    train: tuple[Any, Any] | None = None  # worker: its shard (x, y)
    test: tuple[Any, Any] | None = None   # chief: the test split
    values: dict[str, np.ndarray] = field(default_factory=dict)  # chief: variables to write
    slots: dict[str, np.ndarray] = field(default_factory=dict)   # chief: their slots
    local: dict[str, np.ndarray] = field(default_factory=dict)   # PS: what it fills itself


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
               slots: dict[str, Any], clocks: list[int]) -> PendingSave:
    """Chief, holding every variable: write one shard and commit it (done at once)."""
    c = job.checkpoint
    checkpoint.write_shard(c.dir, step, 0, 1, variables, slots)
    path = checkpoint.commit(c.dir, step, 1, checkpoint.whole_index(variables),
                             checkpoint.whole_index(slots),
                             manifest_meta(job, cluster, clocks), c.max_to_keep)
    return PendingSave(step, lambda block: path)


def say_preempted(role: Role, signum: int, job: Job) -> None:
    """The chief's last word on a run stopped by a signal: the checkpoint a rerun resumes
    from (the one just written at the end of the run, if there was anything to save)."""
    found = checkpoint.list_checkpoints(job.checkpoint.dir) if job.checkpoint.dir else []
    if not job.checkpoint.dir:
        saved = "no checkpoint.dir: not saved"
    elif found:
        saved = (f"checkpoint at global_step {found[-1][0]} in {job.checkpoint.dir}; rerun the "
                 f"same command to resume")
    else:
        saved = "no update was made, so there is no checkpoint; rerun the same command to start"
    log(role, f"stopped early by {preemption.name(signum)}: {saved} "
              f"(exit code {preemption.EXIT_PREEMPTED})")


def loss_not_finite(task: int, loss: float | str, step: int) -> str:
    """The message for a loss that is NaN or infinite (training stops there, said once)."""
    return (f"the loss of /job:worker/task:{task} is {loss} at global_step {step}: training "
            f"stopped, and no checkpoint holds non-finite values (learning rate too high? "
            f"lower optimizer.learning_rate, or set optimizer.clip_norm)")


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
    # numpy's overflow warnings, one storm per rank, give way to the check that stops the
    # job at the first loss that is not finite (naming the worker and the global step)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = _train(job, cluster, list(hooks))
    cluster.free()  # collective: only on success (an error aborts the world instead)
    return result


def _check_checkpoint_dir(job: Job, cluster: Cluster) -> None:
    """Found at start-up, not after training: a directory the writers cannot write, and a
    fresh start (``--no-restore``) into a directory that holds another run's checkpoints
    (the two runs would mix: pruning by step would keep the old run's later checkpoints, and
    the next plain rerun would restore the old run)."""
    c = job.checkpoint
    if not c.dir:
        return
    if not c.restore:
        found = checkpoint.list_checkpoints(c.dir)
        if found:
            raise CheckpointError(
                f"checkpoint.dir {c.dir} already holds {len(found)} checkpoint(s) of an earlier "
                f"run, the latest at global_step {found[-1][0]}; a fresh start there would mix "
                f"the two runs. Resume it (drop --no-restore), delete {c.dir}, or start afresh "
                f"in a new directory with --ckpt-dir DIR")
    writes = cluster.is_chief or (cluster.is_ps and job.train.mode == "async")
    if writes:
        checkpoint.check_writable(c.dir)


def _check_memory(job: Job, cluster: Cluster, model: Any, optimizer: Optimizer,
                  info: DatasetInfo) -> None:
    """What the ranks on this node will allocate for the model (PS windows, worker buffers;
    sync replicas: variables, slots and gradients) must fit in the memory available here.
    Sizes come from the data file's attributes and the job: a corrupt or hostile file must
    give one message, not an OOM kill."""
    layout, here = cluster.layout, cluster.node_ranks
    if job.train.mode == "sync":
        nbytes = sum(s.nbytes for s in model.variables()) * (2 + len(optimizer.slots))
        per_rank = [0 if layout.role(r).job == "ps" else nbytes for r in range(layout.world_size)]
    else:
        placement = job_placement(job, model.variables(), layout.num_ps, model.tables())
        slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
        plan = WindowPlan(placement, slots, job.train.batch_size * max(1, info.max_nnz))
        per_rank = plan.rank_bytes(layout, optimizer.stateful)
    largest = max(model.variables() + model.tables(), key=lambda s: s.nbytes)
    check_fits(sum(per_rank[r] for r in here),
               f"the model on this node ({len(here)} ranks; largest variable {largest.name} "
               f"{largest.dtype}{list(largest.shape)}, from {info.path})", ConfigError)


def _prepare(job: Job, cluster: Cluster, optimizer: Optimizer) -> Prepared:
    """Everything that can fail on bad input, done before any window exists.

    Restoring, each PS task reads the variables and slots it will hold (in parallel; table
    partitions re-sliced from the whole tables); in sync mode the chief reads them all.
    Starting afresh, each PS task initialises its table partitions and their slots.
    """
    _check_checkpoint_dir(job, cluster)
    info = open_dataset(resolve_path(job.data.path, job.data.builtin))
    prep = Prepared(info)
    c = job.checkpoint
    latest = checkpoint.latest_checkpoint(c.dir) if c.dir and c.restore else None
    ckpt = checkpoint.Checkpoint(latest) if latest else None
    if ckpt is not None:
        prep.start_step, prep.restored, prep.clocks = ckpt.step, latest, ckpt.clocks
    model = build_model(job.model, info)
    _check_memory(job, cluster, model, optimizer, info)
    specs = model.variables()
    if cluster.is_ps:
        if job.train.mode == "async":
            prep.local = _ps_fill(job, cluster, model, optimizer, ckpt)
        return prep
    task, workers = cluster.role.task, cluster.layout.num_workers
    prep.rows = shard_rows(info.rows["train"], workers, task)
    if prep.rows[1] <= prep.rows[0]:
        raise DataError(f"{info.path}: {info.rows['train']} train rows cannot feed "
                        f"{workers} workers")
    prep.train = load_split(info, "train", prep.rows)
    if cluster.is_chief:
        prep.test = load_split(info, "test")
        slot_specs = [e.spec for e in slot_placement(job_placement(job, specs, 1),
                                                     optimizer.slots)]
        if ckpt is None:
            prep.values = model.initial_values(job.model.init_seed)
            prep.slots = {f"{name}/{slot}": array for name, v in prep.values.items()
                          for slot, array in optimizer.init_slots(v).items()}
        elif job.train.mode == "sync":
            values = ckpt.read(specs, slot_specs)
            prep.values = {s.name: values[s.name] for s in specs}
            prep.slots = {s.name: values[s.name] for s in slot_specs}
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
    info = prep.info
    if not cluster.is_ps:
        pin_blas_threads(cluster.local_size)
    xp = agreed(cluster.comm, lambda: np if cluster.is_ps
                else get_xp(job.train.device, cluster.local_worker_index))
    model = build_model(job.model, info, xp)
    if job.train.mode == "sync":
        from .replicas import run_replicas
        return run_replicas(job, cluster, model, optimizer, prep, hooks)
    placement = job_placement(job, model.variables(), cluster.layout.num_ps, model.tables())
    cluster.check_placement(placement)
    slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
    windows = Windows(cluster.comm, cluster.layout, placement, slots, optimizer.stateful,
                      row_capacity=job.train.batch_size * max(1, info.max_nnz))
    if prep.local:  # a PS task: restored state or fresh table partitions
        for held in windows.held(cluster.role.task):
            for name, view in held.items():
                if name in prep.local:
                    view[...] = prep.local[name]
        windows.params.Sync()
    barrier(cluster.comm, "the start of training")  # filled before the chief raises ready
    if cluster.is_ps:
        def write_shard(step: int, variables: dict[str, Any], slots: dict[str, Any]) -> None:
            checkpoint.write_shard(job.checkpoint.dir, step, cluster.role.task,
                                   cluster.layout.num_ps, variables, slots)
        serve(cluster, windows, optimizer, write_shard if job.checkpoint.dir else None)
        result = TrainResult(cluster.role, 0, 0)
    else:
        result = _work(job, cluster, windows, model, optimizer, prep, hooks)
    # the chief has ended the run (its last checkpoint and evaluation are done)
    # a backstop only: a hung chief is named first by the PS tasks' watchdogs
    barrier(cluster.comm, "the end of the run", stall_limit(cluster.comm.size) + 5)
    result.stopped_by = Counters(windows).stop_signal()
    windows.free()  # collective, so never in a finally: a failing rank must reach Abort
    return result


def _start(job: Job, cluster: Cluster, client: StoreClient, prep: Prepared) -> tuple[int, int]:
    """Chief: write variables and slots, set counters, raise ready. Others: wait for it.

    Returns (start global_step, this worker's clock = batches of its shard already used).
    """
    counters, role, tc = client.counters, cluster.role, job.train
    workers = cluster.layout.num_workers
    if cluster.is_chief:
        clocks = prep.clocks
        if prep.restored is None:  # else the PS tasks have restored their shards
            client.write(prep.values, prep.slots)
        counters.set_counters(prep.start_step, clocks if clocks and len(clocks) == workers
                              else None)
        counters.raise_ready()
        if prep.restored is not None:
            log(role, f"restored global_step {prep.start_step} from {prep.restored}")
            if clocks and len(clocks) != workers:
                log(role, f"data position not restored: the checkpoint was written by "
                          f"{len(clocks)} workers, this run has {workers} (shards start afresh)")
        if tc.steps and prep.start_step >= tc.steps:
            log(role, f"global_step {prep.start_step} already reached train.steps = "
                      f"{tc.steps}: nothing to train (raise train.steps or use another "
                      f"checkpoint dir)")
    else:
        counters.wait_ready(start_limit(role.task))
    return counters.global_step(), int(counters.clocks()[0][role.task])


def _work(job: Job, cluster: Cluster, windows: Windows, model: MLP, optimizer: Optimizer,
          prep: Prepared, hooks: list[Hook]) -> TrainResult:
    role, tc, oc = cluster.role, job.train, job.optimizer
    client = StoreClient(windows, role.task, optimizer.stateful)
    counters = client.counters

    def start_save() -> PendingSave:
        """Ask every PS task to write its shard (in parallel, while the chief trains on);
        the chief commits the manifest when all are written."""
        step, clocks = counters.global_step(), [int(c) for c in counters.clocks()[0]]
        number, asked = counters.request_checkpoint(step), time.monotonic()

        def commit(block: bool) -> Path | None:
            if block:
                counters.wait_shards(number, step, STALL_TIMEOUT - (time.monotonic() - asked))
            elif counters.shards_missing(number):
                if time.monotonic() - asked > STALL_TIMEOUT:
                    counters.wait_shards(number, step, 0)  # raises, naming the PS tasks
                return None
            index = checkpoint.index_of(windows.placement, windows.slots)
            return checkpoint.commit(job.checkpoint.dir, step, windows.placement.num_ps,
                                     *index, manifest_meta(job, cluster, clocks),
                                     job.checkpoint.max_to_keep)
        return PendingSave(step, commit)

    # hooks begin before the chief raises ready, so their set-up (the progress bar's) does
    # not delay the chief's first update behind every other worker's
    run = Run(job, role, prep.start_step, tc.steps, counters.global_step, start_save)
    all_hooks = build_hooks(job, hooks)
    for h in all_hooks:
        h.begin(run)
    start_step, clock = _start(job, cluster, client, prep)
    start, stop = prep.rows
    log(role, f"shard rows [{start}, {stop}) of {prep.info.rows['train']} train rows, "
              f"batch {tc.batch_size}, pulls {client.nbytes / 1e6:.2f} MB per step from "
              f"{windows.placement.num_ps} ps task(s)"
              + (f", resuming at batch {clock}" if clock else ""))

    on_host = model.xp is np
    dev_grads = client.grads if on_host else {k: model.xp.empty_like(to_device(model.xp, v))
                                              for k, v in client.grads.items()}
    assert prep.train is not None
    x_all, y_all = prep.train  # host memory; batches go to the device one at a time
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
        lead = counters.wait_for_slowest(clock, tc.max_staleness, watchdog.check)
        pulled_at = counters.global_step()
        x, ids = model.prepare(x)  # sparse models: the batch's unique ids (rows to pull)
        params = client.pull(ids)
        if on_host:
            dev_grads = client.gradients()
        else:
            params = {k: to_device(model.xp, v) for k, v in params.items()}
            x, y = to_device(model.xp, x), to_device(model.xp, y)
        loss = model.loss_and_grads(params, x, y, dev_grads)
        if not math.isfinite(loss):  # nothing of it is pushed; said once over all workers
            message = loss_not_finite(role.task, loss, pulled_at)
            raise NonFinite(message) if counters.claim_failure() else AlreadyReported(message)
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
    duty = f"; {run.save_seconds:.2f} s of it writing checkpoints, the chief's duty" \
        if run.save_seconds else ""
    log(role, f"done: {updates} updates, {examples} examples in {seconds:.1f} s{duty}")

    # every push has landed, so global_step is final; a worker that never gets here is hung
    wait(cluster.workers.Ibarrier(), "the other workers", math.inf, watchdog.check)
    gathered = allgather_json(cluster.workers, [examples, seconds, stats.summary()],
                              "the workers' summaries")
    for h in all_hooks:
        h.end(run)
    result = TrainResult(role, start_step, counters.global_step(), updates, examples, seconds,
                         staleness=[stats.summary()])
    stopped = counters.stop_signal()
    if cluster.is_chief:
        if stopped:
            say_preempted(role, stopped, job)
        result.staleness = [g[2] for g in gathered]
        counts = [s["updates"] for s in result.staleness]
        fewer = len(counts) > 1 and counts[0] < 0.8 * sum(counts[1:]) / (len(counts) - 1)
        log(role, "updates per worker task: " + " ".join(map(str, counts))
            + (" (the chief made fewer: it also evaluates, logs and commits checkpoints)"
               if fewer else ""))
        for task, s in enumerate(result.staleness):
            if s["updates"]:
                log(role, f"staleness of /job:worker/task:{task}: {Staleness.describe(s)}")
        assert prep.test is not None
        x_test, ids = model.prepare(prep.test[0])
        report(cluster, model, client.pull(ids), (x_test, prep.test[1]), result, gathered)
        counters.end_run()  # the PS tasks may stop serving
    return result


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
