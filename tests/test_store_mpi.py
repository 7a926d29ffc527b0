"""Store contracts across real ranks: run under `mpirun -n 3 python -m pytest` (1 PS + 2
workers), and with MPIPS_TEST_PS=2 under `mpirun -n 4` (2 PS + 2 workers). Every expected
value is computed from the layout, so the same tests check multi-PS routing.

Under plain pytest these are run by test_mpi_suite.py in an mpiexec subprocess, at both.
"""

import os
import time
from collections.abc import Callable

import numpy as np
import pytest

from mpips.errors import AgreedError, MpipsError
from mpips.models.variables import VariableSpec
from mpips.optim import Optimizer
from mpips.placement.layout import make_layout
from mpips.placement.table import round_robin

pytestmark = pytest.mark.mpi(ranks=3)

PS = int(os.environ["MPIPS_TEST_PS"]) if os.environ.get("MPIPS_TEST_PS") else None
SPECS = [
    VariableSpec("a", (1000,)),
    VariableSpec("b", (3, 7)),
    VariableSpec("c", (5,), "float64"),
    VariableSpec("d", (2,)),
]


def needs_one_node() -> None:
    """Skip on every rank unless every rank shares one node's memory: zero copy and the
    node-shared counters need it (the suite may run across emulated nodes). Collective."""
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    alone = node.size == MPI.COMM_WORLD.size  # the same answer on every rank
    node.Free()
    if not alone:
        pytest.skip("needs every rank on one node (node-shared memory)")


class Store:
    """Windows + client over COMM_WORLD with the default layout; freed collectively."""

    def __init__(self, specs=SPECS, optimizer=None, shared=False, apply=None):
        from mpi4py import MPI

        from mpips.placement.table import slot_placement
        from mpips.store import Cluster, StoreClient, Windows

        if shared:
            needs_one_node()
        self.comm = MPI.COMM_WORLD
        self.cluster = Cluster(self.comm, make_layout(self.comm.size, PS))
        self.placement = round_robin(specs, self.cluster.layout.num_ps)
        stateful = optimizer is not None and optimizer.stateful
        slots = slot_placement(self.placement, optimizer.slots) if stateful else None
        self.windows = Windows(
            self.comm, self.cluster.layout, self.placement, slots, stateful, shared=shared
        )
        rule = optimizer or Optimizer("sgd")  # zero copy: the workers apply it themselves
        self.client = StoreClient(
            self.windows, self.cluster.role.task, stateful, apply or rule.apply, rule.slots
        )
        self.control = self.client.control

    def close(self):
        """End of run: the workers finish, the chief ends the run (a serving PS stops), then
        every rank frees the windows."""
        from mpips.store import barrier

        if not self.cluster.is_ps:
            barrier(self.cluster.workers, "the test")
            if self.cluster.is_chief:
                self.control.end_run()
        barrier(self.comm, "the test")
        self.windows.free()
        self.cluster.free()


def slow_sgd(var, grad, slots, lr, t):
    """SGD with a pause between its loads and its stores: two workers in one stripe at once
    always lose an update."""
    before = var.copy()
    time.sleep(0.002)
    var[...] = before - lr * grad


@pytest.mark.parametrize("shared", [False, True], ids=["accumulate", "zero_copy"])
def test_pushes_of_ones_sum_exactly(shared):
    """Every worker pushes ones at once, over and over: no update is lost. Zero copy: each
    worker runs SGD (lr -1: plus the gradient; slowed down, so that updates without the
    stripe locks would overlap and lose increments) on the PS's memory; its big variable
    spans several stripes."""
    from mpips.store import barrier

    specs = SPECS + [VariableSpec("big", (3_000_000,))] if shared else SPECS
    s = Store(specs, shared=shared, apply=slow_sgd)
    # zero copy: 50 pushes a worker (each ~5 slowed stripes, ~0.5 s in all), begun together
    # (the barrier below: a loaded machine cannot start one worker after the other is done);
    # with the stripe locks taken out, 30 of 31 runs lost increments (1 to 30 of the 100;
    # 2026-12-06, the 2-core VM under load)
    pushes = 50 if shared else 200
    init = {spec.name: np.full(spec.shape, 0.5, spec.dtype) for spec in specs}
    if s.cluster.is_chief:
        s.client.initialise(init)
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        for g in s.client.grads.values():
            g[...] = 1
        assert s.client.applies_in_place == shared
        barrier(s.cluster.workers, "the test")  # the workers push at once
        for _ in range(pushes):
            s.client.push(lr=-1.0)  # (deltas: ignored by the Accumulate path)
        barrier(s.cluster.workers, "the test")
        got = s.client.pull()
        workers = s.cluster.layout.num_workers
        for name, value in got.items():
            np.testing.assert_array_equal(value, init[name] + workers * pushes, err_msg=name)
    s.close()


def test_a_stripe_lock_held_too_long_names_its_holder(monkeypatch):
    """Zero copy: worker 1 holds every stripe lock (as if hung mid-update); worker 0's push
    ends with Stalled naming worker 1 once the stall limit (here 1 s) has passed."""
    import mpips.store.stripes as stripes
    from mpips.errors import Stalled
    from mpips.store import barrier

    monkeypatch.setattr(stripes, "stall_limit", lambda index: 1.0)
    s = Store(SPECS + [VariableSpec("big", (3_000_000,))], shared=True)
    if s.cluster.is_chief:
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        mine = s.client._stripes
        words = [mine.locks[key] for key in mine.order]
        if s.cluster.role.task == 1:  # worker 1 writes 1 + 1
            assert all(stripes._try_lock(w, 2) == 0 for w in words)
        barrier(s.cluster.workers, "the test")
        if s.cluster.role.task == 0:
            t0 = time.monotonic()
            with pytest.raises(Stalled, match=r"locked by /job:worker/task:1 for \d+ s"):
                s.client.push(lr=0.1)
            assert time.monotonic() - t0 < 10
        barrier(s.cluster.workers, "the test")
        if s.cluster.role.task == 1:
            for w in words:
                stripes._unlock(w)
    s.close()


def test_in_place_adam_over_many_stripes_equals_a_local_apply(monkeypatch):
    """Zero copy, stripes of 4 KiB (more full stripes than lock words, slots cut with their
    variable), a scalar and a float64 variable: worker 0's Adam updates in the PS's memory
    are a local Optimizer.apply, bit for bit, variables and slots."""
    import mpips.store.stripes as stripes
    from mpips.store import barrier

    monkeypatch.setattr(stripes, "STRIPE_BYTES", 4096)
    monkeypatch.setattr(stripes, "OWN_WORD_BYTES", 4096)
    specs = SPECS + [VariableSpec("big", (100_000,)), VariableSpec("s", ())]
    opt = Optimizer("adam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7})
    s = Store(specs, optimizer=opt, shared=True)
    rng = np.random.default_rng(5)
    init = {v.name: rng.standard_normal(v.shape).astype(v.dtype) for v in specs}
    grads = [
        {v.name: rng.standard_normal(v.shape).astype(v.dtype) for v in specs} for _ in range(3)
    ]
    if s.cluster.is_chief:
        s.client.initialise(
            init, {f"{v.name}/{k}": np.zeros(v.shape, v.dtype) for v in specs for k in opt.slots}
        )
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        if s.cluster.role.task == 0:
            assert len(s.client._stripes.stripes) >= stripes.LOCKS_PER_PS  # every word of a PS
            for t, g in enumerate(grads, 1):
                for name, value in g.items():
                    s.client.gradients()[name][...] = value
                s.client.push(lr=0.01, t=t)
        barrier(s.cluster.workers, "the test")
        got, got_slots = s.client.pull(), s.client.pull_slots()
        want = {k: v.copy() for k, v in init.items()}
        slots = {k: opt.init_slots(v) for k, v in want.items()}
        for t, g in enumerate(grads, 1):
            for name in want:
                opt.apply(want[name], g[name], slots[name], 0.01, t)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
            for k in opt.slots:
                np.testing.assert_array_equal(got_slots[f"{name}/{k}"], slots[name][k], err_msg=k)
    s.close()


def test_each_big_variable_has_a_lock_word_of_its_own():
    """Zero copy: a variable of OWN_WORD_BYTES or more (under a stripe) has a lock word of its
    own, so two workers update two such variables at once; the small ones share one word."""
    from mpips.store.stripes import OWN_WORD_BYTES
    from mpips.store.window import LOCKS_PER_PS

    n = OWN_WORD_BYTES // 4
    specs = SPECS + [VariableSpec("k1", (3 * n,)), VariableSpec("k2", (n,))]
    s = Store(specs, optimizer=Optimizer("momentum", {"momentum": 0.9}), shared=True)
    if not s.cluster.is_ps:
        words = {key: len(updates) for key, updates in s.client._stripes.stripes.items()}
        own = [key for key in words if key % LOCKS_PER_PS]
        assert len(own) == 2 and all(words[key] == 1 for key in own), words
        assert sum(words.values()) == len(specs), "each variable in one piece"
    s.close()


def test_a_ps_holding_its_lock_words_keeps_its_memory_still():
    """Zero copy: while a PS task holds every lock word of its memory (as it does to write a
    checkpoint shard), no worker's update lands there; the updates land once it lets go."""
    from mpips.store import barrier
    from mpips.store.stripes import hold_ps, release_ps

    s = Store(SPECS + [VariableSpec("big", (3_000_000,))], shared=True)
    if s.cluster.is_chief:
        s.control.raise_ready()
    if s.cluster.is_ps:
        task = s.cluster.role.task
        hold_ps(s.windows, task)
        barrier(s.comm, "the test")  # the workers push now
        before = s.windows.local(s.windows.params).copy()
        time.sleep(0.5)
        s.windows.params.Sync()
        assert np.array_equal(s.windows.local(s.windows.params), before)
        release_ps(s.windows, task)
    else:
        s.control.wait_ready(timeout=30)
        for g in s.client.grads.values():
            g[...] = 1
        barrier(s.comm, "the test")
        t0 = time.monotonic()
        s.client.push(lr=-1.0)
        assert time.monotonic() - t0 > 0.4  # it waited for the PS tasks to let go
    barrier(s.comm, "the test")
    if not s.cluster.is_ps:
        got = s.client.pull()
        np.testing.assert_array_equal(got["big"], s.cluster.layout.num_workers)
    s.close()


def test_global_steps_are_unique_and_gapless():
    from mpips.store import allgather_json

    s = Store()
    per_worker = 300
    if s.cluster.is_chief:
        s.control.set_counters(0)
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        mine = [s.control.advance_step() for _ in range(per_worker)]
        assert mine == sorted(mine)  # each worker sees its own steps increase
        everyone = sum(allgather_json(s.cluster.workers, mine), [])
        total = per_worker * s.cluster.layout.num_workers
        assert sorted(everyone) == list(range(1, total + 1))
        assert s.control.global_step() == total
    s.close()


def test_tickets_stop_exactly_at_target():
    from mpips.store import allgather_json

    s = Store()
    start, target = 40, 137
    if s.cluster.is_chief:
        s.control.set_counters(start)
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        made = 0
        while s.control.begin_step(made)[0] < target:
            s.control.advance_step()
            made += 1
        assert sum(allgather_json(s.cluster.workers, made)) == target - start
        from mpips.store import barrier

        barrier(s.cluster.workers, "the test")
        assert s.control.global_step() == target
    s.close()


@pytest.mark.parametrize("counters", ["mpi", "shared"])
def test_a_step_claims_a_ticket_and_counts_its_update(monkeypatch, counters):
    """begin_step claims tickets exactly up to the target and reads global_step and the
    clocks; end_step gives unique, gapless global steps and counts each worker's clock. With
    MPI's atomics (as across nodes) and with the CPU's on node-shared memory (one node)."""
    from mpips.store import allgather_json, barrier

    if counters == "mpi":
        monkeypatch.setenv("MPIPS_SHARED_MEMORY", "0")
    else:
        needs_one_node()
    s = Store()
    assert s.windows.control_shared == (counters == "shared")
    start, target = 25, 170
    if s.cluster.is_chief:
        s.control.set_counters(start, [0] * s.cluster.layout.num_workers)
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        task, clock, mine = s.cluster.role.task, 0, []
        while True:
            ticket, step, lead = s.control.begin_step(clock)
            if ticket >= target:
                break
            assert start <= step < target
            mine.append(s.control.end_step(task))
            clock += 1
        assert mine == sorted(mine)
        everyone = sum(allgather_json(s.cluster.workers, mine), [])
        assert sorted(everyone) == list(range(start + 1, target + 1))
        barrier(s.cluster.workers, "the test")
        clocks, done = s.control.clocks()
        assert clocks[task] == clock == len(mine) and not done.any()
        assert s.control.global_step() == target
        _, _, lead = s.control.begin_step(clock)
        assert lead == clock - int(clocks.min())
    s.close()


def test_workers_wait_for_the_ready_flag():
    s = Store()
    init = {
        spec.name: np.arange(np.prod(spec.shape), dtype=spec.dtype).reshape(spec.shape)
        for spec in SPECS
    }
    if s.cluster.is_chief:
        time.sleep(0.5)  # a slow chief: the others must wait for the flag, not a fixed sleep
        s.client.initialise(init)
        s.control.raise_ready()
    elif not s.cluster.is_ps:
        t0 = time.monotonic()
        s.control.wait_ready(timeout=30)
        assert time.monotonic() - t0 > 0.3
        for name, value in s.client.pull().items():
            np.testing.assert_array_equal(value, init[name])
    s.close()


def test_placement_mismatch_names_the_first_differing_variable():
    from mpi4py import MPI

    from mpips.errors import PlacementMismatch
    from mpips.store import Cluster

    comm = MPI.COMM_WORLD
    cluster = Cluster(comm, make_layout(comm.size, PS))
    specs = list(SPECS)
    if comm.rank == comm.size - 1:  # "dict order" trap: one rank creates b before a
        specs[0], specs[1] = specs[1], specs[0]
    with pytest.raises(PlacementMismatch) as e:
        cluster.check_placement(round_robin(specs, cluster.layout.num_ps))
    text = str(e.value)
    last = cluster.layout.role(comm.size - 1)
    assert "variable #0" in text
    assert "rank 0 (/job:ps/task:0): a [1000] float32" in text
    assert f"rank {comm.size - 1} ({last}): b [3x7]" in text
    cluster.check_placement(round_robin(SPECS, cluster.layout.num_ps))  # agreeing ranks pass
    cluster.free()


def test_an_error_on_one_rank_is_agreed_by_all():
    from mpi4py import MPI

    from mpips.store import agreed

    comm = MPI.COMM_WORLD

    def prepare():
        if comm.rank == 1:
            raise MpipsError("data file x.h5: not found")
        return comm.rank

    with pytest.raises(AgreedError, match="data file x.h5: not found"):
        agreed(comm, prepare)
    assert agreed(comm, lambda: comm.rank * 2) == comm.rank * 2


def test_an_unexpected_start_up_error_is_said_once_with_exit_1():
    from mpi4py import MPI

    from mpips.store import agreed

    comm = MPI.COMM_WORLD

    def prepare():
        raise FileNotFoundError("no such file: default.toml")

    with pytest.raises(AgreedError) as e:
        agreed(comm, prepare)
    assert e.value.exit_code == 1
    assert str(e.value).startswith("unexpected error during start-up:\nTraceback")
    assert str(e.value).count("FileNotFoundError: no such file: default.toml") == 1


@pytest.mark.parametrize("wait", [True, False])
def test_adagrad_on_the_ps_loses_no_update(wait):
    """Accumulator = initial value + sum of the squares of every gradient any worker pushed,
    also when a worker goes on before the PS applied its push (``wait=False``: the next push
    waits for the inbox to be free, the pull for the update)."""
    from mpips.optim import Optimizer
    from mpips.store import allgather_json, serve

    specs = [VariableSpec("w", (64,)), VariableSpec("b", (3,), "float64")]
    opt = Optimizer("adagrad", {"epsilon": 1e-7, "initial_accumulator_value": 0.1})
    s = Store(specs, opt)
    pushes = 40
    if s.cluster.is_ps:
        served = serve(s.cluster, s.windows, opt.apply, opt.slots)
        assert served == pushes * s.cluster.layout.num_workers
    else:
        if s.cluster.is_chief:
            init = {sp.name: np.zeros(sp.shape, sp.dtype) for sp in specs}
            s.client.initialise(
                init,
                {f"{k}/accumulator": opt.init_slots(v)["accumulator"] for k, v in init.items()},
            )
            s.control.raise_ready()
        s.control.wait_ready(timeout=30)
        rng = np.random.default_rng(s.cluster.role.task)
        mine = {sp.name: np.zeros(sp.shape) for sp in specs}
        for _ in range(pushes):
            for name, g in s.client.grads.items():
                g[...] = rng.uniform(-2, 2, g.shape).round(2)
                mine[name] += g.astype(np.float64) ** 2
            s.client.push(lr=0.01, wait=wait)
        s.client.settle()  # its last update is applied before the others read
        totals = allgather_json(s.cluster.workers, {k: v.tolist() for k, v in mine.items()})
        from mpips.store import barrier

        barrier(s.cluster.workers, "the test")
        got = s.client.pull_slots()
        for sp in specs:
            want = 0.1 + sum(np.asarray(t[sp.name]) for t in totals)
            tol = 1e-6 if sp.dtype == "float64" else 2e-4
            np.testing.assert_allclose(got[f"{sp.name}/accumulator"], want, rtol=tol)
    s.close()


def test_a_shard_holds_every_update_counted_before_its_request():
    """Workers count an update when they post it (push(wait=False)), before the PS applies
    it. Worker 1's update keeps the PS busy while the chief posts one and asks for a
    checkpoint at global_step 2: the PS applies the chief's update before it writes."""
    import time

    from mpips.optim import Optimizer
    from mpips.store import barrier, serve

    specs = [VariableSpec("w", (16,))]
    opt = Optimizer("adagrad", {"epsilon": 1e-7, "initial_accumulator_value": 0.0})
    s = Store(specs, opt)
    if s.cluster.is_ps:
        shards = []

        def slow_first(var, grad, slots, lr, t):
            if t == 1:
                time.sleep(0.5)  # worker 1's update: the chief posts and asks meanwhile
            opt.apply(var, grad, slots, lr, t)

        def write_shard(step, variables, slots):
            shards.append((step, slots.get("w/accumulator", np.full(1, 2.0)).copy()))

        serve(s.cluster, s.windows, slow_first, opt.slots, write_shard)
        [(step, accumulator)] = shards  # (a PS task without w: nothing to check)
        # each update adds g^2 = 1: the shard holds both updates counted at step 2
        assert step == 2 and accumulator.min() == 2, (step, accumulator)
    else:
        if s.cluster.is_chief:
            s.client.initialise(
                {"w": np.zeros(16, np.float32)}, {"w/accumulator": np.zeros(16, np.float32)}
            )
            s.control.set_counters(0)
            s.control.raise_ready()
        s.control.wait_ready(timeout=30)
        task = s.cluster.role.task
        s.client.grads["w"][...] = 1
        if task == 1:
            s.client.push(lr=0.01, wait=False)
            s.control.end_step(task)
        barrier(s.cluster.workers, "the test")
        if s.cluster.is_chief:
            time.sleep(0.1)  # the PS is applying worker 1's update
            s.client.push(lr=0.01, wait=False)
            s.control.end_step(task)
            number = s.control.request_checkpoint(s.control.global_step())
            s.control.wait_shards(number, 2, timeout=30)
        s.client.settle()
        barrier(s.cluster.workers, "the test")
    s.close()


def test_sum_of_pushed_sgd_deltas_equals_the_change():
    from mpips.store import allgather_json, barrier

    s = Store()
    pushes = 50
    if s.cluster.is_chief:
        s.client.initialise({sp.name: np.full(sp.shape, 1.0, sp.dtype) for sp in SPECS})
        s.control.raise_ready()
    if not s.cluster.is_ps:
        s.control.wait_ready(timeout=30)
        rng = np.random.default_rng(10 + s.cluster.role.task)
        mine = {sp.name: np.zeros(sp.shape) for sp in SPECS}
        for _ in range(pushes):
            for name, g in s.client.grads.items():
                g[...] = rng.integers(-8, 9, g.shape) / 8  # exact in float32: sums are exact
                mine[name] += g
            s.client.push()
        totals = allgather_json(s.cluster.workers, {k: v.tolist() for k, v in mine.items()})
        barrier(s.cluster.workers, "the test")
        got = s.client.pull()
        for sp in SPECS:
            want = 1.0 + sum(np.asarray(t[sp.name]) for t in totals)
            np.testing.assert_array_equal(got[sp.name], want.astype(sp.dtype), err_msg=sp.name)
    s.close()


def test_each_variable_lives_on_the_ps_task_its_placement_names():
    """What the chief writes lands in the window of the PS task the placement names, at its
    offset, and nowhere else."""
    s = Store()
    init = {spec.name: np.full(spec.shape, i + 1, spec.dtype) for i, spec in enumerate(SPECS)}
    if s.cluster.is_chief:
        s.client.initialise(init)
        s.control.raise_ready()
    from mpips.store import barrier

    barrier(s.comm, "the test")
    if s.cluster.is_ps:
        task = s.cluster.role.task
        s.windows.params.Sync()  # see the chief's Puts in this rank's own memory
        held, _ = s.windows.held(task)
        assert sorted(held) == sorted(e.name for e in s.placement.on_ps(task))
        for name, view in held.items():
            np.testing.assert_array_equal(view, init[name], err_msg=name)
        assert len(held) < len(SPECS) or s.cluster.layout.num_ps == 1
    s.close()


@pytest.mark.parametrize("shared", [False, True], ids=["accumulate", "zero_copy"])
@pytest.mark.parametrize("rule", ["mod", "div"])
def test_table_rows_come_from_and_go_to_their_owners(rule, shared):
    """A table split by rows over every PS task: each PS fills its part with the global row
    numbers; a pull of any ids returns those numbers, and a push of ones adds to exactly the
    pushed rows, on whichever task holds them. Zero copy: every worker runs SGD (lr -1) on
    the rows in the PS's memory, 50 times, at once: no update is lost."""
    from mpi4py import MPI

    from mpips.placement.table import partition_rows, place_tables
    from mpips.store import Cluster, StoreClient, Windows, barrier

    if shared:
        needs_one_node()
    comm = MPI.COMM_WORLD
    cluster = Cluster(comm, make_layout(comm.size, PS))
    rows = 1001
    table = VariableSpec("t", (rows, 2))
    placement = place_tables(
        round_robin([VariableSpec("bias", (1,))], cluster.layout.num_ps), [table], rule
    )
    windows = Windows(comm, cluster.layout, placement, shared=shared)
    pushes = 50 if shared else 1
    if cluster.is_ps:
        task = cluster.role.task
        mine = np.arange(rows)[slice(*partition_rows(rows, cluster.layout.num_ps, rule)[task])]
        windows.fill_own(task, {"t": np.repeat(mine[:, None], 2, 1).astype(np.float32)})
    barrier(comm, "the test")
    ids = np.unique(np.random.default_rng(cluster.rank).integers(0, rows, 300))
    if not cluster.is_ps:
        client = StoreClient(windows, cluster.role.task, False, Optimizer("sgd").apply)
        assert client.applies_in_place == shared
        got = client.pull(ids)["t"]
        np.testing.assert_array_equal(got[:, 0], ids)
        barrier(cluster.workers, "the test")  # every worker has pulled before any pushes
        for _ in range(pushes):
            client.pull(ids)
            for g in client.gradients().values():
                g[...] = 1
            client.push(lr=-1.0)  # (deltas: ignored by the Accumulate path)
    barrier(comm, "the test")
    from mpips.store import allgather_json

    pushed = allgather_json(comm, [] if cluster.is_ps else ids.tolist())
    if cluster.is_ps:
        task = cluster.role.task
        start, stop, step = partition_rows(rows, cluster.layout.num_ps, rule)[task]
        want = np.arange(start, stop, step).astype(np.float32)
        for theirs in pushed:
            hit = np.asarray([i for i in theirs if i in range(start, stop, step)], int)
            np.add.at(want, (hit - start) // step, pushes)
        np.testing.assert_array_equal(windows.held(task)[0]["t"][:, 1], want)
    barrier(comm, "the test")
    windows.free()
    cluster.free()


@pytest.mark.parametrize(
    "backends",
    [("libatomic",) * 2, ("numba",) * 2, ("libatomic", "numba")],
    ids=["libatomic", "numba", "both"],
)
def test_the_cpus_atomics_lose_nothing_between_processes(backends):
    """atomics.py on node-shared memory, every rank at once: fetch_add counts every add,
    compare_and_swap lets exactly one of several swaps from the same old value win, and a
    lock made of it keeps a plain read-modify-write of another word whole. Through
    libatomic, through numba (the fallback), and the two at once (even ranks one, odd ranks
    the other: both are the CPU's atomics)."""
    from mpi4py import MPI

    from mpips.store import atomics, barrier

    needs_one_node()
    if backends[0] == "libatomic" and atomics._libatomic() is None:
        pytest.skip("no libatomic here")
    comm = MPI.COMM_WORLD
    win = MPI.Win.Allocate_shared(40 if comm.rank == 0 else 0, disp_unit=8, comm=comm)
    counter, swapped, lock, plain, claims = range(5)
    array = np.frombuffer(win.Shared_query(0)[0], dtype=np.int64)
    if comm.rank == 0:
        array[:] = 0
    words = atomics.Words(array, backends[comm.rank % 2])
    barrier(comm, "the test")
    n = 50_000
    for _ in range(n):
        words.fetch_add(counter, 1)
    for _ in range(n):  # count by compare-and-swap: a swap that lost retries from the new value
        old = words.load(swapped, 1)[0]
        while (seen := words.compare_and_swap(swapped, old, old + 1)) != old:
            old = seen
    for _ in range(n // 4):
        while words.compare_and_swap(lock, 0, comm.rank + 1) != 0:
            pass
        value = int(array[plain])  # a plain load and store: only the lock keeps it whole
        array[plain] = value + 1
        assert words.exchange(lock, 0) == comm.rank + 1
    at, out = np.array([counter, plain], np.int64), np.zeros(2, np.int64)
    tickets = [words.add_then_load(claims, 1, at, out) for _ in range(n // 4)]
    total = comm.size * n
    every = sorted(t for mine in comm.allgather(tickets) for t in mine)  # (a barrier too)
    assert tickets == sorted(tickets) and every == list(range(total // 4))
    assert list(words.load(0, 5)) == [total, total, 0, total // 4, total // 4]
    assert words.add_then_load(claims, 0, at, out) == total // 4
    assert list(out) == [total, total // 4]
    for bad in (
        lambda: words.fetch_add(5, 1),
        lambda: words.load(3, 3),
        lambda: words.exchange(-1, 0),
    ):
        with pytest.raises(IndexError):
            bad()
    barrier(comm, "the test")
    win.Free()


def test_a_big_bucket_is_reduced_while_backward_makes_no_mpi_call():
    """Sync replicas over messages, a model of PUMP_BYTES or more: once a bucket is ready,
    its reduction goes on while the replica makes no MPI call (as during a long matrix
    product): a thread enters MPI meanwhile. This replica's part gets the mean gradient."""
    from mpi4py import MPI

    from mpips.allreduce import GradientBuckets
    from mpips.allreduce.messages import PUMP_BYTES

    comm = MPI.COMM_WORLD
    n = 2 * PUMP_BYTES // 4
    buckets = GradientBuckets(comm, [VariableSpec("w", (n,))], bucket_bytes=1 << 20)
    buckets.start_step()  # (no update: the bucket's request stays until finish)
    buckets.grads["w"][:] = comm.rank + 1
    buckets.ready("w")  # starts the reduction (and tests it once)
    time.sleep(1.0)  # no MPI call on this thread
    assert buckets.buckets[0].request.Test(), "the reduction stood still without MPI calls"
    buckets.set_loss(0.0)
    buckets.finish()
    mean = sum(range(1, comm.size + 1)) / comm.size
    np.testing.assert_array_equal(buckets.buckets[0].shard, mean)
    buckets.close()


def test_a_matrix_cut_over_buckets_is_reduced_as_its_rows_are_written():
    """Sync replicas over messages: a matrix bigger than a bucket is cut between rows, and
    each bucket starts its reduction as soon as backward says the rows it holds are written
    (``ready(name, rows)``), not once the whole gradient is; a vector's first values do not
    start a bucket that holds all of it. Every row gets its mean."""
    from mpi4py import MPI

    from mpips.allreduce import GradientBuckets

    comm = MPI.COMM_WORLD
    rows, cols = 64, 256  # 1 KiB a row
    specs = [VariableSpec("w", (rows, cols)), VariableSpec("b", (cols,))]
    buckets = GradientBuckets(comm, specs, bucket_bytes=16 << 10)
    holding = {i: b.needs["w"] for i, b in enumerate(buckets.buckets) if "w" in b.needs}

    def waiting() -> dict[int, set[str]]:
        """The buckets whose reduction has not started: what each waits for."""
        return buckets.transport.backward.waiting

    assert len(holding) == 5, holding  # b and 15 rows, then 16, 16, 16 and the last 1

    def sgd(var, grad, slots):
        var -= grad

    buckets.start_step(sgd)
    grads = buckets.grads
    fill = (comm.rank + 1) * np.arange(1, rows + 1, dtype=np.float32)[:, None]
    grads["w"][:32] = fill[:32]
    buckets.ready("w", 32)
    started = {i for i in holding if i not in waiting()}
    assert started == {i for i, need in holding.items() if need <= 32 and i}, (started, holding)
    grads["b"][:100] = comm.rank + 1
    buckets.ready("b", 100)  # a vector's first 100 values: its bucket waits for the rest
    assert 0 in waiting(), "a bucket started on part of a vector"
    grads["b"][100:] = comm.rank + 1
    buckets.ready("b")
    assert 0 not in waiting()
    grads["w"][32:] = fill[32:]
    buckets.ready("w", rows)
    assert list(waiting()) == [4], "only the last bucket waits, for the loss"
    buckets.set_loss(0.0)
    assert not waiting()
    buckets.finish()
    mean = sum(range(1, comm.size + 1)) / comm.size
    np.testing.assert_array_equal(buckets.values["b"], np.full(cols, -mean, np.float32))
    want = -mean * np.arange(1, rows + 1, dtype=np.float32)[:, None] * np.ones(cols, np.float32)
    np.testing.assert_array_equal(buckets.values["w"], want)
    buckets.close()


def test_a_step_is_updated_during_backward_once_the_replicas_agree():
    """Sync replicas over messages: whether a step is applied (no replica's vote to stop) is
    agreed while backward runs, and a bucket reduced meanwhile is updated and gathered then,
    before backward ends. A vote on one replica leaves every variable as it was, on all."""
    from mpi4py import MPI

    from mpips.allreduce import GradientBuckets

    comm = MPI.COMM_WORLD
    rows, cols = 64, 256  # 1 KiB a row: 16 rows a bucket
    buckets = GradientBuckets(comm, [VariableSpec("w", (rows, cols))], bucket_bytes=16 << 10)
    first = buckets.buckets[0].needs["w"]
    grads, values = buckets.grads["w"], buckets.values["w"]

    def sgd(var, grad, slots):
        var -= grad

    def first_rows_updated() -> bool:
        """Backward goes on (says its rows again, as between layers) until the first
        bucket's rows are updated on this replica, or 20 s."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            buckets.ready("w", first)
            if buckets.buckets[0].gather is None and (values[:first] != 0).all():
                return True
            time.sleep(0.001)
        return False

    def backward_from(first_rows: Callable[[], None]) -> float:
        """A step: the first bucket's rows written, ``first_rows``, the rest, and the end."""
        grads[...] = comm.rank + 1
        buckets.ready("w", first)
        first_rows()
        buckets.ready("w", rows)
        buckets.set_loss(float(comm.rank))
        return buckets.finish()

    def updated_meanwhile() -> None:
        assert first_rows_updated(), "a reduced bucket waited for the end of backward"
        assert (values[first:] == 0).all(), "rows updated before backward wrote them"

    buckets.start_step(sgd, votes=[0])
    loss = backward_from(updated_meanwhile)
    assert buckets.agreed() == [0]
    mean = sum(range(1, comm.size + 1)) / comm.size
    np.testing.assert_array_equal(values, np.full((rows, cols), -mean, np.float32))
    assert buckets.losses() == pytest.approx(range(comm.size), rel=1e-6)
    assert loss == pytest.approx(sum(range(comm.size)) / comm.size, rel=1e-6)
    before = values.copy()

    def not_updated() -> None:
        """Backward goes on until the agreement and the first bucket's reduction are in."""
        deadline = time.monotonic() + 20
        while buckets._step.request is not None or buckets.buckets[0].request is not None:
            assert time.monotonic() < deadline, "the agreement or the reduction stood still"
            buckets.ready("w", first)
            time.sleep(0.001)
        assert (values == before).all(), "a step some replica voted against was updated"

    buckets.start_step(sgd, votes=[1 if comm.rank == 1 else 0])  # replica 1: stop
    loss = backward_from(not_updated)
    assert buckets.agreed() == [1]
    assert np.isnan(loss) and (values == before).all()
    buckets.close()
