"""Every training mode, trained in process across COMM_WORLD (``mpips.train(job, comm)`` on
each rank, no launcher): the fast tier under MPI, ``mpirun -n 3 python -m pytest -m "not
slow"``, trains all four modes in seconds. Under plain pytest test_mpi_suite.py runs this
file in an mpiexec subprocess. N ranks: 1 PS task + N-1 workers (sync: N replicas). Each mode
is checked against what it must equal: sync and sync_replicas one process with W x the
batch, hybrid its lockstep reference, async every global step counted once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_hybrid import assert_close, hybrid_job, lockstep
from test_optimizers_mpi import read_ckpt
from test_sync_mpi import assert_one_process, one_process
from test_sync_mpi import write_job as sync_job
from test_sync_replicas import JOB as REPLICAS_JOB

import mpips
from mpips import layers
from mpips.device import standin
from mpips.errors import MpipsError
from mpips.job import load_job
from mpips.process import log
from mpips.run.hooks import Hook
from mpips.store import node_of_each_rank

pytestmark = pytest.mark.mpi(ranks=3)


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def one_node() -> bool:
    """Every rank shares one node (not so across the emulated nodes of .ci/run)."""
    return len(set(node_of_each_rank(world()))) == 1


@pytest.fixture
def shared(tmp_path, monkeypatch) -> Path:
    """Rank 0's tmp_path, every rank's working directory (the job's relative paths)."""
    comm = world()
    path = Path(comm.bcast(str(tmp_path) if comm.rank == 0 else None))
    monkeypatch.chdir(path)
    return path


@pytest.fixture(params=["cpu", "standin"])
def device(request, monkeypatch) -> str:
    """Where the workers compute: numpy, or the strict stand-in for cupy (mpips.device.standin:
    train.device = "gpu" without a GPU; a host array reaching a device one raises)."""
    if request.param == "standin":
        monkeypatch.setenv(standin.ENV, "1")
        return "gpu"
    return "cpu"


class Crossings(Hook):
    """This worker's host/device copies each step (the stand-in's counters), the batch's
    bytes and the variables' at the end."""

    def __init__(self):
        self.steps, self.batch, self.variables = [], 0, 0
        self.waits: list[int] = []  # the host's waits for the device, each step
        self.matmuls: list[int] = []  # matrix products launched, each step

    def begin(self, run):
        self.zero_copy = run.job.train.zero_copy  # as this run resolved it
        self.layers = len(run.job.model.hidden) + 1  # (the built-in MLP)

    def before_step(self, run):
        standin.traffic.reset()

    def after_step(self, run, info):
        t = standin.traffic
        self.steps.append((t.h2d_bytes, t.d2h_bytes, t.h2d_pageable, t.allocations, t.d2h_pageable))
        self.waits.append(t.waits)
        self.matmuls.append(t.launches["matmul"])
        # float32 digits, int64 labels; none of it with the part on the device (the default)
        on_device = run.job.data.on_device is not False
        self.batch = 0 if on_device else run.job.train.batch_size * (64 * 4 + 8)

    def end(self, run):
        self.variables = sum(v.nbytes for v in run.variables().values())

    def each_byte_once(
        self, copies_in: int, copies_out: int, scratch: int = 0, waits: int | None = None
    ) -> None:
        """After the first step, a step copies ``copies_in`` bytes in from page-locked
        memory, and the batch; ``copies_out`` out into page-locked memory; allocates
        nothing but ``scratch`` arrays (those of Adam's array rule, which the stand-in runs
        where cupy runs a fused kernel); the host waits for the device ``waits`` times
        (when given); and each layer's products are whole (3 a layer less one). A step that
        checks the replicas copies the variables out too, an epoch's last batch may be
        shorter (a buffer of its own), and a small batch array may happen to lie on a page
        locked with its neighbours."""
        steps = self.steps[1:]
        full = [s for s in steps if s[0] == copies_in + self.batch]
        assert steps and len(full) * 2 >= len(steps), (copies_in, self.batch, steps)
        for h2d, d2h, pageable, allocations, out_pageable in steps:
            assert h2d - pageable >= copies_in and pageable <= self.batch, steps
            assert h2d <= copies_in + self.batch, steps  # (nothing else came in)
            assert d2h in (copies_out, copies_out + self.variables), steps
            assert out_pageable <= d2h - copies_out, steps  # (only the check's copies)
            assert allocations == scratch or h2d < copies_in + self.batch, steps
        # (a step that checks the replicas waits for their copies too)
        checked = [w for s, w in zip(steps, self.waits[1:], strict=True) if s[1] == copies_out]
        assert waits is None or set(checked) == {waits}, self.waits
        # each kernel's gradient one matrix product, as every layer's output and the hidden
        # layers' input gradients: 3 a layer less one (not one a block of rows, as on the
        # host when a reduction is told: ~90 a step on the wide MLP, seen on an H100)
        assert set(self.matmuls[1:]) == {3 * self.layers - 1}, self.matmuls


def train(
    write, device: str = "cpu", hooks=(), timeline: bool = False
) -> tuple[mpips.Job, mpips.TrainResult]:
    """Rank 0 writes the job file (``write()``), every rank loads it and trains it on
    ``device`` (with ``timeline``: recording the timeline beside its checkpoints)."""
    comm = world()
    if comm.rank == 0:
        write()
    comm.Barrier()
    job = load_job("job.toml")
    job.train.device = device
    job.summary.timeline = job.summary.timeline or timeline
    return job, mpips.train(job, hooks, comm=comm)


def phases(shared: Path, job: mpips.Job, result: mpips.TrainResult) -> set[str]:
    """The phases a worker's timeline recorded."""
    path = shared / job.checkpoint.dir / f"timeline/worker-{result.role.task}.json"
    return {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}


REPLICA_PHASES = {"compute", "agreement", "reduce and update"}
ON_THE_DEVICE = {"copy in", "update on the device"}  # a GPU replica's


@pytest.mark.parametrize("memory", ["shared", "messages"])
def test_sync_in_process_equals_one_process(shared, device, memory, monkeypatch):
    """train.mode = "sync": every worker a replica, in process; equal to one process (with
    the variables in node shared memory, or exchanged as messages as across nodes: then
    each gradient is reduced as backward says it is ready, copied out of the device first)."""
    if memory == "messages":
        monkeypatch.setenv("MPIPS_SHARED_MEMORY", "0")
        if device == "gpu":  # blocks smaller than a kernel: on the host only, never on a device
            monkeypatch.setattr(layers, "BLOCK_BYTES", 1024)
    crossings = Crossings()
    job, result = train(lambda: sync_job(shared, "adam"), device, [crossings], timeline=True)
    seen = phases(shared, job, result)  # (no rows: no pull, no push)
    assert seen == REPLICA_PHASES | (ON_THE_DEVICE if device == "gpu" else set()), seen
    if device == "gpu":  # variables on the device: gradients out, their mean in
        # waits a step: the loss, the update's, and in shared memory one for all the
        # gradients' copies out (as messages one each: each is reduced as it comes)
        waits = 3 if memory == "shared" and one_node() else None
        crossings.each_byte_once(crossings.variables, crossings.variables, 4, waits)
    assert (result.global_step, result.updates) == (20, 20)
    world().Barrier()
    if world().rank == 0:
        assert assert_one_process(shared, job, world().size) == [20] * world().size


def test_sync_replicas_mode_through_a_ps_equals_one_process(shared, device):
    """train.mode = "sync_replicas": the workers' gradients averaged on the PS each step."""
    text = REPLICAS_JOB.format(mode="sync_replicas", optimizer="sgd", lr=0.1)
    job, result = train(lambda: (shared / "job.toml").write_text(text), device)
    if world().rank == 1:  # the chief
        assert result.global_step == 20
    world().Barrier()
    if world().rank == 0:
        variables, _, _ = read_ckpt(shared / "runs/sync_replicas/ckpt-20.json")
        want, _ = one_process(job, world().size - 1, 20)
        for name, value in want.items():
            np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6)


def test_async_counts_every_global_step_once_and_learns(shared, device, capsys):
    """Each global step counted once; the timeline's phases (a GPU worker's copies in and
    out as phases of their own)."""
    text = REPLICAS_JOB.format(mode="async", optimizer="sgd", lr=0.1).replace(
        "steps = 20", "steps = 60"
    )
    text += "[summary]\ntimeline = true\n"
    crossings = Crossings()
    previous = log.verbose()
    log.set_verbose(True)  # (each worker's start-up detail says how it pulls)
    try:
        job, result = train(lambda: (shared / "job.toml").write_text(text), device, [crossings])
    finally:
        log.set_verbose(previous)
    said = capsys.readouterr().out
    updates = world().allgather(result.updates if result.role.job == "worker" else None)
    if device == "gpu" and result.role.job == "worker":  # pulled variables in, gradients out
        # two waits a step: for the loss, and one for all the gradients' copies out
        crossings.each_byte_once(crossings.variables, crossings.variables, waits=2)
    expected = device == "cpu" and one_node()  # (collective: every rank asks)
    if result.role.job == "worker":  # the default on one node: zero copy, but on a GPU
        assert crossings.zero_copy is expected
        in_place = "(zero copy) and applies its updates there" in said
        assert in_place is expected, said[-2000:]
    assert updates[0] is None and sum(updates[1:]) == 60, updates  # rank 0: the PS task
    if result.role.job == "worker":
        assert 0 < result.examples <= result.updates * job.train.batch_size
        trace = json.loads(
            (shared / f"runs/async/timeline/worker-{result.role.task}.json").read_text()
        )
        phases = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
        copies = {"copy in", "copy out"}
        assert {"pull", "compute", "push and ack"} <= phases, phases
        assert copies <= phases if device == "gpu" else not copies & phases, phases
    if world().rank == 1:  # the chief
        assert result.global_step == 60
        assert result.test_accuracy is not None and result.test_accuracy > 0.5
    world().Barrier()
    if world().rank == 0:
        _, _, clocks = read_ckpt(shared / "runs/async/ckpt-60.json")
        assert clocks == updates[1:], "each worker's clock in the checkpoint"


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.01)])
def test_gpu_workers_with_zero_copy_copy_straight_from_the_ps_memory(
    shared, monkeypatch, optimizer, lr
):
    """train.zero_copy = true on GPU workers (the stand-in): the variables come in from the
    PS tasks' own memory, page-locked (no pull buffer, no Get), the gradients go out into
    page-locked push buffers and the worker applies its update in place on the host; every
    global step counted once, and it learns."""
    if not one_node():  # (collective: every rank skips) zero copy needs one node
        pytest.skip("zero copy: every rank on one node")
    monkeypatch.setenv(standin.ENV, "1")
    text = REPLICAS_JOB.format(mode="async", optimizer=optimizer, lr=lr)
    text = text.replace("steps = 20", "steps = 60\nzero_copy = true")
    crossings = Crossings()
    _, result = train(lambda: (shared / "job.toml").write_text(text), "gpu", [crossings])
    updates = world().allgather(result.updates if result.role.job == "worker" else None)
    if result.role.job == "worker":
        assert crossings.zero_copy is True
        # (the update runs on the host, so Adam's makes no device scratch either)
        crossings.each_byte_once(crossings.variables, crossings.variables, waits=2)
    assert sum(updates[1:]) == 60, updates
    if world().rank == 1:
        assert result.global_step == 60 and result.test_accuracy > 0.5
    world().Barrier()


@pytest.mark.parametrize(
    ("setting", "env", "in_place"),
    [("false", {}, False), ("true", {}, True), (None, {"MPIPS_SHARED_MEMORY": "0"}, False)],
)
def test_zero_copy_is_what_the_job_says_and_off_without_shared_memory(
    shared, monkeypatch, setting, env, in_place
):
    """train.zero_copy set is obeyed (true across nodes: refused); unset,
    MPIPS_SHARED_MEMORY=0 keeps the copied pulls (the test above: unset on one node, zero
    copy; across nodes, copied)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    text = REPLICAS_JOB.format(mode="async", optimizer="adam", lr=0.01).replace(
        "steps = 20", "steps = 8" + (f"\nzero_copy = {setting}" if setting else "")
    )
    crossings = Crossings()
    write = lambda: (shared / "job.toml").write_text(text)  # noqa: E731
    if in_place and not one_node():
        with pytest.raises(MpipsError, match="every rank must run on one node"):
            train(write, hooks=[crossings])
        return
    _, result = train(write, hooks=[crossings])
    if result.role.job == "worker":
        assert crossings.zero_copy is in_place
    world().Barrier()


def test_hybrid_tables_on_the_ps_dense_replicas_equal_lockstep(shared, device):
    """On the stand-in too: the dense replicas on the device, the rows copied in and their
    gradients out (page-locked), the sparse products as gathers and scatter-adds."""
    crossings = Crossings()
    job, result = train(
        lambda: hybrid_job(shared, "wide_deep", "sgd", 0.5, 24), device, [crossings], True
    )
    seen, rows = phases(shared, job, result), {"pull", "push and ack"}
    assert seen == REPLICA_PHASES | rows | (ON_THE_DEVICE if device == "gpu" else set()), seen
    if world().rank == 1:  # the chief
        assert result.global_step == 24
    for h2d, d2h, h2d_pageable, _, d2h_pageable in crossings.steps:
        # the rows and the dense mean come in from page-locked memory (the rows' buffers
        # are kept and grown), as many bytes as their gradients go out into locked memory;
        # only the sparse batch comes from pageable memory (but for a small array of it
        # that happens to lie on a page locked with its neighbours)
        assert d2h_pageable == 0 and h2d - h2d_pageable >= d2h, crossings.steps
    world().Barrier()
    if world().rank == 0:
        variables, _ = mpips_checkpoint(shared / "runs/s/ckpt-24.json").read_all()
        assert_close(variables, lockstep(job, 24, world().size - 1))


def test_async_ctr_rows_cross_from_page_locked_buffers(shared, monkeypatch):
    """GPU workers (the stand-in) of an async CTR job: each step the rows come in from the
    kept, page-locked row buffers and the dense variables from the locked pull buffers, as
    many bytes as their gradients go out into locked memory; only the sparse batch comes
    from pageable memory. (test_ctr_mpi.py: the values, with validations between.)"""
    monkeypatch.setenv(standin.ENV, "1")

    def write():
        hybrid_job(shared, "wide_deep", "adagrad", 0.3, 24)
        text = (shared / "job.toml").read_text()
        (shared / "job.toml").write_text(text.replace('mode = "hybrid"', 'mode = "async"'))

    crossings = Crossings()
    train(write, "gpu", [crossings])
    assert world().rank == 0 or crossings.steps
    for h2d, d2h, h2d_pageable, _, d2h_pageable in crossings.steps:
        # (a small batch array may happen to lie on a page locked with its neighbours)
        assert d2h_pageable == 0 and h2d - h2d_pageable >= d2h, crossings.steps


def mpips_checkpoint(path: Path):
    from mpips.checkpoint import Checkpoint

    return Checkpoint(path)


class PullEvery(Hook):
    """Reads the variables (a pull) after every ``n``-th update of this worker."""

    def __init__(self, n: int):
        self.n = n

    def after_step(self, run, info):
        if info.local_updates % self.n == 0:
            run.variables()


def test_overlap_pull_pulls_afresh_after_a_hooks_pull(shared, monkeypatch):
    """1 PS + 1 stand-in worker (ranks 0 and 1; rank 2 waits) with train.overlap_pull and a
    hook that pulls after every 3rd update: the step after such a pull pulls afresh (the
    buffers pulled ahead were overwritten: its delay is 0), the others use the variables
    pulled during the last backward, one update old (delay 1)."""
    from test_gpu_standin import OVERLAP_JOB, delayed_sgd

    comm = world()
    sub = comm.Split(0 if comm.rank < 2 else 1, comm.rank)
    monkeypatch.setenv(standin.ENV, "1")
    text = OVERLAP_JOB.format(overlap="true")
    if comm.rank == 0:
        (shared / "job.toml").write_text(text)
    comm.Barrier()
    try:
        if comm.rank < 2:
            result = mpips.train(load_job("job.toml"), [PullEvery(3)], comm=sub)
    finally:
        comm.Barrier()
        sub.Free()
    if comm.rank == 1:  # the worker: 10 of 30 steps pulled afresh (delay 0), 20 ahead (1)
        assert result.staleness[0]["delay"]["mean"] == round(20 / 30, 3), result.staleness
    if comm.rank == 0:
        variables, _, _ = read_ckpt(shared / "runs/p/ckpt-30.json")
        want = delayed_sgd(text, 30, fresh=lambda k: k % 3 == 0)
        for name, value in want.items():
            np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    comm.Barrier()
