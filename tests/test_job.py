import sys
from pathlib import Path

import pytest

from mpips.errors import ConfigError
from mpips.job import load_job, parse_job
from mpips.models.contract import import_factory
from mpips.modes import check_job, select
from mpips.placement.plan import job_layout

ROOT = Path(__file__).resolve().parent.parent


def test_the_builtin_default_job_is_what_the_readme_promises():
    """`mpirun -n 8 python -m mpips train`: digits shipped in the package, 600 async global
    steps, 2 PS + 6 workers on 8 ranks, checkpoints in runs/default; and jobs/default.toml,
    the copy users read, is the packaged file itself (a link), so the two cannot drift."""
    job = load_job(None)
    assert (job.data.builtin, job.data.path, job.train.mode, job.train.steps) == (
        "digits",
        "",
        "async",
        600,
    )
    assert job.checkpoint.dir == "runs/default" and job.checkpoint.restore
    layout = job_layout(job, 8, sync=False)
    assert (layout.num_ps, layout.num_workers, layout.chief_rank) == (2, 6, 2)
    assert (ROOT / "jobs/default.toml").resolve() == (ROOT / "mpips/builtin/default.toml").resolve()
    readme = (ROOT / "README.md").read_text()
    assert "600 asynchronous global steps" in readme and "runs/default/" in readme


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_jobs_parse(path):
    job = load_job(path)
    assert job.name and (job.train.steps or job.train.epochs)


MINIMAL = '[data]\nbuiltin = "digits"\n[train]\nsteps = 10\n'


@pytest.mark.parametrize(
    "text,message",
    [
        (MINIMAL + "bach_size = 3\n", r"unknown key 'bach_size' \(did you mean 'batch_size'\?\)"),
        (MINIMAL + "[optimzer]\n", r"unknown key 'optimzer' \(did you mean 'optimizer'\?\)"),
        (MINIMAL + "batch_size = 'x'\n", r"train.batch_size: expected an integer, got 'x'"),
        (MINIMAL + "batch_size = 0\n", r"train.batch_size: must be > 0"),
        (MINIMAL + "seed = 1.5\n", r"train.seed: expected an integer"),
        # a checkpoint's manifest holds integers up to 2**62 - 1: a run with a bigger seed or
        # batch size would write checkpoints no restore accepts
        (MINIMAL + f"seed = {2**62}\n", r"train.seed: must be at most 2\*\*62 - 1, got 4611686"),
        (MINIMAL + f"batch_size = {2**62}\n", r"train.batch_size: must be at most 2\*\*62 - 1"),
        (MINIMAL.replace("10", str(10**23)), r"train.steps: must be at most 2\*\*62 - 1, got 1000"),
        (MINIMAL + f"[model]\nhidden = [8, {2**63}]\n", r"model.hidden: must be at most 2\*\*62"),
        (MINIMAL + "mode = 'semi'\n", r"train.mode: 'semi' is not one of 'async'"),
        (MINIMAL + "[model]\nhidden = [64, 'x']\n", r"model.hidden: expected a list of integers"),
        (
            MINIMAL + "[layout]\nps = 'two'\n",
            r"layout.ps: expected a count, a list of ranks or \"per_node\", got 'two'",
        ),
        # wrong whatever the world size: refused by every run, one process included
        (MINIMAL + "[layout]\nps = -1\n", r"layout.ps: a count of PS tasks must be >= 0, got -1"),
        (MINIMAL + "[layout]\nps = [0, -2]\n", r"layout.ps: ps rank -2 is negative"),
        (MINIMAL + "[layout]\nps = [1, 1]\n", r"layout.ps: ps rank 1 is listed more than once"),
        (
            MINIMAL + "[checkpoint]\nevery_secs = true\n",
            r"checkpoint.every_secs: expected a number",
        ),
        (MINIMAL + "overlap_pull = true\n", r'train.overlap_pull: only for mode = "async" with'),
        (
            MINIMAL + "device = 'gpu'\noverlap_pull = true\nmax_staleness = 0\n",
            r"train.overlap_pull: not with train.max_staleness",
        ),
        (
            MINIMAL + "device = 'gpu'\noverlap_pull = true\n[model]\nkind = 'logreg'\n",
            r"train.overlap_pull: model.kind = 'logreg' pulls the rows",
        ),
        (
            MINIMAL + "device = 'gpu'\noverlap_pull = true\nzero_copy = true\n",
            r"train.overlap_pull: nothing to pull ahead with train.zero_copy",
        ),
        (
            MINIMAL.replace("[train]", "on_device = true\n[train]"),
            r'data.on_device: only for train.device = "gpu"',
        ),
        (
            MINIMAL.replace("[train]", "on_device = true\nchunk_rows = 64\n[train]")
            + "device = 'gpu'\n",
            r"data.on_device: .*\(not with data.chunk_rows",
        ),
        ('[data]\nbuiltin = "digits"\n', r"give train.steps or train.epochs"),
        ("train = 3\n", r"train: expected a table"),
        ("[train\n", r"invalid TOML"),
    ],
)
def test_job_errors_name_the_key(text, message):
    """A job file's errors; the mode's rules (train.overlap_pull's) are its mode's
    (mpips.modes.check_job: what every rank agrees on at the start of a run)."""
    with pytest.raises(ConfigError, match=message):
        check_job(parse_job(text, "job.toml"))


def test_the_file_checks_types_and_ranges_the_mode_its_own_rules():
    """job.py takes a setting of another mode; its mode refuses it, the mode a job trains in
    (select) checks it before anything runs."""
    text = '[data]\nbuiltin = "digits"\n[train]\nmode = "sync"\nsteps = 5\nmax_staleness = 2\n'
    job = parse_job(text)
    for refuse in (check_job, lambda j: select(j, 3), lambda j: select(j, 1)):
        with pytest.raises(ConfigError, match='max_staleness: only for mode = "async"'):
            refuse(job)
    job.train.max_staleness = None
    assert select(job, 3).name == "sync"


@pytest.mark.parametrize(
    "kind,hint",
    [
        ("models/net.py:build", 'model.kind = "models.net:build" (looked for beside the job file'),
        ("./models/net:build", 'model.kind = "models.net:build"'),
        ("/home/me/net.py:build", 'model.kind = "net:build" with net.py beside the job file'),
        ("../net.py:make.model", 'model.kind = "net:make.model" with net.py beside the job'),
    ],
)
def test_a_model_kind_naming_a_file_says_the_module_to_give(kind, hint):
    """A file's path where model.kind wants a module (as `net.py:build` gets from the model
    loader: drop the .py) says what to write instead, not only that it is no model kind."""
    with pytest.raises(ConfigError) as e:
        parse_job(MINIMAL + f"[model]\nkind = {kind!r}\n", "job.toml")
    said = str(e.value)
    assert f"job.toml: model.kind: {kind!r} is a file's path: model.kind names a module" in said
    assert hint in said and "\n" not in said


def test_the_module_name_it_suggests_is_found_beside_the_job_file(tmp_path, monkeypatch):
    (tmp_path / "kind_path_models").mkdir()
    (tmp_path / "kind_path_models/net.py").write_text("def build(data):\n    return 'built'\n")
    (tmp_path / "job.toml").write_text(MINIMAL)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (import_factory adds the job's folder)
    try:
        factory = import_factory("kind_path_models.net:build", str(tmp_path / "job.toml"))
        assert factory(None) == "built"
    finally:
        for name in ("kind_path_models.net", "kind_path_models"):
            sys.modules.pop(name, None)


def test_a_model_kind_that_is_no_path_is_told_the_choices():
    for kind in ("my model", "models/my-net.py:build", "models/net.py:", "net.py"):
        with pytest.raises(ConfigError, match=r"is not 'mlp', 'logreg', 'wide_deep' or"):
            parse_job(MINIMAL + f"[model]\nkind = {kind!r}\n", "job.toml")


def test_numbers_widen_and_missing_file():
    job = parse_job(MINIMAL + "[optimizer]\nlearning_rate = 1\n")
    assert job.optimizer.learning_rate == 1.0 and isinstance(job.optimizer.learning_rate, float)
    with pytest.raises(ConfigError, match="not found"):
        load_job("/nonexistent/job.toml")
