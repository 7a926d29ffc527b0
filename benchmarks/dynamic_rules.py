"""What row-wise Adagrad and float16 rows cost and save on a dynamic table: the seconds a PS
task takes to apply a batch's gradient rows, and the bytes a row and its slots take, for
Adagrad (an accumulator a value) and row-wise Adagrad (one a row), on float32 and float16
rows. The same batches (the unique ids of 256 x 26 Zipf(1.2) draws over 1M ids) in each.

Run:  python benchmarks/dynamic_rules.py
"""

from __future__ import annotations

import time

import numpy as np

from mpips.models.ctr import uniform_rows
from mpips.optim.rules import apply_adagrad, apply_rowwise_adagrad
from mpips.store.dynamic_rows import DynamicRows

WIDTH, ROWS, STEPS = 16, 1_000_000, 200


def table(rowwise: bool, storage: str) -> tuple[DynamicRows, object]:
    rule = apply_rowwise_adagrad if rowwise else apply_adagrad

    def initial(ids: np.ndarray) -> dict[str, np.ndarray]:
        rows = uniform_rows(0, ids, WIDTH, 0.05)
        acc = np.full((len(ids), 1 if rowwise else WIDTH), 0.1, np.float32)
        return {"t": {"": rows, "accumulator": acc}}

    def apply(var, grad, slots, lr, t):  # noqa: ANN001 (the store's Apply)
        rule(var, grad, slots["accumulator"], lr, 1e-7)

    t = DynamicRows(
        {"t": WIDTH},
        np.dtype(np.float32),
        ("accumulator",),
        initial,
        storage=np.dtype(storage),
        rowwise=rowwise,
    )
    return t, apply


def main() -> None:
    rng = np.random.default_rng(0)
    batches = [
        np.unique((rng.zipf(1.2, (256, 26)) - 1) % ROWS * 2654435761 % ROWS).astype(np.int64)
        for _ in range(STEPS)
    ]
    grads = rng.normal(size=(max(map(len, batches)), WIDTH)).astype(np.float32)
    out = np.empty_like(grads)
    print(
        f"{STEPS} batches of {np.mean([len(b) for b in batches]):.0f} unique ids, rows of {WIDTH}"
    )
    for rowwise in (False, True):
        for storage in ("float32", "float16"):
            t, apply = table(rowwise, storage)
            for ids in batches:  # (the rows made first)
                t.lookup(ids, {"t": out[: len(ids)]}, 0)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for ids in batches:
                    t.update(ids, {"t": grads[: len(ids)]}, apply, 0.05, 1)
                best = min(best, time.perf_counter() - start)
            n = sum(map(len, batches))
            row = t.rows["t"].itemsize * WIDTH
            acc = t.slots["t"]["accumulator"]
            slot = acc.itemsize * acc.shape[1]
            name = ("row-wise Adagrad" if rowwise else "Adagrad") + f", {storage} rows"
            print(f"{name:32s} {best / n * 1e9:6.0f} ns a row applied; {row} B row + {slot} B slot")


if __name__ == "__main__":
    main()
