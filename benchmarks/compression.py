"""What bf16 compression of the sync gradients would buy on this machine, before building
it: the wide MLP's gradients (784-2048-2048-10, 5.8 M float32, 23 MB) exchanged between the
replicas as a raw float32 ``Allreduce`` (what sync mode does, in one piece) against bf16 with
error feedback: a fused pass that adds the carried error, rounds to bf16 and keeps the new
error, an ``Allgather`` of the halves, and a fused pass that widens and sums them. All in the
same run, medians of --reps samples; the kernels are numba loops (one pass over memory each).

Run:  mpiexec -n 2 python benchmarks/compression.py [--reps 7]
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from mpi4py import MPI

from mpips.models.mlp import MLP


@numba.njit(cache=True, nogil=True)
def compress(grad, error, word_f, word_u, out):  # pragma: no cover - compiled
    """out = bf16(grad + error) (round to nearest even), error = what rounding lost;
    ``word_f`` / ``word_u``: one float32 word and its uint32 view, to move bits."""
    for i in range(grad.size):
        v = grad[i] + error[i]
        word_f[0] = v
        u = word_u[0]
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        out[i] = np.uint16(r)
        word_u[0] = np.uint32(r) << np.uint32(16)
        error[i] = v - word_f[0]


@numba.njit(cache=True, nogil=True)
def widen_sum(gathered, word_f, word_u, out):  # pragma: no cover - compiled
    """out = the sum of the ranks' bf16 halves, widened to float32."""
    for k in range(gathered.shape[0]):  # rank by rank: each pass streams through memory
        for i in range(out.size):
            word_u[0] = np.uint32(gathered[k, i]) << np.uint32(16)
            out[i] = word_f[0] if k == 0 else out[i] + word_f[0]


def median_ms(fn, comm: MPI.Comm, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(comm.allreduce(time.perf_counter() - t0, MPI.MAX))
    return float(np.median(samples)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    n = sum(int(np.prod(s.shape)) for s in MLP([784, 2048, 2048, 10]).variables())
    rng = np.random.default_rng(comm.rank)
    grad = rng.standard_normal(n).astype(np.float32)
    error = np.zeros(n, np.float32)
    half = np.zeros(n, np.uint16)
    gathered = np.zeros((comm.size, n), np.uint16)
    total = np.zeros(n, np.float32)
    reduced = grad.copy()
    word_f = np.zeros(1, np.float32)
    word_u = word_f.view(np.uint32)

    def raw() -> None:
        reduced[...] = grad
        comm.Allreduce(MPI.IN_PLACE, reduced, MPI.SUM)

    def squeeze() -> None:
        compress(grad, error, word_f, word_u, half)

    def exchange() -> None:
        comm.Allgather(half, gathered)

    def widen() -> None:
        widen_sum(gathered, word_f, word_u, total)

    def bf16() -> None:
        squeeze()
        exchange()
        widen()

    figures = {
        "raw float32 Allreduce (sync mode today)": median_ms(raw, comm, args.reps),
        "bf16: compress with error feedback": median_ms(squeeze, comm, args.reps),
        "bf16: Allgather of the halves": median_ms(exchange, comm, args.reps),
        "bf16: widen and sum": median_ms(widen, comm, args.reps),
        "bf16: all three": median_ms(bf16, comm, args.reps),
    }
    raw()
    err = float(np.max(np.abs(total - reduced)) / np.max(np.abs(reduced)))
    if comm.rank == 0:
        print(f"# compression | {n / 1e6:.1f} M float32 ({4 * n / 1e6:.0f} MB), {comm.size} ranks")
        for label, ms in figures.items():
            print(f"{label:<42} {ms:8.2f} ms")
        ratio = figures["bf16: all three"] / figures["raw float32 Allreduce (sync mode today)"]
        print(f"bf16 / raw: {ratio:.2f}x the time; one exchange's max relative error {err:.1e}")


if __name__ == "__main__":
    main()
