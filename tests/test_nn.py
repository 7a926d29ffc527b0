import numpy as np

from mpips.models.mlp import MLP
from mpips.optim import apply_sgd


def test_gradients_match_finite_differences():
    model = MLP([5, 7, 3])
    params = {k: v.astype(np.float64) for k, v in model.initial_values(0).items()}
    params = {
        k: v + 0.1 * np.random.default_rng(1).standard_normal(v.shape) for k, v in params.items()
    }
    x = np.random.default_rng(2).standard_normal((6, 5))
    y = np.array([0, 1, 2, 1, 0, 2])
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, x, y, grads)
    eps = 1e-6
    for name, p in params.items():
        for idx in [(0,) * p.ndim, tuple(s - 1 for s in p.shape)]:
            old = p[idx]
            p[idx] = old + eps
            up = model.evaluate(params, x, y)["loss"]
            p[idx] = old - eps
            down = model.evaluate(params, x, y)["loss"]
            p[idx] = old
            assert abs((up - down) / (2 * eps) - grads[name][idx]) < 1e-6, name


def test_sgd_steps_reduce_loss():
    model = MLP([4, 8, 2])
    params = model.initial_values(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    first = model.loss_and_grads(params, x, y, grads)
    for _ in range(50):
        model.loss_and_grads(params, x, y, grads)
        for k in params:
            apply_sgd(params[k], grads[k], 0.5)
    assert model.evaluate(params, x, y)["loss"] < first / 3


def test_the_mlp_reports_auc_on_two_classes():
    """A binary dense task gets the AUC of the second class's logit margin (like the CTR
    models), and none with more classes."""
    from mpips.models.metrics import auc
    from mpips.models.mlp import MLP

    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = MLP([5, 8, 2])
    params = model.initial_values(0)
    got = model.evaluate(params, x, y)
    z = model.logits(params, x)
    assert got["auc"] == auc(y, z[:, 1] - z[:, 0]) and 0 <= got["auc"] <= 1
    assert "auc" not in MLP([5, 8, 3]).evaluate(MLP([5, 8, 3]).initial_values(0), x, y)


def _small_mlp_and_grads():
    """An MLP 40-24-3 (dense_0/kernel: 40 rows of 96 bytes), its initial values, a batch of
    8, and the gradients on the host written whole (no ``ready``)."""
    model = MLP([40, 24, 3])
    params = model.initial_values(0)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 40)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    whole = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, x, y, whole)
    return model, params, x, y, whole


def test_backward_reports_a_big_kernel_block_by_block_each_block_final(monkeypatch):
    """Given ``ready``, the MLP writes a kernel's gradient in blocks of rows and says each
    block once it is final (bias first, then the kernel's rows in order), so sync replicas
    can reduce the first rows while the rest are computed. "Final": what a block holds when
    it is said is what it holds at the end (bitwise: the same run). The gradients equal
    those written whole up to rounding (a block's product is another BLAS call than the
    whole matrix's, which may differ in the last bit: OpenBLAS on AMD EPYC does)."""
    from mpips import layers

    monkeypatch.setattr(layers, "BLOCK_BYTES", 1024)
    model, params, x, y, whole = _small_mlp_and_grads()  # dense_0/kernel: 4 blocks
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    said = []  # (name, rows, the block as it was when said)

    def ready(name, rows=None):
        said.append((name, rows, (grads[name] if rows is None else grads[name][:rows]).copy()))

    model.loss_and_grads(params, x, y, grads, ready)
    assert [(name, rows) for name, rows, _ in said] == [
        ("dense_1/bias", None),
        ("dense_1/kernel", 24),
        ("dense_0/bias", None),
        *[("dense_0/kernel", r) for r in (10, 20, 30, 40)],
    ]
    for name, rows, then in said:
        final = grads[name] if rows is None else grads[name][:rows]
        np.testing.assert_array_equal(then, final, err_msg=f"{name} rows {rows} not final")
    for name, g in whole.items():
        np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_on_a_device_backward_writes_each_kernel_whole(monkeypatch):
    """On a device a block of rows would be a launch and a wait for its copy out, each
    costing more than the overlap gains (cupy: ~65 us of host time a launch; the wide
    MLP had ~90 a step): a kernel's gradient is written and said ready whole, the bias
    first, and equals the host's."""
    from mpips import layers
    from mpips.device import standin

    monkeypatch.setattr(layers, "BLOCK_BYTES", 1024)
    _, params, x, y, want = _small_mlp_and_grads()
    model = MLP([40, 24, 3], xp=standin)
    on_device = {k: standin.asarray(v) for k, v in params.items()}
    grads = {k: standin.zeros(v.shape, v.dtype) for k, v in params.items()}
    said = []
    model.loss_and_grads(
        on_device,
        standin.asarray(x),
        standin.asarray(y),
        grads,
        lambda n, r=None: said.append((n, r)),
    )
    assert said == [
        ("dense_1/bias", None),
        ("dense_1/kernel", 24),
        ("dense_0/bias", None),
        ("dense_0/kernel", 40),
    ]
    for name, g in want.items():
        np.testing.assert_allclose(grads[name].get(), g, rtol=1e-5, atol=1e-7, err_msg=name)


def test_buckets_cut_a_big_matrix_between_rows():
    """A bucket closes once it holds bucket_bytes; a matrix that would overfill it is cut
    between rows, a vector never. Every row lies in one bucket, in backward's order, and each
    variable is one view over its rows."""
    from mpi4py import MPI

    from mpips.allreduce import GradientBuckets
    from mpips.models.variables import VariableSpec

    specs = [VariableSpec("w", (50, 32)), VariableSpec("v", (600,)), VariableSpec("u", (3, 4))]
    buckets = GradientBuckets(MPI.COMM_SELF, specs, bucket_bytes=2048)
    # backward's order: u (48 B), v (2400 B: closes a bucket), w (128 B a row) in 16-row cuts;
    # needs: the rows along axis 0 ready(name, rows) must have said (a vector's: all of it)
    assert [b.needs for b in buckets.buckets] == [
        {"u": 3, "v": 600},
        {"w": 16},
        {"w": 32},
        {"w": 48},
        {"w": 50, "__loss__": 1},
    ]
    assert [b.size for b in buckets.buckets] == [612, 512, 512, 512, 65]
    w = buckets.buckets[1]
    assert buckets.values["w"].base is not None and buckets.values["w"].shape == (50, 32)
    assert np.shares_memory(buckets.values["w"][:16], w.span(w.store.values))
    buckets.close()


def test_one_replica_updates_its_gradients_where_they_lie():
    """One replica (one process): no shared window even where one is offered, its part of
    each bucket is the gradients themselves (nothing copied), and a step applies them as
    they are, clipped, with the loss as the mean loss; a vote to stop applies nothing."""
    from mpi4py import MPI

    from mpips.allreduce import GradientBuckets
    from mpips.models.variables import VariableSpec
    from mpips.optim import global_norm_clip

    specs = [VariableSpec("w", (50, 32)), VariableSpec("v", (600,))]
    buckets = GradientBuckets(MPI.COMM_SELF, specs, bucket_bytes=2048, shared=True)
    assert buckets.solo and not buckets.shared
    for b in buckets.buckets:
        assert np.shares_memory(b.shard, b.span(b.store.grads))
    rng = np.random.default_rng(1)
    for name in ("w", "v"):
        buckets.values[name][...] = rng.standard_normal(buckets.values[name].shape)
        buckets.grads[name][...] = rng.standard_normal(buckets.grads[name].shape)
    start = {n: buckets.values[n].copy() for n in ("w", "v")}
    grads = {n: buckets.grads[n].copy() for n in ("w", "v")}
    norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))

    def sgd(var, grad, slots):
        var -= 0.5 * grad

    buckets.start_step(sgd, global_norm_clip(1.0), [0, 0])
    buckets.set_loss(1.5)
    assert buckets.finish() == 1.5 and buckets.agreed() == [0, 0]
    for name in ("w", "v"):
        want = start[name] - 0.5 * (grads[name] * np.float32(1.0 / norm))
        np.testing.assert_allclose(buckets.values[name], want, rtol=1e-6, err_msg=name)
    applied = {n: buckets.values[n].copy() for n in ("w", "v")}
    buckets.start_step(sgd, None, [3, 0])  # (a stop signal: nothing applied)
    buckets.set_loss(2.0)
    assert np.isnan(buckets.finish()) and buckets.agreed() == [3, 0]
    for name in ("w", "v"):
        np.testing.assert_array_equal(buckets.values[name], applied[name])
    buckets.close()
