"""Property-based fuzzing of the job and layout parsers: any input gives a valid result or one
ConfigError (what the CLI prints as a single line, exit 2), never another exception."""

import dataclasses
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mpips.errors import ConfigError
from mpips.job import Job, parse_job
from mpips.placement.layout import make_layout

SECTIONS = {
    f.name: [g.name for g in dataclasses.fields(f.default_factory())]
    for f in dataclasses.fields(Job)
    if f.default_factory is not dataclasses.MISSING
}
scalars = st.one_of(
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(-1e3, 1e3, allow_nan=False),
    st.text(max_size=8),
    st.sampled_from(["sgd", "adam", "sync", "async", "digits"]),
)
values = st.one_of(scalars, st.lists(st.one_of(st.booleans(), st.integers(-2, 9)), max_size=4))


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string
    return "[" + ", ".join(toml_value(x) for x in v) + "]"


@st.composite
def job_texts(draw):
    lines = []
    if draw(st.booleans()):
        lines.append(f"name = {toml_value(draw(st.text(max_size=5)))}")
    for section, keys in SECTIONS.items():
        if not draw(st.booleans()):
            continue
        lines.append(f"[{draw(st.sampled_from([section, section, section + 'x']))}]")
        for key in draw(
            st.lists(st.sampled_from(keys + ["bogus", "stpes"]), max_size=5, unique=True)
        ):
            lines.append(f"{key} = {toml_value(draw(values))}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(job_texts())
def test_structured_job_files_parse_or_fail_cleanly(text):
    try:
        job = parse_job(text, "fuzz.toml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.toml: ") and "\n" not in str(e)
        return
    assert job.train.batch_size > 0 and (job.train.steps or job.train.epochs)
    # one source of data at most: a file, the built-in set, or none here (arrays given to
    # mpips.train, or .npy files; a run without any says so when it opens its data)
    assert not (job.data.path and job.data.builtin)
    assert not (job.data.builtin and job.data.train_x)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_parses_or_fails_cleanly(text):
    try:
        parse_job(text, "fuzz.toml")
    except ConfigError:
        pass


ps_specs = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 12),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(-2, 12), st.booleans(), st.text(max_size=2)), max_size=6),
)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 12), ps_specs, st.one_of(st.none(), st.integers(0, 12)), st.booleans())
def test_layouts_are_valid_or_fail_cleanly(world, ps, expected, sync):
    try:
        lay = make_layout(world, ps, expected, sync=sync)
    except ConfigError as e:
        assert str(e).startswith("layout: ")
        return
    assert lay.world_size == world and lay.num_workers >= 1
    assert len(set(lay.ps_ranks)) == len(lay.ps_ranks)
    assert all(0 <= r < world for r in lay.ps_ranks)
    assert sorted(lay.ps_ranks + lay.worker_ranks) == list(range(world))
    assert lay.role(lay.chief_rank).is_chief
