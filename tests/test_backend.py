"""Device selection for GPU workers, tested with a stand-in array module (no GPU needed)."""

import sys
import types

import numpy as np
import pytest

from mpips.device.backend import get_xp
from mpips.errors import ConfigError
from mpips.placement.layout import make_layout


def fake_cupy(count=None, error=None):
    """A module that looks like cupy to get_xp: ``count`` visible devices, or ``error`` when
    asked (no driver); it records which device was made current."""
    cupy = types.ModuleType("cupy")
    used = []

    def get_count():
        if error is not None:
            raise error
        return count

    class Device:
        def __init__(self, index):
            self.index = index

        def use(self):
            used.append(self.index)

    cupy.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=get_count), Device=Device
    )
    return cupy, used


def test_cpu_is_numpy():
    assert get_xp("cpu", 5) is np


def test_a_missing_cuda_driver_is_a_clear_config_error(monkeypatch):
    cupy, _ = fake_cupy(
        error=RuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version "
            "is insufficient for CUDA runtime version"
        )
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with pytest.raises(
        ConfigError,
        match=r'train.device = "gpu" but CUDA cannot be used here: '
        r"RuntimeError: cudaErrorInsufficientDriver",
    ):
        get_xp("gpu", 0)
    cupy, _ = fake_cupy(count=0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        get_xp("gpu", 0)


def test_each_worker_of_a_node_gets_its_own_gpu(monkeypatch):
    """2 nodes x 4 ranks, one PS on each (ranks 0 and 4), 2 GPUs per node: the three workers
    of a node use GPUs 0, 1, 0 (by worker index, not by local rank, which counts the PS and
    would put two workers on GPU 1 while GPU 0 had one)."""
    from mpips.store.cluster import Cluster

    layout = make_layout(8, [0, 4])
    nodes = [(0, 1, 2, 3), (4, 5, 6, 7)]
    got = {}
    for node in nodes:
        for rank in node:
            if rank in layout.ps_ranks:
                continue
            cluster = object.__new__(Cluster)  # no MPI: only what the property reads
            cluster.layout, cluster.rank, cluster.node_ranks = layout, rank, node
            cupy, used = fake_cupy(count=2)
            monkeypatch.setitem(sys.modules, "cupy", cupy)
            assert get_xp("gpu", cluster.local_worker_index) is cupy
            got[rank] = used[0]
    assert got == {1: 0, 2: 1, 3: 0, 5: 0, 6: 1, 7: 0}


def test_device_on_the_cpu_hands_back_the_same_arrays():
    from mpips.device.backend import Device

    device = Device()
    host = {"w": np.ones(3, np.float32)}
    assert device.stage_in(host) is host and device.mirrors(host) is host
    x = np.zeros(2)
    assert device.to_device(x) is x
    device.stage_out(host, host)  # a no-op


def test_device_stages_through_buffers_kept_from_step_to_step():
    """On a device (the stand-in for cupy: values reachable only through set and get),
    variables go through one buffer per name and shape, gradients come back through
    another; each made once."""
    from mpips.device import standin
    from mpips.device.backend import Device

    device = Device(standin)
    host = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    first = device.stage_in(host)
    assert all(isinstance(a, standin.ndarray) for a in first.values())
    np.testing.assert_array_equal(first["w"].get(), host["w"])
    host["w"] += 1
    again = device.stage_in(host)
    assert again["w"] is first["w"]  # the same device buffer, refilled
    np.testing.assert_array_equal(again["w"].get(), host["w"])
    rows = device.stage_in({"w": np.zeros((5, 3), np.float32)})  # another shape: a new one
    assert rows["w"] is not first["w"] and rows["w"].shape == (5, 3)
    grads = device.mirrors(host)
    assert device.mirrors(host)["b"] is grads["b"] and grads["b"] is not again["b"]
    grads["b"].set(np.full(3, 7, np.float32))
    out = {"b": np.zeros(3, np.float32)}
    device.stage_out({"b": grads["b"]}, out)
    np.testing.assert_array_equal(out["b"], 7)
    assert device.allocations == 5  # w, b, w of 5 rows in; w and b out: each made once
    assert isinstance(device.to_device(np.zeros(4)), standin.ndarray)


def test_rows_that_vary_from_step_to_step_reuse_one_buffer_grown_twice():
    """A CTR batch's table rows (a row count of its own each step): a view of the first
    rows of one kept device buffer, made again only for more rows than it has, then with
    twice as many; the values are those of the host rows each time."""
    from mpips.device import standin
    from mpips.device.backend import Device

    device = Device(standin)
    made = []
    for n in (5, 3, 5, 7, 10, 2, 11):
        host = {"e": np.arange(n * 3, dtype=np.float32).reshape(n, 3) + n}
        staged = device.stage_in(host)["e"]
        assert staged.shape == (n, 3)
        np.testing.assert_array_equal(staged.get(), host["e"])
        grads = device.mirrors(host)["e"]
        grads.set(host["e"] * 2)  # the model's gradient rows, then out to the host
        device.stage_out({"e": grads}, host)
        np.testing.assert_array_equal(host["e"], (np.arange(n * 3).reshape(n, 3) + n) * 2)
        made.append(device.allocations)
    # made at 5 rows (in and out), grown to 10 at 7, to 20 at 11
    assert made == [2, 2, 2, 4, 4, 4, 6]
    assert device._buffers["in:e"].shape == (20, 3)
    again = device.stage_in({"e": np.zeros((0, 3), np.float32)})["e"]  # a batch of no ids
    assert again.shape == (0, 3) and device.allocations == 6


def test_page_aligned_buffers_lock_beside_locked_neighbours():
    """A host buffer made after others were page-locked (a table's rows, grown) lies on
    pages of its own, so locking it is never refused (CUDA, and the stand-in, refuse a
    range that shares a page with a locked one)."""
    import warnings

    from mpips.device import standin
    from mpips.device.backend import Device
    from mpips.device.pages import PAGE, page_aligned, page_runs

    device = Device(standin)
    small = [np.zeros(10, np.float32) for _ in range(64)]  # heap neighbours, locked
    runs = page_runs(small[::3], {})
    for start, n in runs:
        standin.cuda.runtime.hostRegister(start, n, 0)
    try:
        for shape in [(1, 1), (3, 8), (1000, 9), (0, 4)]:
            a = page_aligned(shape, np.float32)
            assert a.shape == shape and a.dtype == np.float32
            assert a.ctypes.data % PAGE == 0 or not a.nbytes
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a refused lock warns
                device.pin([a])
            a[...] = 1
            standin.traffic.reset()
            device.stage_in({"a": a})
            assert standin.traffic.h2d_pageable == 0
    finally:
        device.unpin()
        for start, _ in runs:
            standin.cuda.runtime.hostUnregister(start)


def test_device_pins_host_buffers_once_and_releases_them():
    from mpips.device import standin
    from mpips.device.backend import Device
    from mpips.device.pages import page_zeros

    device = Device(standin)
    a, b = page_zeros(1000, np.float32), page_zeros(10, np.float32)
    device.pin([a, b, a])  # a second time: once
    standin.traffic.reset()
    staged = device.stage_in({"a": a, "b": b})
    assert standin.traffic.h2d_pageable == 0 and standin.traffic.h2d_bytes == 4040
    device.stage_out(staged, {"a": a, "b": b})
    assert standin.traffic.d2h_pageable == 0 and standin.traffic.d2h_bytes == 4040
    device.unpin()
    device.stage_out(staged, {"a": a, "b": b})
    assert standin.traffic.d2h_pageable == 4040
    Device().pin([a])  # the CPU: nothing to do


def test_one_replica_on_a_device_gives_backward_no_ready_callback():
    """Gradients that stay on the device (one replica, one process) need no report from
    backward, which then writes each kernel whole; nor do gradients bound for host buffers
    with nothing to tell (buckets in shared memory: they are copied at the end); gradients
    a reduction waits for do."""
    from mpips.device import standin
    from mpips.device.backend import Device

    device = Device(standin)
    grads = {"k": standin.zeros((4, 3), np.float32)}
    assert device.staged(grads, {}).ready(None) is None
    bound = {"k": np.zeros((4, 3), np.float32)}
    assert device.staged(grads, bound).ready(None) is None
    assert callable(device.staged(grads, bound).ready(lambda name, rows=None: None))
    assert device.staged(grads, {}).ready(lambda name, rows=None: None) is None
    assert Device().staged({}, {}).ready(None) is None  # the CPU: as given


def test_pinning_never_locks_a_page_that_other_arrays_lie_on():
    """CUDA takes a copy that begins in a locked page as a copy from pinned memory, and
    cupy's asarray copies straight from an array that begins there: a small array made
    next to a locked heap buffer failed to copy once it ran past the locked pages
    (cudaErrorInvalidValue, an async GPU worker at its second epoch on an H100). The
    stand-in refuses such a copy as CUDA does, and pin() locks only buffers whose pages
    are their own (page_zeros), leaving others pageable with a warning."""
    from mpips.device import standin
    from mpips.device.backend import Device
    from mpips.device.pages import PAGE, owns_pages, page_zeros

    heap = np.zeros(10, np.float32)  # (a small numpy array: its page holds other memory)
    assert not owns_pages(heap) and owns_pages(page_zeros(10, np.float32))
    assert not owns_pages(np.frombuffer(b"\0" * 40, np.float32))  # (heap memory too)
    device = Device(standin)
    with pytest.warns(UserWarning, match="share pages with other memory"):
        device.pin([heap])
    assert not standin._locked
    device.unpin()

    raw = page_zeros(3 * PAGE, np.uint8)
    device.pin([raw[:PAGE]])  # its first page only
    try:
        standin.asarray(raw[PAGE : PAGE + 64])  # begins past the locked page: pageable
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            standin.asarray(raw[PAGE - 64 : PAGE + 64])  # begins in it, runs past it
        with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
            standin.asarray(raw[:PAGE]).get(out=raw[PAGE - 8 : 2 * PAGE - 8])
    finally:
        device.unpin()


def test_scatter_add_sums_repeated_indices_with_either_array_module(monkeypatch):
    """numpy: np.add.at; another array module (cupy): cupyx.scatter_add, here a stand-in
    that records its call (the layers never ask which module they have)."""
    from mpips.device.arrays import scatter_add

    target = np.zeros((3, 2), np.float32)
    scatter_add(np, target, np.array([0, 2, 0]), np.ones((3, 2), np.float32))
    np.testing.assert_array_equal(target, [[2, 2], [0, 0], [1, 1]])
    calls = []
    cupyx = types.ModuleType("cupyx")
    cupyx.scatter_add = lambda t, i, v: calls.append((t, i, v))
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    t, i, v = object(), object(), object()
    scatter_add(types.ModuleType("cupy"), t, i, v)
    assert calls == [(t, i, v)]


def test_every_core_goes_to_a_rank_and_every_rank_gets_one():
    """The node's cores split over its ranks: the total is the cores (the ranks when there
    are more ranks than cores), no rank below 1, a PS task 1, workers within 1 of each other
    and the first ones taking the remainder."""
    from mpips.device.threads import node_blas_threads

    for cores in range(1, 70):
        for ranks in (1, 2, 3, 5, 8, 9, 16, 17, 33):
            for ps in range(ranks + 1):
                shares = node_blas_threads(cores, ranks, ps)
                assert len(shares) == ranks and min(shares) >= 1
                assert shares[:ps] == [1] * ps
                workers = shares[ps:]
                if not workers:  # only PS tasks on the node: 1 each
                    assert sum(shares) == ranks
                    continue
                assert sum(shares) == max(cores, ranks), (cores, ranks, ps)
                assert max(workers) - min(workers) <= 1
                assert workers == sorted(workers, reverse=True)


def test_the_16_core_node_layouts():
    """The reference node: 1 PS + 8 workers used 9 of 16 cores (16 // 9 each); now 16."""
    from mpips.device.threads import node_blas_threads

    assert node_blas_threads(16, 9, 1) == [1] + [2] * 7 + [1]
    assert node_blas_threads(16, 5, 1) == [1, 4, 4, 4, 3]
    assert node_blas_threads(16, 3, 1) == [1, 8, 7]
    assert node_blas_threads(16, 8) == [2] * 8  # sync: no PS
    assert node_blas_threads(16, 1) == [16]
    assert node_blas_threads(2, 3, 1) == [1, 1, 1]  # oversubscribed: 1 each
    with pytest.raises(ValueError):
        node_blas_threads(16, 2, 3)


@pytest.fixture
def blas_limit_restored():
    from threadpoolctl import threadpool_info, threadpool_limits

    before = {i["user_api"]: i["num_threads"] for i in threadpool_info()}
    yield
    threadpool_limits(limits=before)


def blas_threads_now() -> int:
    from threadpoolctl import threadpool_info

    return min(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


def test_pin_blas_threads_sets_this_ranks_share(monkeypatch, blas_limit_restored):
    """The share reaches the BLAS library: worker 7 of 1 PS + 8 on 16 cores gets 1, worker 0
    gets 2, the PS 1; without the node's PS count, the old even split; MPIPS_BLAS_THREADS
    wins over both, and a bad value is one readable error."""
    from mpips.device import threads

    monkeypatch.setattr(threads, "cpu_count", lambda: 16)
    monkeypatch.delenv(threads.BLAS_THREADS_ENV, raising=False)
    if not any(i["user_api"] == "blas" for i in __import__("threadpoolctl").threadpool_info()):
        pytest.skip("no BLAS library that threadpoolctl can limit")
    assert threads.pin_blas_threads(9, ps_on_node=1, local_worker=0) == 2 == blas_threads_now()
    assert threads.pin_blas_threads(9, ps_on_node=1, local_worker=7) == 1 == blas_threads_now()
    assert threads.pin_blas_threads(5, ps_on_node=1, local_worker=0) == 4 == blas_threads_now()
    assert threads.pin_blas_threads(9, ps_on_node=1) == 1  # the PS task
    assert threads.pin_blas_threads(4) == 4 == blas_threads_now()  # the old call: 16 // 4
    monkeypatch.setenv(threads.BLAS_THREADS_ENV, "3")
    assert threads.pin_blas_threads(9, ps_on_node=1, local_worker=7) == 3 == blas_threads_now()
    monkeypatch.setenv(threads.BLAS_THREADS_ENV, "0")
    with pytest.raises(ConfigError, match="MPIPS_BLAS_THREADS must be a whole number >= 1"):
        threads.pin_blas_threads(9, ps_on_node=1, local_worker=0)
