import json
import os
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpips import checkpoint
from mpips.checkpoint import Checkpoint, Entry, Part
from mpips.checkpoint.manifest import _covers_once
from mpips.checkpoint.reading import _overlap
from mpips.errors import CheckpointError
from mpips.models.variables import VariableSpec
from mpips.placement.table import round_robin, slot_placement

SPECS = [VariableSpec("dense_0/kernel", (3, 2)), VariableSpec("dense_0/bias", (2,))]


def values(seed=0):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}


def save(d, step, v, max_to_keep=3, slots=None, meta=None):
    """What the chief does in sync mode: one shard holding everything, then the commit."""
    slots = slots or {}
    checkpoint.write_shard(d, step, 0, 1, v, slots)
    return checkpoint.commit(
        d,
        step,
        1,
        checkpoint.whole_index(v),
        checkpoint.whole_index(slots),
        meta or {},
        max_to_keep,
    )


def test_round_trip_and_latest(tmp_path):
    v = values()
    save(tmp_path, 7, v)
    save(tmp_path, 12, values(1), meta={"clocks": [5, 7]})
    assert checkpoint.latest_checkpoint(tmp_path).name == "ckpt-12.json"
    ckpt = Checkpoint(tmp_path / "ckpt-7.json")
    assert ckpt.step == 7 and ckpt.clocks is None
    assert checkpoint.resolve(tmp_path).clocks == [5, 7]
    got = ckpt.read(SPECS)
    for k in v:
        np.testing.assert_array_equal(got[k], v[k])


def test_one_shard_per_ps_reassembles_by_name(tmp_path):
    """Each PS writes what it holds; the manifest's index finds every variable and slot, and
    a checkpoint written by 2 PS tasks loads whole (so onto any other number of them)."""
    placement = round_robin(SPECS, 2)
    slots = slot_placement(placement, ("m",))
    v = values()
    m = {f"{n}/m": a + 1 for n, a in v.items()}
    for task in (1, 0):  # any order: they run in parallel
        checkpoint.write_shard(
            tmp_path,
            4,
            task,
            2,
            {e.spec.name: v[e.spec.name] for e in placement.on_ps(task)},
            {e.spec.name: m[e.spec.name] for e in slots.on_ps(task)},
        )
    checkpoint.commit(tmp_path, 4, 2, *checkpoint.index_of(placement, slots), {}, 3)
    ckpt = checkpoint.resolve(tmp_path)
    assert ckpt.num_shards == 2 and ckpt.variables["dense_0/bias"].parts == (Part(1),)
    got_v, got_m = ckpt.read_all()
    assert got_v.keys() == v.keys() and got_m.keys() == m.keys()
    for k in v:
        np.testing.assert_array_equal(got_v[k], v[k])
        np.testing.assert_array_equal(got_m[f"{k}/m"], m[f"{k}/m"])


def test_row_partitions_are_reassembled(tmp_path):
    """A variable split by rows over shards ("mod" rule here) comes back whole."""
    table = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    for k in range(2):
        checkpoint.write_shard(tmp_path, 1, k, 2, {"emb": table[k::2]})
    index = {"emb": Entry((7, 3), "float32", (Part(0, (0, 7, 2)), Part(1, (1, 7, 2))))}
    checkpoint.commit(tmp_path, 1, 2, index, {}, {}, 3)
    got = checkpoint.resolve(tmp_path).read([VariableSpec("emb", (7, 3))])["emb"]
    np.testing.assert_array_equal(got, table)


@pytest.mark.parametrize("stored", [2, 3])
@pytest.mark.parametrize("rule", ["mod", "div"])
def test_a_partition_reads_only_its_rows(tmp_path, stored, rule):
    """A PS restoring its partition gets exactly those rows, from the shards that hold them,
    whatever partition rule and PS count wrote the checkpoint (mod, 2 or 3 shards here)."""
    table = np.arange(11 * 2, dtype=np.float32).reshape(11, 2)
    for k in range(stored):
        checkpoint.write_shard(tmp_path, 1, k, stored, {"emb": table[k::stored]})
    index = {
        "emb": Entry((11, 2), "float32", tuple(Part(k, (k, 11, stored)) for k in range(stored)))
    }
    checkpoint.commit(tmp_path, 1, stored, index, {}, {}, 3)
    ckpt = checkpoint.resolve(tmp_path)
    spec = VariableSpec("emb", (11, 2))
    for n in (1, 2, 3, 4):
        for k in range(n):
            rows = (k, 11, n) if rule == "mod" else (k * 11 // n, (k + 1) * 11 // n, 1)
            got = ckpt.read([spec], rows={"emb": rows})["emb"]
            np.testing.assert_array_equal(got, table[slice(*rows)])


@settings(max_examples=300, deadline=None)
@given(
    st.tuples(st.integers(0, 40), st.integers(0, 60), st.integers(1, 7)),
    st.tuples(st.integers(0, 40), st.integers(0, 60), st.integers(1, 7)),
)
def test_overlap_of_two_row_ranges(want, held):
    """The rows two partitions share, as slices of each, equal the brute-force intersection."""
    want, held = range(*want), range(*held)
    both = sorted(set(want) & set(held))
    got = _overlap(want, held)
    if not both:
        assert got is None
    else:
        in_held, in_want = got
        assert list(held[in_held]) == both and list(want[in_want]) == both


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 30),
    st.lists(st.tuples(st.integers(0, 35), st.integers(0, 35)), min_size=1, max_size=6),
    st.integers(1, 5),
)
def test_covers_once_agrees_with_counting_rows(num_rows, bounds, step):
    """Exact cover, decided by arithmetic, equals counting every row (for ranges of one step)."""
    parts = [Part(k, (a, b, step)) for k, (a, b) in enumerate(bounds)]
    counts = np.zeros(max(num_rows, 36) + 1, int)
    for a, b in bounds:
        np.add.at(counts, list(range(a, b, step)), 1)
    brute = bool((counts[:num_rows] == 1).all() and counts[num_rows:].sum() == 0)
    assert _covers_once(parts, num_rows) == brute


def test_crafted_manifest_parts_are_checked_quickly(tmp_path):
    """Many parts, or a step of 2^40, are refused (or checked) at once, not pairwise."""
    import time

    stored = values(1)
    save(tmp_path, 1, stored)
    manifest = tmp_path / "ckpt-1.json"
    raw = json.loads(manifest.read_text())
    n = 1 << 15  # pairwise checks: 5e8 of them
    raw["shards"] = n
    raw["variables"] = {
        "t": {
            "shape": [n, 1],
            "dtype": "float32",
            "parts": [{"shard": k, "rows": [k, k + 1, 1]} for k in range(n)],
        }
    }
    manifest.write_text(json.dumps(raw))
    start = time.monotonic()
    checkpoint.Checkpoint(manifest)  # a valid, if odd, cover: accepted
    assert time.monotonic() - start < 5
    raw["variables"]["t"]["parts"][0]["rows"] = [0, 1, 1 << 40]
    manifest.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="step"):
        checkpoint.Checkpoint(manifest)
    raw["variables"]["t"]["parts"][1]["shard"] = 0
    raw["variables"]["t"]["parts"][0]["rows"] = [0, 1, 1]
    manifest.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="two of its parts"):
        checkpoint.Checkpoint(manifest)


def test_commit_needs_every_shard_and_prunes_only_after(tmp_path):
    for s in (1, 2, 3, 4):
        save(tmp_path, s, values(s), max_to_keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.h5")) == [
        "ckpt-3.shard-0-of-1.h5",
        "ckpt-4.shard-0-of-1.h5",
    ]
    # a crashed write: one of two shards and a temporary, never committed
    checkpoint.write_shard(tmp_path, 5, 0, 2, values(5))
    (tmp_path / ".ckpt-5.shard-1-of-2.h5.tmp-node7-4242").write_bytes(b"half written")
    with pytest.raises(CheckpointError, match="shard 1 of 2 for global_step 5 is missing"):
        checkpoint.commit(tmp_path, 5, 2, checkpoint.whole_index(values()), {}, {}, 2)
    assert checkpoint.latest_checkpoint(tmp_path).name == "ckpt-4.json"  # still the last commit
    save(tmp_path, 6, values(6), max_to_keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-4.json",
        "ckpt-4.shard-0-of-1.h5",
        "ckpt-6.json",
        "ckpt-6.shard-0-of-1.h5",
    ]


def test_failed_write_keeps_previous(tmp_path):
    save(tmp_path, 1, values())
    with pytest.raises(TypeError):
        checkpoint.write_shard(tmp_path, 2, 0, 1, {"dense_0/kernel": object()})
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == [
        "ckpt-1.json",
        "ckpt-1.shard-0-of-1.h5",
    ]
    assert checkpoint.resolve(tmp_path).step == 1


def test_mismatch_names_the_variable(tmp_path):
    save(tmp_path, 1, values())
    ckpt = checkpoint.resolve(tmp_path)
    wrong = [VariableSpec("dense_0/kernel", (3, 4)), SPECS[1]]
    with pytest.raises(
        CheckpointError,
        match=r"'dense_0/kernel' is float32\[3, 2\], the model "
        r"expects float32\[3, 4\]",
    ):
        ckpt.read(wrong)
    with pytest.raises(CheckpointError, match="has no variable 'extra'"):
        ckpt.read(SPECS + [VariableSpec("extra", (1,))])
    with pytest.raises(CheckpointError, match="has no optimizer slot 'dense_0/bias/m'"):
        ckpt.read(SPECS, [VariableSpec("dense_0/bias/m", (2,))])


def edit_manifest(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"shards": 0}, "shards must be an integer in 1.."),
        ({"global_step": 2}, "global_step does not match the file name"),
        (
            {"variables": {"w": {"shape": [2], "dtype": "object", "parts": [{"shard": 0}]}}},
            "is not a number type",
        ),
        (
            {"variables": {"w": {"shape": [2], "dtype": "float32", "parts": [{"shard": 3}]}}},
            "names no shard",
        ),
        (
            {
                "variables": {
                    "w": {
                        "shape": [4],
                        "dtype": "float32",
                        "parts": [{"shard": 0, "rows": [0, 4, 2]}],
                    }
                }
            },
            "do not cover it",
        ),
        (
            {
                "shards": 2,
                "variables": {
                    "w": {
                        "shape": [4],
                        "dtype": "float32",
                        "parts": [{"shard": 0, "rows": [0, 2, 1]}, {"shard": 1, "rows": [0, 2, 1]}],
                    }
                },
            },
            "do not cover it",
        ),
        (
            {
                "variables": {
                    "w": {
                        "shape": [4],
                        "dtype": "float32",
                        "parts": [{"shard": 0, "rows": [0, 4, 0]}],
                    }
                }
            },
            "do not fit",
        ),
        (
            {"variables": {"w": {"shape": [-1], "dtype": "float32", "parts": [{"shard": 0}]}}},
            "non-negative integers",
        ),
        ({"clocks": "../../etc/passwd"}, "clocks must be a list"),
    ],
)
def test_bad_manifests_are_clear_errors(tmp_path, change, message):
    path = save(tmp_path, 1, values())
    edit_manifest(path, **change)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(path)


def test_corrupt_and_foreign_files(tmp_path):
    path = save(tmp_path, 1, values())
    shard = tmp_path / "ckpt-1.shard-0-of-1.h5"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        Checkpoint(path).read(SPECS)
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard ckpt-1.shard-0-of-1.h5 is missing"):
        Checkpoint(path).read(SPECS)
    path.write_text(path.read_text()[:40])
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        Checkpoint(path)
    (tmp_path / "ckpt-3.json").write_text('{"format": "something else"}')
    with pytest.raises(CheckpointError, match="not an mpips checkpoint"):
        Checkpoint(tmp_path / "ckpt-3.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a checkpoint manifest"):
        checkpoint.resolve(tmp_path / "other.json")
    save(tmp_path, 4, values())
    with pytest.raises(CheckpointError, match=r"one shard of a checkpoint; give its manifest"):
        checkpoint.resolve(tmp_path / "ckpt-4.shard-0-of-1.h5")


def test_the_checkpoint_package_builds_no_job_dataset_or_model():
    """Checkpoints read and write arrays and a manifest, with initial values handed in:
    nothing under mpips.checkpoint imports (even indirectly, or for a type hint) a job, a
    dataset or a model."""
    from test_code_shape import all_imports
    from test_structure import modules

    mods = modules()
    graph = {n: all_imports(n, t, set(mods)) for n, t in mods.items()}
    seen = {n for n in mods if n.startswith("mpips.checkpoint")}
    todo = list(seen)
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    reached = seen & {
        "mpips.job",
        "mpips.data.batches",
        "mpips.models.contract",
        "mpips.models.mlp",
        "mpips.models.ctr",
    }
    assert not reached, sorted(seen)


# -- every shard is the manifest's, and holds what it says --------------------------------------


def two_steps(d):
    """Checkpoints at steps 1 and 2, each of two shards (a variable in each)."""
    placement = round_robin(SPECS, 2)
    for step in (1, 2):
        v = values(step)
        for task in range(2):
            arrays = {e.spec.name: v[e.spec.name] for e in placement.on_ps(task)}
            checkpoint.write_shard(d, step, task, 2, arrays, run="r")
        checkpoint.commit(d, step, 2, *checkpoint.index_of(placement), {}, 3, run="r")
    return d / "ckpt-2.json"


def set_attr(shard, name, value):
    with h5py.File(shard, "r+") as f:
        if value is None:
            del f.attrs[name]
        else:
            f.attrs[name] = value


def copy_over(d, source):
    (d / "ckpt-2.shard-0-of-2.h5").write_bytes((d / source).read_bytes())


SHARD_0 = "ckpt-2.shard-0-of-2.h5"
MIXED = {
    "a shard of step 1 copied over step 2's": (
        lambda d: copy_over(d, "ckpt-1.shard-0-of-2.h5"),
        "its global_step is 1, not 2 (a shard of another checkpoint, copied or renamed?)",
    ),
    "shard 1 copied over shard 0": (
        lambda d: copy_over(d, "ckpt-2.shard-1-of-2.h5"),
        "its shard index is 1, not 0",
    ),
    "global_step edited": (
        lambda d: set_attr(d / SHARD_0, "global_step", 9),
        "its global_step is 9, not 2",
    ),
    "global_step deleted": (
        lambda d: set_attr(d / SHARD_0, "global_step", None),
        "it has no global_step attribute",
    ),
    "shard index deleted": (
        lambda d: set_attr(d / SHARD_0, "shard", None),
        "it has no shard attribute",
    ),
    "shard count edited": (
        lambda d: set_attr(d / SHARD_0, "shards", 3),
        "its shard count is 3, not 2",
    ),
    "format deleted": (
        lambda d: set_attr(d / SHARD_0, "format", None),
        "it has no format attribute",
    ),
    "format edited": (
        lambda d: set_attr(d / SHARD_0, "format", "mpips-checkpoint-1"),
        "its format is 'mpips-checkpoint-1'",
    ),
    "checksum kind deleted": (
        lambda d: set_attr(d / SHARD_0, "checksum", None),
        "it has no checksum attribute",
    ),
    "checksum kind edited": (
        lambda d: set_attr(d / SHARD_0, "checksum", "md5"),
        "its checksum is 'md5', not 'crc32'",
    ),
}


@pytest.mark.parametrize("case", MIXED)
def test_a_shard_whose_attributes_are_not_the_manifests_is_refused(tmp_path, case):
    """A checkpoint never mixes steps or shards: a shard whose format, global_step, index
    or count is not the manifest's is one message naming it and what differs, for a read
    and for ckpt inspect's layouts, and nothing is modified."""
    path = two_steps(tmp_path)
    change, said = MIXED[case]
    change(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    ckpt = Checkpoint(path)
    message = re.escape(f"shard {SHARD_0} is not this checkpoint's: {said}")
    with pytest.raises(CheckpointError, match=message):
        ckpt.read_all()
    on_0 = next(n for n, e in ckpt.variables.items() if e.parts[0].shard == 0)
    with pytest.raises(CheckpointError, match=message):
        ckpt.layouts(on_0)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_shard_written_before_the_shard_count_and_checksums_still_loads(tmp_path):
    """The shard count and checksums are newer than the format: shards without them load."""
    path = two_steps(tmp_path)
    for k in range(2):
        shard = tmp_path / checkpoint.shard_name(2, k, 2)
        set_attr(shard, "shards", None)
        set_attr(shard, "checksum", None)
        with h5py.File(shard, "r+") as f:
            f.visititems(lambda _, o: o.attrs.__delitem__("crc32") if "crc32" in o.attrs else 0)
    got = Checkpoint(path).read_all()[0]
    for k, v in values(2).items():
        np.testing.assert_array_equal(got[k], v)


REPLACED = {
    "another dtype": (
        np.zeros((3, 2), np.float64),
        "holds 'dense_0/kernel' as float64[3, 2], the manifest says float32[3, 2]",
    ),
    "another shape": (
        np.zeros((2, 2), np.float32),
        "holds 'dense_0/kernel' as float32[2, 2], the manifest says float32[3, 2]",
    ),
    "none": (None, "holds no 'dense_0/kernel', the manifest says float32[3, 2]"),
}


@pytest.mark.parametrize("case", REPLACED)
def test_a_dataset_of_another_dtype_or_shape_is_named(tmp_path, case):
    path = save(tmp_path, 1, values())
    value, said = REPLACED[case]
    with h5py.File(tmp_path / "ckpt-1.shard-0-of-1.h5", "r+") as f:
        del f["variables/dense_0/kernel"]
        if value is not None:
            f["variables/dense_0/kernel"] = value
    with pytest.raises(CheckpointError, match=re.escape(f"shard ckpt-1.shard-0-of-1.h5 {said}")):
        Checkpoint(path).read(SPECS)


@pytest.mark.parametrize(
    "kind, said", [("fifo", "is a FIFO"), ("directory", "is a directory"), ("zero", "is a device")]
)
def test_a_shard_that_is_no_regular_file_says_what_it_is(tmp_path, kind, said):
    path = save(tmp_path, 1, values())
    shard = tmp_path / "ckpt-1.shard-0-of-1.h5"
    shard.unlink()
    {"fifo": os.mkfifo, "directory": os.mkdir, "zero": lambda p: os.symlink("/dev/zero", p)}[kind](
        shard
    )
    with pytest.raises(CheckpointError, match=f"shard {shard.name}: {said}, not a regular file"):
        Checkpoint(path).read(SPECS)


# -- checksums -------------------------------------------------------------------------------


def flip(shard, dataset, at=0):
    """Flip one bit of byte ``at`` of ``dataset``'s values, in the file's bytes (as a disk
    or a copy damages them), leaving its metadata as it was."""
    with h5py.File(shard, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    "dataset, said",
    [
        ("variables/dense_0/kernel", "variable 'dense_0/kernel'"),
        ("slots/m/dense_0/bias", "optimizer slot 'dense_0/bias/m'"),
    ],
)
def test_a_flipped_byte_in_a_shards_values_is_refused(tmp_path, dataset, said):
    v = values()
    path = save(tmp_path, 1, v, slots={"dense_0/bias/m": v["dense_0/bias"] + 1})
    shard = tmp_path / "ckpt-1.shard-0-of-1.h5"
    flip(shard, dataset, at=5)
    before = shard.read_bytes()
    with pytest.raises(
        CheckpointError,
        match=f"shard {shard.name} is damaged: the values of {said} do not match the checksum",
    ):
        Checkpoint(path).read_all()
    assert shard.read_bytes() == before
    with h5py.File(shard, "r+") as f:  # without a checksum in a shard that records them
        del f[dataset].attrs["crc32"]
    with pytest.raises(CheckpointError, match=f"its dataset /{dataset} .* carries none"):
        Checkpoint(path).read_all()


@pytest.mark.parametrize("at", [0, 9, -1])
def test_a_large_array_read_in_blocks_is_checked_across_them(tmp_path, monkeypatch, at):
    """A large part is read a block of rows at a time, each block's crc32 chained in a
    thread while the next is read: a flipped byte in the first, a middle or the last block
    is refused, and undamaged, the blocks give the array's values."""
    from mpips.checkpoint import reading

    monkeypatch.setattr(reading, "READ_BLOCK_ELEMENTS", 2)  # the 3x2 kernel: a row a block
    v = values()
    path = save(tmp_path, 1, v)
    got = Checkpoint(path).read_all()[0]
    assert all(np.array_equal(got[k], v[k]) for k in v)
    shard = tmp_path / "ckpt-1.shard-0-of-1.h5"
    size = v["dense_0/kernel"].nbytes
    flip(shard, "variables/dense_0/kernel", at=at % size)
    with pytest.raises(CheckpointError, match="the values of variable 'dense_0/kernel' do not"):
        Checkpoint(path).read_all()


def partitioned(d, shards=2, rows=11):
    """A table of ``rows`` rows split "mod" over ``shards`` shards."""
    table = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    for k in range(shards):
        checkpoint.write_shard(d, 1, k, shards, {"emb": table[k::shards]})
    index = {
        "emb": Entry(
            table.shape, "float32", tuple(Part(k, (k, rows, shards)) for k in range(shards))
        )
    }
    checkpoint.commit(d, 1, shards, index, {}, {}, 3)
    return checkpoint.resolve(d), VariableSpec("emb", table.shape), table


def test_a_partition_is_checked_when_all_its_rows_are_read(tmp_path):
    """Every read of all of a stored partition checks its crc32: the same partition, or
    several merged onto fewer PS tasks. A read of some of its rows (restoring onto a PS
    count that splits it) is not checked: it would have to read the rest too."""
    ckpt, spec, table = partitioned(tmp_path)
    flip(ckpt.shard_path(1), "variables/emb", at=10)  # its row 1: the table's row 3
    damaged = "shard ckpt-1.shard-1-of-2.h5 is damaged: the values of variable 'emb'"
    for rows in [(1, 11, 2), (0, 11, 1)]:  # the same partition; 2 PS -> 1
        with pytest.raises(CheckpointError, match=damaged):
            ckpt.read([spec], rows={"emb": rows})
    got = ckpt.read([spec], rows={"emb": (0, 11, 3)})["emb"]  # 2 PS -> 3: rows 0, 3, 6, 9
    assert got[1].tobytes() != table[3].tobytes()  # (not checked: documented)
    np.testing.assert_array_equal(ckpt.read([spec], rows={"emb": (0, 11, 2)})["emb"], table[::2])


def test_the_checksum_is_of_what_was_written(tmp_path, monkeypatch):
    """Values that change while a shard is written (SGD updates landing in a PS's window)
    are checksummed as the file holds them: each block is copied, then checksummed and
    written, and the file then reads back with no checksum error. Here an update lands
    right after each block's checksum, before its write: written from a view of the array
    (not a copy), the file would hold the update and no longer match its checksum."""
    from mpips.checkpoint import checksum

    monkeypatch.setattr(checksum, "CHUNK_ELEMENTS", 8)  # 4 rows of 2 a block: 5 blocks
    a = np.arange(40, dtype=np.float32).reshape(20, 2)
    original = a.copy()
    real_crc32 = checksum.crc32
    blocks = []

    def update_after(block, value=0):
        got = real_crc32(block, value)
        blocks.append(got)
        a[:] += 1  # the update lands between the checksum and the write
        return got

    monkeypatch.setattr(checksum, "crc32", update_after)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        ds = checksum.write_array(f, "x", a)
        written = ds[()]
        assert int(ds.attrs["crc32"]) == real_crc32(written)
    monkeypatch.setattr(checksum, "crc32", real_crc32)
    assert len(blocks) == 5  # crosses 4 block boundaries
    # each block as it was when copied: the ones before it had added 1 each
    want = original + np.repeat(np.arange(5, dtype=np.float32), 4)[:, None]
    np.testing.assert_array_equal(written, want)
    assert checksum.crc32(a[::2]) == checksum.crc32(np.ascontiguousarray(a[::2]))
    assert checksum.crc32(a[10:], checksum.crc32(a[:10])) == checksum.crc32(a)
