"""Hostile checkpoints and data files on the restore and read path: a checkpoint holding NaN
or infinity is refused by ``train``'s restore as ``eval`` refuses it; a data position counted
with another batch size or seed is not restored; damaged HDF5 metadata is one message naming
the file, never a traceback; manifest integers past 64-bit counters are one message."""

import json
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import clean_env, dense_data_file, run_mpi, run_py, run_train

from mpips import checkpoint
from mpips.checkpoint import Checkpoint, checksum
from mpips.errors import CheckpointError
from mpips.job import parse_job
from mpips.models.variables import VariableSpec
from mpips.run.startup import data_position

DIGITS_JOB = """
[model]
hidden = [16]
[data]
builtin = "digits"
[optimizer]
kind = "adam"
[train]
steps = {steps}
mode = "{mode}"
batch_size = {batch}
seed = {seed}
log_every = 0
progress = false
[checkpoint]
dir = "ck"
"""


def digits_job(d, mode="async", steps=10, batch=32, seed=0):
    (d / "job.toml").write_text(DIGITS_JOB.format(mode=mode, steps=steps, batch=batch, seed=seed))


@pytest.fixture(scope="module")
def trained_async(tmp_path_factory):
    """digits_job's async run on 3 ranks (1 PS) to its checkpoint at global_step 10, trained
    once for the tests that damage a copy of it."""
    d = tmp_path_factory.mktemp("trained_async")
    digits_job(d)
    r = run_train(d, 3, "job.toml", "--ps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def trained(request, tmp_path, mode="async"):
    """``tmp_path`` holds digits_job and its checkpoint at global_step 10 (3 ranks, 1 PS):
    a copy of the module's async run, or (another mode) a run of its own."""
    if mode == "async":
        shutil.copytree(request.getfixturevalue("trained_async"), tmp_path, dirs_exist_ok=True)
        return
    digits_job(tmp_path, mode)
    assert run_train(tmp_path, 3, "job.toml", "--ps", "1").returncode == 0


def one_message(r, said):
    """The run failed with exit 2 and ``said`` once, in one line, with no traceback."""
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if said in line]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def snapshot(d):
    """Every checkpoint file in ``d`` (not the lock) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.startswith("ckpt-")}


# -- 1. NaN or infinity: train's restore refuses it, as eval does -----------------------------


def poke(shard, path, value, crc=True):
    """Put ``value`` into element [1, 2] (or [1]) of dataset ``path`` of ``shard``, as no
    mpips run writes it; ``crc``: with the checksum of the new values, as a file written
    by other means would carry (else the checksum written with the old ones: damage)."""
    with h5py.File(shard, "r+") as f:
        a = f[path][()]
        a[(1, 2) if a.ndim == 2 else (1,)] = value
        f[path][...] = a
        if crc:
            f[path].attrs[checksum.CRC32] = np.uint32(checksum.crc32(a))


@pytest.mark.launcher
@pytest.mark.parametrize(
    "mode, path, name, value",
    [
        ("async", "variables/dense_0/kernel", "variable 'dense_0/kernel'", np.nan),
        ("async", "slots/v/dense_0/kernel", "optimizer slot 'dense_0/kernel/v'", np.inf),
        ("sync", "variables/dense_1/bias", "variable 'dense_1/bias'", -np.inf),
    ],
)
def test_train_refuses_a_checkpoint_holding_nan_or_infinity(
    request, tmp_path, mode, path, name, value
):
    """The PS tasks (async) or the chief (sync) find it as they read it: one message naming
    the checkpoint and the variable or slot, exit 2 on every rank, nothing overwritten."""
    trained(request, tmp_path, mode)
    ck = tmp_path / "ck"
    poke(ck / "ckpt-10.shard-0-of-1.h5", path, value)
    before = snapshot(ck)
    r = run_train(tmp_path, 3, "job.toml", "--ps", "1", "--steps", "20")
    line = one_message(r, "NaN or infinite value(s)")
    assert f"checkpoint ck/ckpt-10.json: {name} holds 1 NaN or infinite value(s)" in line, line
    assert "learning rate" not in r.stderr and r.result is None
    assert snapshot(ck) == before


def test_a_read_refuses_non_finite_arrays_only_when_asked(tmp_path):
    w = {"w": np.ones((2, 3), np.float32)}
    checkpoint.write_shard(tmp_path, 1, 0, 1, w, {"w/v": np.ones((2, 3), np.float32)}, run="r")
    path = checkpoint.commit(
        tmp_path,
        1,
        1,
        checkpoint.whole_index(w),
        checkpoint.whole_index({"w/v": w["w"]}),
        {},
        run="r",
    )
    poke(tmp_path / "ckpt-1.shard-0-of-1.h5", "slots/v/w", np.nan)
    spec, slot = [VariableSpec("w", (2, 3), "float32")], [VariableSpec("w/v", (2, 3), "float32")]
    got = Checkpoint(path).read(spec, slot)
    assert np.isnan(got["w/v"]).sum() == 1  # inspect and export still read it
    with pytest.raises(CheckpointError, match=r"optimizer slot 'w/v' holds 1 NaN .* of 6: why"):
        Checkpoint(path).read(spec, slot, finite="why")
    assert checkpoint.count_non_finite(np.array([1e38, 1e38], np.float32)) == 0  # (sum: inf)
    assert checkpoint.count_non_finite(np.array([np.inf, -np.inf, 1], np.float32)) == 2


# -- 2. the data position: not restored when the batch size or seed changed -------------------


def test_the_data_position_is_kept_only_with_the_same_workers_batch_size_and_seed(tmp_path):
    job = parse_job("[train]\nsteps = 5\nbatch_size = 7\nseed = 3\n")
    meta = {"data": {"batch_size": 7, "seed": 3}}
    d = tmp_path / "ck"
    checkpoint.write_shard(d, 4, 0, 1, {"w": np.ones(2, np.float32)}, run="r")
    index = checkpoint.whole_index({"w": np.ones(2, np.float32)})

    def position(workers=2, clocks=(4, 5), **data):
        m = {"clocks": list(clocks), "data": {**meta["data"], **data}}
        return data_position(
            job, Checkpoint(checkpoint.commit(d, 4, 1, index, {}, m, run="r")), workers
        )

    assert position() == ([4, 5], "")
    clocks, why = position(batch_size=32)
    assert clocks is None and why == (
        "the batch size changed (train.batch_size = 32 in the checkpoint, 7 in this run)"
    )
    clocks, why = position(seed=0)
    assert clocks is None and "the seed changed (train.seed = 0 in the checkpoint, 3 in" in why
    clocks, why = position(workers=3, batch_size=8)
    assert clocks is None and "number of workers changed" in why and "batch size" in why
    assert position(clocks=())[0] is None


RESUMES = [("async", "batch"), ("sync", "batch"), ("sync_replicas", "seed"), ("hybrid", "batch")]


@pytest.mark.launcher
@pytest.mark.parametrize("mode, change", RESUMES)
def test_a_changed_batch_size_or_seed_starts_the_data_afresh(tmp_path, mode, change):
    """Batches counted at batch size 8 (seed 5) are not skipped at another size or seed: the
    chief says so, and no worker resumes at a batch."""
    if mode == "hybrid":
        from test_ctr_mpi import JOB, small_dataset

        small_dataset(tmp_path / "s.h5")

        def write(steps, batch, seed):
            text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=steps)
            text = text.replace("[train]\n", '[train]\nmode = "hybrid"\n')
            text = text.replace("batch_size = 8", f"batch_size = {batch}")
            (tmp_path / "job.toml").write_text(text.replace("seed = 5", f"seed = {seed}"))

    else:

        def write(steps, batch, seed):
            digits_job(tmp_path, mode, steps, batch, seed)

    write(10, 8, 5)
    assert run_train(tmp_path, 3, "job.toml", "--ps", "1").returncode == 0
    write(20, 7, 5) if change == "batch" else write(20, 8, 6)
    r = run_train(tmp_path, 3, "job.toml", "--ps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "restored global_step 10" in r.stdout, r.stdout[-3000:]
    what = (
        "the batch size changed (train.batch_size = 8 in the checkpoint, 7 in this run)"
        if change == "batch"
        else "the seed changed (train.seed = 5 in the checkpoint, 6 in this run)"
    )
    assert r.stdout.count(f"data position not restored: {what}") == 1, r.stdout[-3000:]
    assert "resuming at batch" not in r.stdout, r.stdout[-3000:]


# -- 3. damaged HDF5 metadata: one message naming the file -------------------------------------

# Flip each byte at these offsets (XOR 0xFF, and set to 124) in a small shard and a small data
# file, and load each result in a child process: every load succeeds or is one MpipsError of
# one line naming the file. The offsets: every 3rd byte of each file's first 2 KiB (its
# superblock, object headers, B-trees and local heaps: where h5py raised RuntimeError,
# SystemError, KeyError ... and, reading a string attribute whose type a flip made a
# sequence, crashed), and every 61st byte after. Nothing is left out: mpips writes its text
# attributes (format, run id, name) as fixed-length strings, so its files have no global
# heap, where h5py keeps variable-length strings and where a damaged object size made
# libhdf5 (2.0) loop forever, in C (the test asserts there is none).
FLIP_SCRIPT = r"""
import json, sys, traceback, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from mpips import checkpoint
from mpips.data import batches as data
from mpips.errors import MpipsError

kind, target, offsets = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
original = target.read_bytes()


def load():
    if kind == "shard":
        ckpt = checkpoint.resolve(target.parent)
        ckpt.read_all()
        ckpt.layouts("w")
    else:
        info = data.open_dataset(str(target))
        data.load_split(info, "train")
        data.load_split(info, "test")


bad = []
for at in offsets:
    if at >= len(original):
        continue
    for value in (original[at] ^ 0xFF, 124):
        raw = bytearray(original)
        raw[at] = value
        target.write_bytes(bytes(raw))
        try:
            load()
        except MpipsError as e:
            text = str(e)
            if "\n" in text or target.name not in text:
                bad.append([at, value, "unclear: " + text])
        except Exception as e:
            bad.append([at, value, "".join(traceback.format_exception(e))[-600:]])
target.write_bytes(original)
print(json.dumps(bad))
"""


def flip_and_load(kind, target):
    raw = target.read_bytes()
    assert b"GCOL" not in raw, "a global heap: some text was written as a variable-length string"
    offsets = sorted(set(range(0, 2048, 3)) | set(range(2048, len(raw), 61)))
    r = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", FLIP_SCRIPT, kind, str(target)]
        + [json.dumps(offsets)],
        cwd=target.parent,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout)
    assert not bad, f"{len(bad)} loads of damaged copies of {target.name}:\n" + "\n".join(
        f"byte {at} = {value}: {said}" for at, value, said in bad[:5]
    )


def small_shard(d):
    """A committed checkpoint of one shard: a variable, a vector and an optimizer slot."""
    w = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, np.float32)}
    slots = {"w/v": np.full((4, 3), 0.5, np.float32)}
    checkpoint.write_shard(d, 7, 0, 1, w, slots, run="run-1")
    checkpoint.commit(
        d, 7, 1, checkpoint.whole_index(w), checkpoint.whole_index(slots), {}, run="run-1"
    )
    return d / "ckpt-7.shard-0-of-1.h5"


@pytest.mark.launcher
def test_damaged_bytes_in_a_shard_are_one_message_naming_it(tmp_path):
    flip_and_load("shard", small_shard(tmp_path / "ck"))


@pytest.mark.launcher
def test_damaged_bytes_in_a_data_file_are_one_message_naming_it(tmp_path):
    from mpips.data.convert import write_dataset

    rng = np.random.default_rng(0)
    split = [
        (rng.integers(0, 255, (n, 4), dtype=np.uint8), rng.integers(0, 3, n)) for n in (60, 10)
    ]
    write_dataset(tmp_path / "d.h5", split[0], split[1], 3, name="a named set")
    flip_and_load("data", tmp_path / "d.h5")


def damage(path, at, raw):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(raw)


@pytest.mark.launcher
def test_a_shard_with_damaged_metadata_is_one_message_for_every_command(request, tmp_path):
    """The reproduction: byte 172 of a trained shard set to 124 (h5py: "Link visitation
    failed (addr overflow ...)"), for train's restore, ckpt inspect, ckpt export and eval."""
    trained(request, tmp_path)
    shard = tmp_path / "ck/ckpt-10.shard-0-of-1.h5"
    damage(shard, 172, bytes([124]))
    before = snapshot(tmp_path / "ck")
    said = "checkpoint ck/ckpt-10.json: corrupt or unreadable (shard ckpt-10.shard-0-of-1.h5:"
    r = run_train(tmp_path, 3, "job.toml", "--ps", "1", "--steps", "20")
    one_message(r, said)
    for args in (
        ["ckpt", "inspect", "ck"],
        ["ckpt", "export", "ck", "out.h5"],
        ["eval", "job.toml"],
    ):
        r = run_py(["-m", "mpips", *args], tmp_path)
        one_message(r, said)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    assert snapshot(tmp_path / "ck") == before and not (tmp_path / "out.h5").exists()


def flip_value(shard, dataset, at):
    """Flip a bit of byte ``at`` of ``dataset``'s values in ``shard``'s bytes (its metadata,
    checksum included, as written): what a failing disk or copy does."""
    with h5py.File(shard, "r") as f:
        offset = f[dataset].id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset + at] ^= 0x10
    shard.write_bytes(bytes(raw))


MIXED_OR_FLIPPED = {
    "mixed": (
        lambda ck: (ck / "ckpt-20.shard-0-of-2.h5").write_bytes(
            (ck / "ckpt-10.shard-0-of-2.h5").read_bytes()
        ),
        "checkpoint ck/ckpt-20.json: shard ckpt-20.shard-0-of-2.h5 is not this checkpoint's: "
        "its global_step is 10, not 20",
    ),
    "flipped": (
        lambda ck: flip_value(ck / "ckpt-20.shard-1-of-2.h5", "variables/dense_0/bias", 9),
        "checkpoint ck/ckpt-20.json: shard ckpt-20.shard-1-of-2.h5 is damaged: the values of "
        "variable 'dense_0/bias' do not match the checksum",
    ),
}


@pytest.mark.launcher
@pytest.mark.parametrize("case", MIXED_OR_FLIPPED)
def test_a_mixed_or_damaged_checkpoint_is_refused_by_train_eval_and_inspect(tmp_path, case):
    """The reproduction: a run of 2 PS tasks checkpoints at steps 10 and 20; step 10's shard 0
    copied over step 20's, or a flipped bit in a shard's values, is one message naming the
    shard for a resuming train, eval and ckpt inspect (exit 2), and nothing is written."""
    digits_job(tmp_path, steps=20)
    job = tmp_path / "job.toml"
    job.write_text(job.read_text() + "every_steps = 10\n")  # one run: one run id
    assert run_train(tmp_path, 4, "job.toml", "--ps", "2").returncode == 0
    ck = tmp_path / "ck"
    change, said = MIXED_OR_FLIPPED[case]
    change(ck)
    before = snapshot(ck)
    r = run_train(tmp_path, 4, "job.toml", "--ps", "2", "--steps", "30")
    one_message(r, said)
    assert r.result is None
    for args in (["eval", "job.toml"], ["ckpt", "inspect", "ck"]):
        one_message(run_py(["-m", "mpips", *args], tmp_path), said)
    assert snapshot(ck) == before


@pytest.mark.launcher
def test_a_data_file_with_damaged_metadata_is_one_message(tmp_path):
    """The reproduction: bytes 15-18 of a data file set to b0 2b 3d c6."""
    path = dense_data_file(tmp_path / "d.h5")
    damage(path, 15, bytes.fromhex("b02b3dc6"))
    (tmp_path / "job.toml").write_text('[data]\npath = "d.h5"\n[train]\nsteps = 5\n')
    r = run_py(["-m", "mpips", "train", "job.toml", "--no-progress"], tmp_path)
    one_message(r, "data file d.h5: not a readable mpips HDF5 dataset (")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- 4. manifest integers past 64-bit counters ---------------------------------------------


def edited(d, **change):
    """The committed manifest of small_shard, with ``change`` to its JSON."""
    path = d / "ckpt-7.json"
    raw = json.loads(path.read_text())
    for key, value in change.items():
        if "." in key:
            outer, inner = key.split(".", 1)
            raw.setdefault(outer, {})[inner] = value
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    "change, said",
    [
        ({"clocks": [10**30, 3]}, "clocks must be integers in 0..2**62 - 1"),
        ({"clocks": [2**63, 3]}, "clocks must be integers in 0..2**62 - 1"),
        ({"data.batch_size": 2**64}, "data.batch_size must be integers in 0..2**62 - 1"),
        ({"data.seed": 2**63}, "data.seed must be integers in 0..2**62 - 1"),
        ({"data": [1]}, "'data' must be a table"),
        ({"layout.workers": 10**20}, "layout.workers must be integers in 0..2**62 - 1"),
    ],
)
def test_manifest_integers_past_64_bit_counters_are_refused(tmp_path, change, said):
    small_shard(tmp_path)
    path = edited(tmp_path, **change)
    with pytest.raises(
        CheckpointError, match=f"ckpt-7.json: corrupt or unreadable .*{re.escape(said)}"
    ):
        Checkpoint(path)


def test_a_variable_whose_shape_or_rows_pass_2_62_is_refused(tmp_path):
    small_shard(tmp_path)
    path = tmp_path / "ckpt-7.json"
    raw = json.loads(path.read_text())
    raw["variables"]["b"]["shape"] = [0, 2**63]
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"variables 'b': shape must be integers"):
        Checkpoint(path)


def test_a_global_step_past_2_62_is_refused(tmp_path):
    """The files renamed to step 2**63 + 5 and the manifest's global_step to match."""
    small_shard(tmp_path)
    step = 2**63 + 5
    raw = json.loads((tmp_path / "ckpt-7.json").read_text())
    raw["global_step"] = step
    (tmp_path / f"ckpt-{step}.json").write_text(json.dumps(raw))
    (tmp_path / "ckpt-7.json").unlink()
    (tmp_path / "ckpt-7.shard-0-of-1.h5").rename(tmp_path / checkpoint.shard_name(step, 0, 1))
    with pytest.raises(CheckpointError, match=f"global_step {step} is not in 0..2"):
        checkpoint.resolve(tmp_path)


@pytest.mark.launcher
@pytest.mark.parametrize("past", ["clocks", "global_step"])
def test_train_refuses_manifest_integers_past_64_bits_with_one_message(request, tmp_path, past):
    trained(request, tmp_path)
    ck = tmp_path / "ck"
    raw = json.loads((ck / "ckpt-10.json").read_text())
    if past == "clocks":
        raw["clocks"] = [10**30, 3]
        (ck / "ckpt-10.json").write_text(json.dumps(raw))
        said = "checkpoint ck/ckpt-10.json: corrupt or unreadable (clocks must be integers"
    else:
        step = raw["global_step"] = 2**63 + 5
        (ck / f"ckpt-{step}.json").write_text(json.dumps(raw))
        (ck / "ckpt-10.json").unlink()
        (ck / "ckpt-10.shard-0-of-1.h5").rename(ck / checkpoint.shard_name(step, 0, 1))
        said = f"checkpoint ck/ckpt-{step}.json: corrupt or unreadable (global_step {step}"
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--ps", "1", "--steps", "80"], tmp_path)
    one_message(r, said)
    assert "OverflowError" not in r.stderr
