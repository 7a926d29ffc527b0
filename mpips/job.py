"""Job file (TOML) -> validated, typed configuration.

Unknown keys and wrong types are errors that name the key (and suggest the closest one);
every number must be finite (NaN passes every range check, since ``nan < 0`` is false).

Relative paths in a job (data.path, the .npy files data.train_x ..., checkpoint.dir,
summary.dir) are relative to the working directory the job is started from, as in a Python
script and in TensorFlow (``model_dir``, file names given to tf.data): the directory the
command-line overrides (``--ckpt-dir``) and the built-in job (``runs/default``) use too.
A model of your own (``model.kind = "module:factory"``) is a module, not a path: it is
imported as Python imports a script's neighbours, from the job file's folder first, then
the working directory.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .process.files import read_text
from .schema import check_keys, check_ps

TABLE_KINDS = ("logreg", "wide_deep")  # the built-in models with row-partitioned tables


@dataclass
class ModelConfig:
    kind: str = "mlp"  # "mlp" (dense data), "logreg" / "wide_deep" (sparse CTR data),
    # or your own: "package.module:factory"
    args: dict = field(default_factory=dict)  # your own model's arguments ([model.args])
    hidden: list[int] = field(default_factory=lambda: [64])
    init_seed: int = 0
    embedding_dim: int = 8  # wide_deep: width of each feature's embedding row
    partition: str = "mod"  # tables split by rows over the PS tasks: "mod" or "div"


@dataclass
class DataConfig:
    path: str = ""  # an HDF5 or .npz file
    builtin: str = ""  # or a dataset that ships inside mpips: "digits"
    # the arrays: dataset paths in an HDF5 file (default "train/x" ...), array names in a
    # .npz file (default "x_train" ...), or .npy files (then no path)
    train_x: str = ""
    train_y: str = ""
    test_x: str = ""
    test_y: str = ""
    val_x: str = ""  # optional validation split (train.eval_every)
    val_y: str = ""
    num_classes: int = 0  # 0: the file's attribute num_classes, else largest label + 1
    x_scale: float = 0.0  # inputs are multiplied by it (0: the file's attribute, else 1)
    chunk_rows: int = 0  # stream each worker's part in chunks of N rows (0: read it whole)
    prefetch: int = 2  # chunks read ahead by a background thread when streaming
    # GPU workers: the part copied to the device once, batches gathered there (unset: when
    # it is read whole, dense, and fits in a quarter of the device's free memory, shared
    # by the workers on it)
    on_device: bool | None = None


@dataclass
class OptimizerConfig:
    kind: str = "sgd"  # sgd, momentum, adagrad, adam, ftrl
    learning_rate: float = 0.1
    momentum: float = 0.9  # momentum
    nesterov: bool = False  # momentum
    beta1: float = 0.9  # adam
    beta2: float = 0.999  # adam
    epsilon: float = 1e-7  # adam, adagrad
    initial_accumulator_value: float = 0.1  # adagrad, ftrl (n)
    l1: float = 0.0  # ftrl
    l2: float = 0.0  # ftrl
    schedule: str = "constant"  # constant, exponential, step
    decay_rate: float = 0.96
    decay_steps: int = 1000
    warmup_steps: int = 0  # linear warm-up over the first N global steps
    clip_norm: float = 0.0  # clip each update's gradients to this global norm (0: off)


@dataclass
class TrainConfig:
    mode: str = "async"
    steps: int = 0  # stop when global_step reaches this (0: no step limit)
    epochs: int = 0  # each worker makes this many passes over its part of the data
    # (0: no limit)
    batch_size: int = 32
    seed: int = 0
    log_every: int = 100  # per-worker log line every N of its own updates (0: off)
    progress: bool = True  # tqdm bar on the chief
    device: str = "cpu"  # "cpu" (numpy) or "gpu" (cupy, one device per local rank)
    max_staleness: int | None = None  # bounded staleness: lead over the slowest worker
    # sync_replicas: gradients the PS averages per step (0: every worker; fewer: the
    # others are backup workers, and their late gradients are dropped)
    replicas_to_aggregate: int = 0
    # (0: lock-step)
    bucket_bytes: int = 1 << 20  # sync: variables and gradients fused into buckets of this size
    check_every: int = 100  # sync: verify replicas with a copy each are identical every N steps
    eval_every: int = 0  # the chief evaluates on the validation split every N global steps
    # async: workers read the PS tasks' memory in place (MPI shared memory, every rank on
    # one node) instead of copying it each step, and apply their updates there under stripe
    # locks: Hogwild-style reads. Unset: on for async CPU jobs whose ranks share one node
    # (and whose PS memory fits its /dev/shm); false: copied pulls everywhere
    zero_copy: bool | None = None
    # async, GPU workers with copied pulls: the next step's pull runs on the host while the
    # device computes this step's backward (each gradient one update staler)
    overlap_pull: bool = False
    # BatchNorm's running statistics recomputed on the chief at the end of the run, from N
    # training batches with the final variables (0: off; they lag async updates)
    recompute_batch_norm: int = 0


@dataclass
class CheckpointConfig:
    dir: str = ""  # empty: no checkpoints
    every_steps: int = 0
    every_secs: float = 0.0
    max_to_keep: int = 3
    restore: bool = True  # resume from the latest checkpoint in dir
    # a PS writes a table's rows changed since its last checkpoint, up to this many times
    # on one whole (base) write; 0: every checkpoint writes its tables whole
    increments: int = 8
    # ... for a table partition or slot of at least this many MB: a smaller one is written as
    # a base each time (its row digests would cost about what writing it does)
    increments_min_mb: float = 64.0


@dataclass
class SummaryConfig:
    dir: str = ""  # metrics.jsonl and TensorBoard files (default: checkpoint.dir)
    every_steps: int = 20  # a record every N global steps (0: summaries off)
    all_workers: bool = False  # every worker writes its own (default: the chief only)
    tensorboard: bool = True  # TensorBoard event files beside metrics.jsonl
    timeline: bool = False  # a trace of every task's phases (timeline/*.json)


@dataclass
class TablesConfig:
    # "fixed": a table has the rows its model declares, one per data id below its row
    # count; "dynamic": ids of any value below 2^63, each PS task keeps rows for the ids it
    # owns, made when an id is first admitted (async and hybrid modes)
    kind: str = "fixed"
    capacity: int = 0  # dynamic: rows at most of a table on one PS task (0: no limit)
    min_count: int = 1  # dynamic: training pulls of an id before it gets a row
    ttl_steps: int = 0  # dynamic: a row not pulled for this many global steps is evicted
    # dynamic: "rowwise_adagrad", one Adagrad accumulator a row (optimizer.kind = "adagrad"
    # and its settings), or "" (the job's optimizer, slots as big as the rows)
    optimizer: str = ""
    dtype: str = "float32"  # dynamic: how rows are stored; "float16" halves them
    # dynamic: each worker caches the rows of its this many hottest ids (0: none), each at
    # most cache_steps of its steps old (its own pushes refresh them)
    cache_rows: int = 0
    cache_steps: int = 10


@dataclass
class LayoutConfig:
    ps: int | list[int] | str | None = None  # count, ranks or "per_node" (default: world // 4)
    world_size: int | None = None  # if set, the job refuses another world size
    placement: str = "round_robin"  # or "greedy" (fewest bytes first)
    pin: dict = field(default_factory=dict)  # variable name -> ps task (like tf.device)
    # a pinned variable still uses up its turn of the placement rule, as in TensorFlow 1.x's
    # replica_device_setter (default: the rule skips it, and the others fill its turn)
    pins_take_turns: bool = False
    # dense variables split by rows over every PS task (TensorFlow's partitioned variables):
    # these by name, and (if > 0) every one of at least this many bytes
    partition: list[str] = field(default_factory=list)
    partition_min_bytes: int = 0


@dataclass
class Job:
    name: str = "job"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    summary: SummaryConfig = field(default_factory=SummaryConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    tables: TablesConfig = field(default_factory=TablesConfig)
    source: str = "<defaults>"  # where it was read from (not a TOML key)


CHOICES = {
    "model.partition": ("mod", "div"),
    "optimizer.kind": ("sgd", "momentum", "adagrad", "adam", "ftrl"),
    "optimizer.schedule": ("constant", "exponential", "step"),
    "train.mode": ("async", "sync", "sync_replicas", "hybrid"),
    "train.device": ("cpu", "gpu"),
    "data.builtin": ("", "digits"),
    "layout.placement": ("round_robin", "greedy"),
    "tables.kind": ("fixed", "dynamic"),
    "tables.optimizer": ("", "rowwise_adagrad"),
    "tables.dtype": ("float32", "float16"),
}
NON_NEGATIVE = (
    "train.steps",
    "train.replicas_to_aggregate",
    "train.epochs",
    "train.log_every",
    "checkpoint.every_steps",
    "checkpoint.every_secs",
    "model.init_seed",
    "train.seed",
    "optimizer.momentum",
    "optimizer.initial_accumulator_value",
    "optimizer.l1",
    "optimizer.l2",
    "optimizer.warmup_steps",
    "optimizer.clip_norm",
    "train.check_every",
    "train.eval_every",
    "train.recompute_batch_norm",
    "data.num_classes",
    "data.x_scale",
    "data.chunk_rows",
    "summary.every_steps",
    "layout.partition_min_bytes",
    "checkpoint.increments",
    "checkpoint.increments_min_mb",
    "tables.capacity",
    "tables.ttl_steps",
    "tables.cache_rows",
)
POSITIVE = (
    "train.batch_size",
    "model.embedding_dim",
    "optimizer.learning_rate",
    "checkpoint.max_to_keep",
    "train.bucket_bytes",
    "optimizer.epsilon",
    "optimizer.decay_rate",
    "optimizer.decay_steps",
    "data.prefetch",
    "tables.min_count",
    "tables.cache_steps",
)
UNIT_INTERVAL = ("optimizer.beta1", "optimizer.beta2")  # [0, 1)
MAX_INT = (1 << 62) - 1  # the largest integer a setting may be (a checkpoint holds it)
MAX_INCREMENTS = 100  # checkpoint.increments (a reader refuses a longer chain: MAX_CHAIN)


def _type_name(t: Any) -> str:
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        list: "a list",
    }.get(t, getattr(t, "__name__", str(t)))


def _matches(value: Any, t: Any) -> bool:
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(t))
    if t is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(t)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def _describe(t: Any) -> str:
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(t) if a is not type(None))
    if origin is list:
        item = _describe(typing.get_args(t)[0]).removeprefix("a ").removeprefix("an ")
        return f"a list of {item}s"
    return _type_name(t)


def _fill(cls: type, table: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
    check_keys(table, names, where)
    kwargs = {}
    for name, value in table.items():
        t = hints[name]
        key = f"{where}.{name}" if where != "job" else name
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table [{name}], got {value!r}")
            kwargs[name] = _fill(t, value, name)
        elif not _matches(value, t):
            raise ConfigError(f"{key}: expected {_describe(t)}, got {value!r}")
        else:
            kwargs[name] = float(value) if t is float else value
    return cls(**kwargs)


def _check_finite(job: Job) -> None:
    """Every number of every section is finite: ``learning_rate = nan`` (or ``inf``) would
    pass the range checks below and make the run's first loss NaN. Every integer is at most
    MAX_INT, the largest a checkpoint's manifest holds: a seed or batch size above it would
    train and write checkpoints that no restore accepts."""
    for section in dataclasses.fields(job):
        config = getattr(job, section.name)
        if not dataclasses.is_dataclass(config):
            continue
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            key = f"{section.name}.{f.name}"
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}: must be a finite number, got {value}")
            ints = value if isinstance(value, list) else [value]
            big = [v for v in ints if isinstance(v, int) and v > MAX_INT]
            if big:
                raise ConfigError(f"{key}: must be at most 2**62 - 1, got {big[0]}")


def validate(job: Job) -> Job:
    """Check cross-field rules and value ranges (after overrides, too)."""
    _check_finite(job)
    _check_model_kind(job.model.kind)
    _check_ranges(job)
    _check_device(job)
    if job.train.max_staleness is not None and job.train.max_staleness < 0:
        raise ConfigError(f"train.max_staleness: must be >= 0, got {job.train.max_staleness}")
    if job.optimizer.kind == "ftrl" and job.optimizer.initial_accumulator_value <= 0:
        raise ConfigError("optimizer.initial_accumulator_value: FTRL needs a value > 0")
    if any(h <= 0 for h in job.model.hidden):
        raise ConfigError(f"model.hidden: layer sizes must be > 0, got {job.model.hidden}")
    _check_data(job.data)
    if job.summary.timeline and not (job.summary.dir or job.checkpoint.dir):
        raise ConfigError("summary.timeline: set summary.dir (or checkpoint.dir) for it")
    check_ps(job.layout.ps, "layout.ps")
    if job.train.steps == 0 and job.train.epochs == 0:
        raise ConfigError("train: give train.steps or train.epochs (or both) so the run can end")
    return job


def _check_model_kind(kind: str) -> None:
    """A built-in model, or "package.module:factory" (a model of your own); a file's path
    given for the module (``models/net.py:build``) says the module name to give."""
    if kind in ("mlp", "logreg", "wide_deep") or re.fullmatch(
        r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", kind
    ):
        return
    hint = _module_for_path(kind)
    if hint:
        raise ConfigError(
            f"model.kind: {kind!r} is a file's path: model.kind names a module as Python "
            f"imports it, {hint}"
        )
    raise ConfigError(
        f"model.kind: {kind!r} is not 'mlp', 'logreg', 'wide_deep' or "
        f'"package.module:factory" (a model of your own)'
    )


def _module_for_path(kind: str) -> str:
    """The model.kind to give for one that names its module by a file's path, relative
    (``models/net.py:build``: ``"models.net:build"``) or not (the file beside the job file:
    ``"net:build"``); empty if ``kind`` is no such path."""
    path, _, attr = kind.partition(":")
    if "/" not in path or not re.fullmatch(r"[A-Za-z_][\w.]*", attr):
        return ""
    parts = path.removeprefix("./").removesuffix(".py").split("/")
    if all(part.isidentifier() for part in parts):
        where = "looked for beside the job file, then in the working directory"
        return f'model.kind = "{".".join(parts)}:{attr}" ({where})'
    if not parts[-1].isidentifier():
        return ""
    return f'model.kind = "{parts[-1]}:{attr}" with {parts[-1]}.py beside the job file'


def _check_ranges(job: Job) -> None:
    """Each choice among its values, each number within its range (CHOICES, NON_NEGATIVE,
    POSITIVE, UNIT_INTERVAL)."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed if a)
            raise ConfigError(f"{key}: {value!r} is not one of {shown}")
    for key in NON_NEGATIVE + POSITIVE:
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        if value < 0 or (key in POSITIVE and value == 0):
            bound = "> 0" if key in POSITIVE else ">= 0"
            raise ConfigError(f"{key}: must be {bound}, got {value!r}")
    for key in UNIT_INTERVAL:
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        if not 0 <= value < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {value!r}")
    if job.checkpoint.increments > MAX_INCREMENTS:
        raise ConfigError(
            f"checkpoint.increments: at most {MAX_INCREMENTS} on one base, got "
            f"{job.checkpoint.increments} (a restore reads the base and every increment)"
        )


def _check_device(job: Job) -> None:
    """What train.device rules out (the mode's own rules are the mode's: Mode.check_job)."""
    if job.data.on_device and (job.train.device == "cpu" or job.data.chunk_rows):
        raise ConfigError(
            'data.on_device: only for train.device = "gpu" with a part read whole (not '
            "with data.chunk_rows: a streamed part is never whole)"
        )


def _check_data(d: DataConfig) -> None:
    """Where the arrays are: one file (path or builtin), or .npy files named one by one."""
    named = {f"{s}_{k}": getattr(d, f"{s}_{k}") for s in ("train", "test", "val") for k in "xy"}
    if d.path and d.builtin:
        raise ConfigError("data: give data.path or data.builtin, not both")
    if d.builtin and any(named.values()):
        raise ConfigError(
            f"data.builtin: its arrays are fixed; drop "
            f"{', '.join('data.' + k for k, v in named.items() if v)}"
        )
    for s in ("train", "test", "val"):
        if bool(named[f"{s}_x"]) != bool(named[f"{s}_y"]):
            raise ConfigError(f"data.{s}_x, data.{s}_y: give both or neither")
    if not d.path and not d.builtin and any(named.values()):
        if not (d.train_x and d.test_x):
            raise ConfigError(
                "data: .npy files need data.train_x, data.train_y, data.test_x and data.test_y"
            )
        odd = [v for v in named.values() if v and not v.endswith(".npy")]
        if odd:
            raise ConfigError(
                f"data: without data.path the arrays are .npy files; "
                f"{odd[0]!r} is not (or set data.path to the file that holds it)"
            )


def parse_job(text: str, source: str = "<string>") -> Job:
    """Parse and validate job TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    try:
        job = validate(_fill(Job, data, "job"))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    job.source = source
    return job


def load_job(path: str | Path | None = None) -> Job:
    """Read a job file; ``None`` gives the built-in default job (digits, async, 2 PS on 8 ranks)."""
    if path is None:
        text = resources.files("mpips.builtin").joinpath("default.toml").read_text()
        return parse_job(text, "<built-in default job>")
    return parse_job(read_text(path, ConfigError, f"job file {path}"), str(path))
