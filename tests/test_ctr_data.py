"""CTR data larger than memory: the Criteo converter, streaming converters, and a worker
streaming its part of a CSR file in chunks, each with bounded memory."""

import math
import zlib

import numpy as np
import pytest
from conftest import run_py

from mpips.data import batches as data
from mpips.data import ctr_convert, sparse
from mpips.errors import DataError
from mpips.job import DataConfig


def criteo_row(label, ints, cats):
    """A Criteo line: label, 13 integers, 26 categorical (None: empty)."""
    ints = ints + [None] * (13 - len(ints))
    cats = cats + [None] * (26 - len(cats))
    return "\t".join([str(label)] + ["" if v is None else str(v) for v in ints + cats]) + "\n"


def token_id(token, bits=24):
    return zlib.crc32(token.encode()) & ((1 << bits) - 1)


def test_criteo_text_converts_with_hashed_buckets_and_categories(tmp_path):
    lines = [criteo_row(k % 2, [k, -1, 1000], ["68fd1e64", "", "3b08e48b"]) for k in range(10)]
    lines[3] = criteo_row(1, [], [])  # every feature missing
    (tmp_path / "day.txt").write_text("".join(lines))
    ctr_convert.convert_criteo(tmp_path / "c.h5", tmp_path / "day.txt", bits=24)
    info = data.open_dataset(str(tmp_path / "c.h5"))
    assert info.sparse and info.num_inputs == 1 << 24
    # every 5th row (rows 4 and 9) held out for test
    assert info.rows == {"train": 8, "test": 2}
    x, y = sparse.load_csr(info.path, "train", (0, 8), info.num_inputs)
    np.testing.assert_array_equal(y, [0, 1, 0, 1, 1, 0, 1, 0])  # rows 0 1 2 3 5 6 7 8
    # row 5: I1 = 5 -> bucket floor(ln(5)^2) = 2; I2 = -1 as it is; I3 = 1000 -> 47
    assert int(math.log(5) ** 2) == 2 and int(math.log(1000) ** 2) == 47
    want = {token_id(t) for t in ("I1:2", "I2:-1", "I3:47", "C1:68fd1e64", "C3:3b08e48b")}
    assert set(x[4].indices) == want and set(x[4].data) == {1.0}
    assert x[3].nnz == 0  # a row with no features is kept, empty
    assert set(x[0].indices) == {token_id(t) for t in ("I1:0", "I2:-1", "I3:47")} | {
        token_id("C1:68fd1e64"),
        token_id("C3:3b08e48b"),
    }


@pytest.mark.parametrize(
    "line, message",
    [
        ("1\t2\t3\n", r"day.txt:2: not a Criteo line \(3 tab-separated fields, expected 40"),
        (criteo_row(2, [], []), r"day.txt:2: not a Criteo line \(label '2' is not 0 or 1"),
        (criteo_row(1, ["x"], []), r"day.txt:2: not a Criteo line \(invalid literal"),
    ],
)
def test_a_bad_criteo_line_is_named_and_writes_nothing(tmp_path, line, message):
    (tmp_path / "day.txt").write_text(criteo_row(0, [1], ["a"]) + line)
    (tmp_path / "c.h5").write_bytes(b"an earlier file")
    with pytest.raises(DataError, match=message):
        ctr_convert.convert_criteo(tmp_path / "c.h5", tmp_path / "day.txt")
    assert (tmp_path / "c.h5").read_bytes() == b"an earlier file"  # left as it was


def test_the_criteo_converter_from_the_command_line(tmp_path):
    (tmp_path / "day.txt").write_text("".join(criteo_row(k % 2, [k], ["ab"]) for k in range(20)))
    r = run_py(["-m", "mpips", "data", "criteo", "c.h5", "--src", "day.txt"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "16 train + 4 test rows, sparse, ids < 1048576, up to 2 per row" in r.stdout


CONVERT_RSS = """
import resource, sys
from mpips.data import ctr_convert
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ctr_convert.convert_libsvm(sys.argv[2], sys.argv[1])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def write_libsvm(path, rows, width=20):
    rng = np.random.default_rng(rows)
    with open(path, "w") as f:
        for lo in range(0, rows, 10000):
            ids = rng.integers(0, 1 << 20, (min(10000, rows - lo), width))
            f.writelines(
                f"{k % 2} " + " ".join(f"{i}:0.5" for i in sorted(set(r))) + "\n"
                for k, r in enumerate(ids)
            )


def test_text_converts_in_memory_that_does_not_grow_with_the_file(tmp_path):
    """A libsvm file 4x larger converts with the same peak memory: it is read and written
    a chunk of rows at a time (reading it whole would hold ~70 B per feature, ~170 MB)."""
    script = tmp_path / "convert.py"
    script.write_text(CONVERT_RSS)
    grew = {}
    for rows in (30_000, 120_000):
        write_libsvm(tmp_path / f"{rows}.svm", rows)
        r = run_py([str(script), f"{rows}.svm", f"{rows}.h5"], tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        grew[rows] = int(r.stdout)
        info = data.open_dataset(str(tmp_path / f"{rows}.h5"))
        assert info.rows == {"train": rows * 4 // 5, "test": rows // 5}
    assert grew[120_000] < 60 and grew[120_000] - grew[30_000] < 15, grew


def zipf_file(tmp_path, rows, nnz=16):
    path = tmp_path / f"z{rows}.h5"
    ctr_convert.make_zipf(path, rows=rows, num_features=1_000_000, nnz=nnz)
    return data.open_data(DataConfig(path=str(path)))


def rows_of(batch_stream):
    """(epoch, [first id and label of each row]) per batch: identifies the rows."""
    return [
        (e, [(int(xb[i].indices.sum()), int(yb[i])) for i in range(xb.shape[0])])
        for e, xb, yb in batch_stream
    ]


def test_a_streamed_sparse_part_visits_every_row_once_an_epoch_and_resumes(tmp_path):
    info = zipf_file(tmp_path, 3000)
    rows = (100, 2900)
    part = data.train_part(info, rows, chunk_rows=256)
    whole = data.train_part(info, rows)
    assert isinstance(part, data.StreamedPart) and isinstance(whole, data.InMemoryPart)
    everything = sorted(rows_of([(0, whole.x, whole.y)])[0][1])
    got = rows_of(part.batches(64, seed=1, task=0, epochs=2))
    for k in (0, 1):
        epoch = sorted(r for e, batch in got if e == k for r in batch)
        assert epoch == everything  # every row of the part, once
    assert got == rows_of(part.batches(64, seed=1, task=0, epochs=2))  # deterministic
    for start in (1, 30, 45):
        assert (
            rows_of(part.batches(64, seed=1, task=0, epochs=2, start_batch=start)) == (got[start:])
        )


STREAM_RSS = """
import resource, sys
from mpips.data import batches as data
from mpips.job import DataConfig
info = data.open_data(DataConfig(path=sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
part = data.train_part(info, (0, info.rows["train"]), chunk_rows=int(sys.argv[2]))
seen = nnz = 0
for epoch, x, y in part.batches(256, seed=0, task=0, epochs=1):
    seen, nnz = seen + len(y), nnz + x.nnz
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(seen, nnz, (after - before) // 1024)
"""


def test_a_worker_streams_a_csr_part_larger_than_its_memory(tmp_path):
    """300k rows x 32 Zipf ids (~23 distinct a row): read whole, the part takes ~200 MB
    (28 B an id, as stored and converted); streamed in chunks of 2048 rows, peak memory
    grows by a small fraction of that."""
    info = zipf_file(tmp_path, 300_000, nnz=32)
    (tmp_path / "stream.py").write_text(STREAM_RSS)
    r = run_py(["stream.py", info.path, "2048"], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    seen, nnz, grew_mb = map(int, r.stdout.split())
    assert seen == 300_000 and nnz * 28 > 150e6  # the part read whole: > 150 MB
    assert grew_mb < 50, f"peak memory grew by {grew_mb} MB streaming a ~200 MB part"


@pytest.mark.launcher
def test_a_ctr_job_streams_its_parts_and_learns(tmp_path):
    """Two workers stream their CSR parts in chunks through the CTR job (FTRL logreg, 2 PS
    tasks) and learn the planted model; the run ends after its epochs."""
    from conftest import run_train

    zipf_file(tmp_path, 20_000)
    (tmp_path / "job.toml").write_text(
        '[model]\nkind = "logreg"\n[data]\npath = "z20000.h5"\nchunk_rows = 1000\n'
        '[optimizer]\nkind = "ftrl"\nlearning_rate = 0.5\n'
        "[train]\nepochs = 2\nbatch_size = 100\n[layout]\nps = 2\n"
    )
    r = run_train(tmp_path, 4, "job.toml", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "streamed in chunks of 1000" in r.stdout
    assert r.result["global_step"] == 400 and r.result["test_auc"] > 0.6, r.result


def test_a_fresh_table_partition_is_filled_a_chunk_of_rows_at_a_time(monkeypatch):
    """A PS writes its partition's initial rows (and slots) into its window in chunks; the
    result equals the partition made whole, for both partition rules."""
    from mpips.job import OptimizerConfig
    from mpips.models.ctr import EMBEDDING, WideDeep
    from mpips.optim import build_optimizer
    from mpips.run import startup

    monkeypatch.setattr(startup, "FILL_ELEMENTS", 40)  # 5 rows of 8 a chunk
    model = WideDeep(1000, [4], embedding_dim=8)
    ftrl = build_optimizer(OptimizerConfig(kind="ftrl", initial_accumulator_value=0.25))
    for rows in ((1, 1000, 3), (500, 1000, 1)):
        whole = model.initial_rows(EMBEDDING, rows, 7)
        view = np.full_like(whole, np.nan)
        startup._fill_rows(model, ftrl, EMBEDDING, rows, 7, "", view)
        np.testing.assert_array_equal(view, whole)
        startup._fill_rows(model, ftrl, EMBEDDING, rows, 7, "n", view)
        assert (view == 0.25).all()
