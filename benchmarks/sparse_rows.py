"""Row-wise pull + push of a partitioned table: a 10M-row table vs a 10K-row table, with
batches whose ids are spread over the whole of each table; the bytes each step actually
sends; and two limits measured in the same run: a raw MPI_Get / MPI_Accumulate of the same
bytes in one contiguous block, and a raw indexed Get / Accumulate of scattered rows drawn
the same way, with datatypes built beforehand (what the memory system itself costs for rows
spread over a table of each size).

Run:  mpiexec -n 3 python benchmarks/sparse_rows.py     (2 PS tasks, 1 worker)

Each step pulls the rows of a batch's unique ids from every table (an embedding of width 8
plus wide weights of width 1, both float32, split "mod" over the 2 PS tasks) and pushes their
gradient rows with Accumulate (SGD). A batch is 128 rows x 32 ids: Zipf(1.2) ranks (a few
ids are everywhere, most are rare, as in click logs), folded into the table's rows and
scattered over all of them by a fixed bijection (rank x 2654435761 mod rows), so a 10M-row
batch touches rows across all 10M. "bytes sent" is counted from the MPI datatypes of each
step (whole variables plus the rows they name), both ways; "row bytes" is what the unique
rows hold, both ways (2 x unique ids x 36 B), for comparison. Target: 10M / 10K time per
unique row <= 1.2x, to be read beside the same ratio of the raw scattered transfer.

Every timed step takes a batch of new ids drawn from that distribution (no batch is reused:
the frequent ids recur, as in a real log, but the rare ones land wherever the draw puts
them, not on rows earlier steps left in the caches). Each pass of --steps steps, for each
size and each of the three kinds, draws its own batches beforehand, outside the timing. The
output says how many distinct rows the timed pull + push steps touched, in a pass and in all
passes together.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.models.variables import VariableSpec
from mpips.placement.layout import make_layout
from mpips.placement.table import place_tables, round_robin
from mpips.store import Cluster, StoreClient, Windows, barrier

comm = MPI.COMM_WORLD
ROW_BYTES = 4 * (8 + 1)  # one embedding row plus one wide weight, float32
SCATTER = 2654435761  # a prime: coprime to 10^4 and 10^7, so rank -> row is a bijection


def batch_ids(
    rng: np.random.Generator, table_rows: int, rows: int = 128, nnz: int = 32
) -> np.ndarray:
    """The unique ids of one batch: Zipf(1.2) ranks over the table, scattered over its rows."""
    ranks = rng.zipf(1.2, (rows, nnz)) - 1
    return np.unique((ranks % table_rows) * SCATTER % table_rows)


def draw(seed: list[int], table_rows: int, n: int) -> list[np.ndarray]:
    """``n`` batches of new ids from ``seed`` (each pass and kind has its own seed)."""
    rng = np.random.default_rng(seed)
    return [batch_ids(rng, table_rows) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    layout = make_layout(comm.size, 2)
    cluster = Cluster(comm, layout)
    worker = not cluster.is_ps
    sizes = (10_000, 10_000_000)
    setups = {}
    for rows in sizes:  # both tables live at once: their reps interleave (see below)
        tables = [
            VariableSpec("deep/embedding", (rows, 8)),
            VariableSpec("wide/weights", (rows, 1)),
        ]
        placement = place_tables(round_robin([VariableSpec("wide/bias", (1,))], 2), tables, "mod")
        windows = Windows(comm, layout, placement)
        setups[rows] = (windows, StoreClient(windows, cluster.role.task))

    def rows_step(client: StoreClient, ids: np.ndarray) -> int:
        client.pull(ids)
        sent = client.pulled_bytes
        for g in client.gradients().values():
            g[...] = 0.0  # zero deltas: the tables stay as they are
        client.push()
        return 2 * sent  # the push sends the same datatypes back

    def scattered_types(
        windows: Windows, ids: np.ndarray
    ) -> list[tuple[int, MPI.Datatype, np.ndarray]]:
        """Per PS rank: an indexed float datatype over exactly the rows of ``ids`` it holds
        (both tables), and a buffer for them; built once, outside the timing."""
        out = []
        for task, rank in enumerate(layout.ps_ranks):
            mine = ids[ids % 2 == task] // 2  # "mod": row r on PS r % 2, local row r // 2
            lengths, displs = [], []
            for e in windows.placement.on_ps(task):
                if e.rows is None:
                    continue
                width = int(np.prod(e.spec.shape[1:]))
                lengths += [width] * mine.size
                displs += (e.offset + mine * width * 4).tolist()
            dtype = MPI.FLOAT.Create_hindexed(lengths, displs).Commit()
            out.append((rank, dtype, np.zeros(sum(lengths), np.float32)))
        return out

    def scattered_step(win: MPI.Win, types: list[tuple[int, MPI.Datatype, np.ndarray]]) -> None:
        for rank, dtype, buf in types:
            win.Get([buf, MPI.FLOAT], rank, [0, 1, dtype])
        for rank, _, _ in types:
            win.Flush(rank)
        for rank, dtype, buf in types:
            win.Accumulate([buf, MPI.FLOAT], rank, [0, 1, dtype], MPI.SUM)
        for rank, _, _ in types:
            win.Flush(rank)

    def raw_step(win: MPI.Win, raw: np.ndarray) -> None:
        for rank in layout.ps_ranks:
            win.Get([raw, MPI.BYTE], rank, [64, raw.size, MPI.BYTE])
        for rank in layout.ps_ranks:
            win.Flush(rank)
        for rank in layout.ps_ranks:
            win.Accumulate(
                [raw.view(np.float32), MPI.FLOAT], rank, [64, raw.size // 4, MPI.FLOAT], MPI.SUM
            )
        for rank in layout.ps_ranks:
            win.Flush(rank)

    # warm-up, and the bytes a step sends (from its datatypes) to size the raw contiguous
    # limit: 16 batches of their own, never timed
    warm = {
        rows: float(np.mean([rows_step(c, ids) for ids in draw([0, rows], rows, 16)]))
        if worker
        else 0.0
        for rows, (_, c) in setups.items()
    }
    raws = {
        rows: np.zeros(int(warm[rows] / 2 / len(layout.ps_ranks)) // 4 * 4, np.uint8)
        for rows in sizes
    }  # half each way, split over the PS tasks
    # (the tables hold zeros: adding back what was read leaves them as they are)
    kinds = ("rows", "raw", "scattered")
    # reps alternate between the two sizes, so that a change in the machine's load (a
    # shared 2-core VM) hits both alike instead of skewing their ratio
    samples: dict[tuple[int, str], list[float]] = {(r, k): [] for r in sizes for k in kinds}
    touched: dict[int, list[np.ndarray]] = {rows: [] for rows in sizes}  # per rows pass
    unique = {(r, k): 0 for r in sizes for k in kinds}  # summed over the timed steps
    sent = {rows: 0 for rows in sizes}
    for rep in range(args.reps):
        for rows in sizes:
            windows, client = setups[rows]
            for k, kind in enumerate(kinds):
                # new ids for every step of this pass, drawn before the timing starts
                ids = draw([1, rep, rows, k], rows, args.steps) if worker else []
                types = [scattered_types(windows, b) for b in ids] if kind == "scattered" else []
                barrier(comm, "the benchmark")
                bytes_sent = 0
                t0 = time.perf_counter()
                for i in range(len(ids)):
                    if kind == "rows":
                        bytes_sent += rows_step(client, ids[i])
                    elif kind == "raw":
                        raw_step(windows.params, raws[rows])
                    else:
                        scattered_step(windows.params, types[i])
                samples[rows, kind].append((time.perf_counter() - t0) / args.steps)
                for batch in types:
                    for _, dtype, _ in batch:
                        dtype.Free()
                unique[rows, kind] += sum(b.size for b in ids)
                if kind == "rows" and worker:
                    touched[rows].append(np.unique(np.concatenate(ids)))
                    sent[rows] += bytes_sent
    barrier(comm, "the benchmark")
    results = {}
    for rows in sizes:
        steps = args.reps * args.steps
        per_pass = [t.size for t in touched[rows]]
        facts = {
            **{f"unique {k}": unique[rows, k] / steps for k in ("rows", "scattered")},
            "sent": sent[rows] / steps,
            "spread": max((int(t.max()) for t in touched[rows]), default=0),
            "pass": float(np.median(per_pass)) if per_pass else 0.0,
            "all": np.unique(np.concatenate(touched[rows])).size if worker else 0,
        }
        results[rows] = {
            kind: comm.bcast(float(np.median(samples[rows, kind])), root=layout.chief_rank)
            for kind in kinds
        }
        results[rows].update(comm.bcast(facts, root=layout.chief_rank))
        setups[rows][0].free()
    if comm.rank == 0:
        print(
            f"# sparse_rows | {MPI.Get_library_version().splitlines()[0]} | {comm.size} "
            f"ranks (2 ps, 1 worker) | 128 x 32 Zipf(1.2) ids per batch over the whole "
            f"table, new ids every step, embedding 8 + wide 1 float32 | median of "
            f"{args.reps} x {args.steps} steps"
        )
        print(
            f"{'table rows':>12}{'max id':>10}{'unique':>8}{'step us':>9}{'us/row':>8}"
            f"{'raw us':>8}{'raw/step':>9}{'scattered us':>13}{'bytes sent':>12}"
            f"{'row bytes':>11}"
        )
        for rows, r in results.items():
            print(
                f"{rows:>12}{r['spread']:>10}{r['unique rows']:>8.0f}{r['rows'] * 1e6:>9.1f}"
                f"{r['rows'] * 1e6 / r['unique rows']:>8.3f}{r['raw'] * 1e6:>8.1f}"
                f"{r['raw'] / r['rows']:>9.2f}{r['scattered'] * 1e6:>13.1f}{r['sent']:>12.0f}"
                f"{2 * r['unique rows'] * ROW_BYTES:>11.0f}"
            )
        for rows, r in results.items():
            print(
                f"{rows:>12}-row table: the timed pull + push steps touched {r['pass']:,.0f} "
                f"distinct rows a pass of {args.steps} steps (median, "
                f"{r['pass'] / rows:.2%} of the table), {r['all']:,} in all {args.reps} "
                f"passes ({r['all'] / rows:.2%})"
            )
        big, small = results[10_000_000], results[10_000]
        per_row = {
            k: big[k] / big[f"unique {k}"] / (small[k] / small[f"unique {k}"])
            for k in ("rows", "scattered")
        }
        print(
            f"10M-row / 10K-row: step time {big['rows'] / small['rows']:.2f}x, time per unique "
            f"row {per_row['rows']:.2f}x "
            f"(target <= 1.2x); raw scattered transfer of rows drawn the same way "
            f"{big['scattered'] / small['scattered']:.2f}x, per row "
            f"{per_row['scattered']:.2f}x"
        )
    cluster.free()


if __name__ == "__main__":
    main()
