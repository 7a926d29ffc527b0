"""Start-up: everything that can fail on bad input (the checkpoint directory, the data file,
memory for the model, the checkpoint to restore), done on every rank before any window or
buffer exists, so that a problem is one message and nothing has been trained or written."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from .. import checkpoint
from ..checkpoint.dynamic import IDS
from ..data.batches import (
    DatasetInfo,
    InMemoryPart,
    Part,
    StreamedPart,
    load_split,
    open_data,
    train_part,
    worker_rows,
)
from ..device.arrays import issparse
from ..errors import CheckpointError, ConfigError, DataError
from ..job import Job
from ..models.contract import Model
from ..models.initial import CHUNK_ELEMENTS, InitialValues, from_model, row_chunks, rows_of
from ..models.mlp import build_model
from ..models.variables import VariableSpec
from ..optim import Optimizer
from ..placement.layout import Layout
from ..placement.table import Placement, round_robin, slot_placement
from ..process.log import detail, log
from ..process.memory import check_fits, human
from ..store import Cluster, allgather_json
from .statistics import check_batch_statistics
from .summaries import summary_root


class StartMode(Protocol):
    """What start-up asks of the training mode (mpips.modes.Mode)."""

    @property
    def ps_holds_variables(self) -> bool: ...

    @property
    def chief_holds_dense(self) -> bool: ...

    def ps_applies(self, stateful: bool) -> bool: ...

    def store_placement(self, job: Job, model: Any, num_ps: int) -> Placement: ...

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None: ...

    def rank_bytes(
        self, job: Job, layout: Layout, model: Any, optimizer: Optimizer, info: DatasetInfo
    ) -> list[int]: ...


@dataclass
class Prepared:
    """Everything read or made at start-up, before any window exists (see prepare)."""

    info: DatasetInfo
    model: Any = None  # the job's model (its xp: this rank's device)
    start_step: int = 0
    restored: Path | None = None  # the manifest restored from, if any
    clocks: list[int] | None = None  # restored data position (updates per worker)
    position_lost: str = ""  # why a checkpoint's data position is not restored (if not)
    fingerprints: dict[str, int] = field(default_factory=dict)  # the model as built here
    model_changed: str = ""  # the restored checkpoint's model, where another model wrote it
    rows: tuple[int, int] = (0, 0)  # worker: its part of the train rows
    train: Part | None = None  # worker: its part of the train rows
    test: tuple[Any, Any] | None = None  # chief: the test split
    val: tuple[Any, Any] | None = None  # chief, with train.eval_every: the validation split
    val_split: str = ""  # its name: "val" if the file has one, else "test"
    values: dict[str, np.ndarray] = field(default_factory=dict)  # chief: variables to write
    slots: dict[str, np.ndarray] = field(default_factory=dict)  # chief: their slots
    # PS: what it fills itself, by name: restored arrays, or fillers of fresh table
    # partitions (called with the window's view, they write it a chunk of rows at a time)
    local: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StartUp:
    """What start-up works from, made once (mpips.training) before anything is prepared:
    the job (this run's copy), its mode, where this rank stands, the optimizer and the
    array module it computes with. The run's context (mpips.modes.RunContext) adds what
    start-up prepared, the device and the hooks."""

    job: Job
    mode: StartMode
    cluster: Cluster
    optimizer: Optimizer
    xp: ModuleType = np


def _take_checkpoint_dir(start: StartUp) -> None:
    """The checkpoint directory taken for this run, before anything reads or writes there:
    the chief checks a fresh start would not mix with an earlier run, then locks it
    (checkpoint.lock_directory: a second run on the same directory stops here, naming the
    first), and every rank learns the run's id, or the chief's refusal, in one exchange
    (the first step of start-up: nothing before it can fail, so every rank reaches it).
    The ranks that write shards tag them with that id."""
    job, cluster, c = start.job, start.cluster, start.job.checkpoint
    if not c.dir:
        return
    said: dict[str, str] = {}
    if cluster.is_chief:
        try:
            _refuse_mixed_start(job)
            lock = checkpoint.lock_directory(c.dir, job.source)
            said = {"run": lock.run}
            if lock.unlocked:
                log(
                    cluster.role,
                    f"warning: checkpoint.dir {c.dir} is not locked for this run: "
                    f"{lock.unlocked}; make sure no other run writes there meanwhile",
                )
        except Exception as e:  # noqa: BLE001 (said on every rank, after the exchange)
            said = {"error": str(e) if isinstance(e, CheckpointError) else repr(e)}
    if cluster.comm.size > 1:
        said = allgather_json(cluster.comm, said, "the checkpoint directory's lock")[
            cluster.layout.chief_rank
        ]
    if "error" in said:
        raise CheckpointError(said["error"])
    if not cluster.is_chief and start.mode.ps_holds_variables:
        # PS tasks write shards of this run; a worker may take over as the chief (survive
        # mode: docs/guide/failures.md) and commit them
        checkpoint.join_run(c.dir, said["run"])


def _refuse_mixed_start(job: Job) -> None:
    """A fresh start (``--no-restore``) into a directory that holds another run's
    checkpoints is refused, changing nothing there (the two runs would mix: pruning by step
    would keep the old run's later checkpoints, and the next plain rerun would restore the
    old run)."""
    c = job.checkpoint
    if not c.restore:
        found = checkpoint.list_checkpoints(c.dir)
        if found:
            raise CheckpointError(
                f"checkpoint.dir {c.dir} already holds {len(found)} checkpoint(s) of an earlier "
                f"run, the latest at global_step {found[-1][0]}; a fresh start there would mix "
                f"the two runs. Resume it (drop --no-restore), delete {c.dir}, or start afresh "
                f"in a new directory with --ckpt-dir DIR"
            )


def _check_checkpoint_dir(start: StartUp) -> None:
    """Found at start-up, not after training: a directory the writers cannot write."""
    c, cluster = start.job.checkpoint, start.cluster
    if not c.dir:
        return
    writes = cluster.is_chief or (cluster.is_ps and start.mode.ps_holds_variables)
    if writes:
        checkpoint.check_writable(c.dir)


def _check_summary_dir(start: StartUp) -> None:
    """The summaries' directory, checked like the checkpoints' by every rank that writes
    there (the chief, every worker with summary.all_workers, every task with a timeline,
    every PS task that applies updates itself)."""
    job, cluster = start.job, start.cluster
    root, s = summary_root(job), job.summary
    if not root or not (s.every_steps or s.timeline):
        return
    ps_applies = start.mode.ps_applies(job.optimizer.kind != "sgd")
    writes = (
        cluster.is_chief
        or s.timeline
        or (s.all_workers and not cluster.is_ps)
        or (cluster.is_ps and ps_applies and s.every_steps > 0)
    )
    if writes:
        checkpoint.check_writable(
            root, "summary.dir", "set summary.dir to another directory", "summaries"
        )
    if s.timeline:
        checkpoint.check_writable(
            f"{root}/timeline",
            "summary.dir",
            "set summary.dir to another directory",
            "the timeline",
        )


def _check_memory(start: StartUp, model: Any, info: DatasetInfo) -> None:
    """What the ranks on this node will allocate for the model (PS windows, worker buffers;
    sync replicas: variables, slots and gradients) must fit in the memory available here.
    Sizes come from the data file's attributes and the job: a corrupt or hostile file must
    give one message, not an OOM kill."""
    here, layout = start.cluster.node_ranks, start.cluster.layout
    per_rank = start.mode.rank_bytes(start.job, layout, model, start.optimizer, info)
    largest = max(model.variables() + model.tables(), key=lambda s: s.nbytes)
    check_fits(
        sum(per_rank[r] for r in here),
        f"the model on this node ({len(here)} ranks; largest variable {largest.name} "
        f"{largest.dtype}{list(largest.shape)}, from {info.path})",
        ConfigError,
    )


def prepare(start: StartUp, factory: Any = None, arrays: Any = None) -> Prepared:
    """Everything that can fail on bad input, done before any window exists.

    Restoring, each PS task reads the variables and slots it will hold (in parallel; table
    partitions re-sliced from the whole tables); in sync mode the chief reads them all.
    Starting afresh, each PS task initialises its table partitions and their slots.
    ``factory``: a model (or a callable making one) from the Python API, instead of
    model.kind; ``arrays``: the data as arrays from the Python API, instead of job.data.
    """
    job, cluster = start.job, start.cluster
    _take_checkpoint_dir(start)
    _check_checkpoint_dir(start)
    _check_summary_dir(start)
    if job.train.zero_copy and not cluster.one_node:
        raise ConfigError(
            "train.zero_copy: every rank must run on one node (the workers read the PS "
            f"tasks' memory in place); this job has {len(cluster.node_ranks)} of its "
            f"{cluster.comm.size} ranks here"
        )
    info = open_data(job.data, arrays)
    prep = Prepared(info)
    c = job.checkpoint
    latest = checkpoint.latest_checkpoint(c.dir) if c.dir and c.restore else None
    ckpt = checkpoint.Checkpoint(latest) if latest else None
    if ckpt is not None:
        prep.start_step, prep.restored = ckpt.step, latest
        prep.clocks, prep.position_lost = data_position(job, ckpt, cluster.layout.num_workers)
        wrote = ckpt.meta.get("model")
        if isinstance(wrote, str) and wrote != job.model.kind:
            prep.model_changed = wrote
    model = prep.model = build_model(job.model, info, start.xp, job.source, factory)
    if job.tables.kind == "dynamic" and hasattr(model, "use_dynamic_tables"):
        model.use_dynamic_tables()  # (a framework module's tables take any ids)
    model.worker = cluster.role.task if not cluster.is_ps else 0
    prep.fingerprints = model.fingerprints()  # (as built: compared once every rank is here)
    start.mode.check(job, cluster, model, info)
    check_batch_statistics(job.train.recompute_batch_norm, model, "train.recompute_batch_norm")
    _check_memory(start, model, info)
    if cluster.is_ps:
        if start.mode.ps_holds_variables:
            prep.local = _ps_fill(start, model, ckpt)
        return prep
    _worker_part(start, prep)
    if ckpt is not None:
        _restore_state(cluster, model, ckpt)
    if cluster.is_chief:
        _chief_part(start, prep, ckpt)
    return prep


def check_same_model(cluster: Cluster, mine: dict[str, int]) -> None:
    """Every rank built the same model: a framework module's initial parameters and buffers
    (its ``fingerprints``, taken as built) compared across ranks, the first that differs
    named (a module seeded on one rank only, or loading weights a node does not have, would
    train the chief's values while other ranks keep their own buffers and frozen
    parameters). Collective: call it once every rank has prepared (agreed)."""
    if cluster.comm.size == 1:
        return
    everyone = allgather_json(cluster.comm, mine, "the model check")
    differ = [n for n in mine if any(f.get(n) != mine[n] for f in everyone)]
    if differ or any(set(f) != set(mine) for f in everyone):
        name = differ[0] if differ else "the names of its values"
        ranks = [r for r, f in enumerate(everyone) if f.get(name) != everyone[0].get(name)]
        raise ConfigError(
            f"the model differs across ranks at {name} (rank 0 and rank {ranks[0]} built "
            f"different values): build it the same on every rank (mpips seeds the framework "
            f"with model.init_seed before calling the factory; load the same weights "
            f"everywhere)"
        )


def _restore_state(cluster: Cluster, model: Model, ckpt: checkpoint.Checkpoint) -> None:
    """A worker's model takes back the state (buffers, frozen parameters) the chief wrote
    into the checkpoint; values a checkpoint lacks keep the model's own."""
    kept = model.state()
    specs = [
        VariableSpec(n, tuple(a.shape), a.dtype.name)
        for n, a in kept.items()
        if n in ckpt.variables
    ]
    if not specs:
        return
    model.load_state(ckpt.read(specs))
    detail(
        cluster.role,
        f"restored the model's state ({len(specs)} values) from {ckpt.path.name}",
    )


def data_position(
    job: Job, ckpt: checkpoint.Checkpoint, workers: int
) -> tuple[list[int] | None, str]:
    """The data position to resume at (each worker's updates, i.e. batches of its part
    used), or None and why it is not restored. It counts batches of the checkpoint's
    ``train.batch_size``, in the order its ``train.seed`` shuffles them, over its number of
    workers' parts: if any of those changed, skipping that many batches would skip or
    replay the wrong rows, so the parts start afresh at batch 0."""
    clocks = ckpt.clocks
    if not clocks:
        return None, ""
    recorded = ckpt.meta.get("data") or {}
    why = []
    if len(clocks) != workers:
        why.append(
            f"the number of workers changed (the checkpoint was written by {len(clocks)}, "
            f"this run has {workers})"
        )
    for key, what in (("batch_size", "batch size"), ("seed", "seed")):
        now = getattr(job.train, key)
        if key in recorded and recorded[key] != now:
            why.append(
                f"the {what} changed (train.{key} = {recorded[key]} in the checkpoint, "
                f"{now} in this run)"
            )
    return (None, "; ".join(why)) if why else (clocks, "")


def _resume_hint(ckpt: checkpoint.Checkpoint) -> str:
    """What a restore that finds NaN or infinity in ``ckpt`` adds to its CheckpointError
    (exit 2 on every rank, before anything is trained or written): the run would only stop
    later on a NaN loss or update, blaming the learning rate."""
    return (
        f"a run resumed from it would fail on NaN losses or updates; resume from an earlier "
        f"checkpoint (move {ckpt.path.name} out of {ckpt.directory}; python -m mpips ckpt "
        f"list {ckpt.directory} lists them), or start afresh with --ckpt-dir DIR"
    )


def _worker_part(start: StartUp, prep: Prepared) -> None:
    """A worker: its part of the train rows (read whole, or streamed in chunks; on a GPU,
    copied there whole where data.on_device says so)."""
    job, cluster, xp = start.job, start.cluster, start.xp
    info, task, workers = prep.info, cluster.role.task, cluster.layout.num_workers
    prep.rows = worker_rows(info.rows["train"], workers, task)
    if prep.rows[1] <= prep.rows[0]:
        raise DataError(
            f"{info.path}: {info.rows['train']} train rows cannot feed {workers} workers"
        )
    prep.train = train_part(info, prep.rows, job.data.chunk_rows, job.data.prefetch)
    if isinstance(prep.train, StreamedPart):
        detail(
            cluster.role,
            f"train rows [{prep.rows[0]}, {prep.rows[1]}) streamed in chunks of "
            f"{job.data.chunk_rows} rows, {job.data.prefetch} read ahead",
        )
    elif isinstance(prep.train, InMemoryPart) and xp is not np and job.data.on_device is not False:
        prep.train = _on_device(job, cluster, prep.train, prep.model, xp)


def _on_device(
    job: Job, cluster: Cluster, part: InMemoryPart, model: Model, xp: ModuleType
) -> InMemoryPart:
    """A GPU worker's part copied to the device once, so a step gathers its batch there
    and nothing of it crosses (one PyTorch process keeps its data there likewise): when
    data.on_device is true, or unset and the part fits in a quarter of the device's free
    memory shared among the workers on that device. It stays on the host where the batch
    is needed there: sparse (CSR) parts, and models with tables or a ``prepare`` of their
    own (it finds a batch's ids on the host)."""
    forced = job.data.on_device
    host_only = (
        "sparse (CSR) rows"
        if issparse(part.x)
        else "a model with tables or a prepare() of its own"
        if model.tables() or type(model).prepare is not Model.prepare
        else ""
    )
    if host_only:
        if forced:
            raise ConfigError(f"data.on_device: the part stays on the host with {host_only}")
        detail(cluster.role, f"train rows stay on the host ({host_only})")
        return part
    nbytes = part.x.nbytes + part.y.nbytes + 8 * len(part.y)  # (and an epoch's order)
    free = xp.cuda.runtime.memGetInfo()[0]
    gpus = xp.cuda.runtime.getDeviceCount()
    sharing = len(range(cluster.local_worker_index % gpus, cluster.local_workers, gpus))
    if nbytes > (free if forced else free // (4 * sharing)):
        if forced:
            raise ConfigError(
                f"data.on_device = true: this worker's part takes {human(nbytes)}, its GPU "
                f"has {human(free)} free"
            )
        detail(
            cluster.role,
            f"train rows stay on the host: {human(nbytes)}, a quarter of the device's free "
            f"{human(free)} shared by {sharing} worker(s)",
        )
        return part
    detail(
        cluster.role,
        f"train rows copied to the device once ({human(nbytes)}); batches gathered there",
    )
    return InMemoryPart(xp.asarray(part.x), xp.asarray(part.y), xp)


def load_chief_splits(job: Job, prep: Prepared) -> None:
    """What the chief evaluates on: the test split, and the validation split (or the test
    split again) with train.eval_every. Also called by a worker that takes over as chief."""
    info = prep.info
    prep.test = load_split(info, "test")
    if job.train.eval_every:
        prep.val_split = "val" if "val" in info.rows else "test"
        prep.val = load_split(info, "val") if prep.val_split == "val" else prep.test


def _chief_part(start: StartUp, prep: Prepared, ckpt: checkpoint.Checkpoint | None) -> None:
    """The chief: the test (and validation) split, and the dense variables and slots it
    writes or holds: fresh, or restored where the chief holds them (sync, hybrid)."""
    job, optimizer, model = start.job, start.optimizer, prep.model
    specs = model.variables()
    load_chief_splits(job, prep)
    slot_specs = [e.spec for e in slot_placement(round_robin(specs, 1), optimizer.slots)]
    if ckpt is None:
        prep.values = model.checked_initial_values(job.model.init_seed)
        prep.slots = {
            f"{name}/{slot}": array
            for name, v in prep.values.items()
            for slot, array in optimizer.init_slots(v).items()
        }
    elif start.mode.chief_holds_dense:
        values = ckpt.read(specs, slot_specs, finite=_resume_hint(ckpt))
        prep.values = {s.name: values[s.name] for s in specs}
        prep.slots = {s.name: values[s.name] for s in slot_specs}


FILL_ELEMENTS = CHUNK_ELEMENTS  # a fresh table partition is written this many elements at a time


def table_initial(model: Any, optimizer: Optimizer) -> InitialValues:
    """The initial values of the model's table rows and of their optimizer slots, a chunk of
    FILL_ELEMENTS at a time: what a PS fills a fresh partition with, compares its partition
    with when it writes a checkpoint shard, and restores untouched rows from."""
    return from_model(model, optimizer, FILL_ELEMENTS)


def _fill_rows(
    model: Any,
    optimizer: Optimizer,
    table: str,
    rows: tuple[int, int, int],
    seed: int,
    slot: str,
    view: np.ndarray,
) -> None:
    """Write the initial values of ``rows`` of ``table`` (``slot``: of that slot) into a PS's
    own window ``view``, a chunk of rows at a time: memory for one chunk, whatever the size
    of the partition (a 100M-row table's values are never all in memory outside the
    window)."""
    part = range(*rows)
    for lo, hi in row_chunks(len(view), int(np.prod(view.shape[1:])), FILL_ELEMENTS):
        sub = part[lo:hi]
        view[lo:hi] = rows_of(model, optimizer, table, (sub.start, sub.stop, sub.step), seed)[slot]


def _ps_fill(
    start: StartUp, model: Any, ckpt: checkpoint.Checkpoint | None
) -> dict[str, np.ndarray]:
    """What PS ``task`` writes into its own memory before training, by variable name:
    restoring, all it holds (split variables' row blocks re-sliced from any partitioning);
    afresh, its table partitions and their slots (the chief writes the dense variables)."""
    job, cluster, optimizer = start.job, start.cluster, start.optimizer
    task, seed = cluster.role.task, job.model.init_seed
    placement = start.mode.store_placement(job, model, cluster.layout.num_ps)
    mine = placement.on_ps(task)
    slots = slot_placement(placement, optimizer.slots).on_ps(task)
    if ckpt is None:
        out: dict[str, Any] = {}
        for e in mine:
            if e.table:
                assert e.rows is not None
                out[e.name] = partial(_fill_rows, model, optimizer, e.name, e.rows, seed, "")
                for slot in optimizer.slots:
                    out[f"{e.name}/{slot}"] = partial(
                        _fill_rows, model, optimizer, e.name, e.rows, seed, slot
                    )
        return out
    written = [e.name for e in mine if e.table and e.name + IDS in ckpt.variables]
    if written:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: table '{written[0]}' was written as a dynamic table: "
            f'restore it with tables.kind = "dynamic"'
        )
    t0 = time.perf_counter()
    out = ckpt.read(
        [e.whole or e.spec for e in mine],
        [e.whole or e.spec for e in slots],
        rows={e.name: e.rows for e in mine + slots if e.rows},
        initial=table_initial(model, optimizer),
        finite=_resume_hint(ckpt),
    )
    mb, seconds = sum(a.nbytes for a in out.values()) / 1e6, time.perf_counter() - t0
    detail(
        cluster.role,
        f"read its {mb:.1f} MB of {ckpt.path.name} in {seconds:.2f} s "
        f"({mb / max(seconds, 1e-9):.0f} MB/s"
        + (
            f"; {human(ckpt.stored_bytes)} read from its shards, "
            f"{human(ckpt.regenerated_bytes)} of untouched table rows computed again)"
            if ckpt.regenerated_bytes
            else ")"
        ),
    )
    return out
