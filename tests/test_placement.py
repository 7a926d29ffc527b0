import pytest

from mpips.models.mlp import MLP
from mpips.models.variables import VariableSpec
from mpips.placement.table import ALIGN, greedy_by_bytes, round_robin


def specs(n):
    return [VariableSpec(f"v{i}", (i + 1, 3)) for i in range(n)]


def test_round_robin_is_replica_device_setter_rule():
    p = round_robin(specs(6), 2)
    assert [e.ps_task for e in p] == [0, 1, 0, 1, 0, 1]
    assert [e.spec.name for e in p.on_ps(0)] == ["v0", "v2", "v4"]
    assert [e.ps_task for e in round_robin(specs(7), 3)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("strategy", [round_robin, greedy_by_bytes])
def test_offsets_are_aligned_and_disjoint(strategy):
    p = strategy(MLP([784, 512, 512, 10]).variables(), 3)
    for task in range(3):
        spans = sorted((e.offset, e.offset + e.spec.nbytes) for e in p.on_ps(task))
        assert all(a % ALIGN == 0 for a, _ in spans)
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))
        assert p.ps_bytes(task) >= (spans[-1][1] if spans else 0)


def test_greedy_balances_bytes():
    big = [
        VariableSpec("a", (1000,)),
        VariableSpec("b", (10,)),
        VariableSpec("c", (10,)),
        VariableSpec("d", (990,)),
    ]
    p = greedy_by_bytes(big, 2)
    assert [e.ps_task for e in p] == [0, 1, 1, 1]


def test_digests_see_order_and_shape():
    a = round_robin(specs(4), 2).entry_digests()
    assert a == round_robin(specs(4), 2).entry_digests()
    swapped = specs(4)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    assert round_robin(swapped, 2).entry_digests()[1] != a[1]
    assert round_robin(specs(4), 3).entry_digests() != a


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="used twice"):
        round_robin([VariableSpec("w", (2,)), VariableSpec("w", (3,))], 1)


def test_pinned_variables_go_to_their_ps_task_and_the_rest_follow_the_rule():
    from mpips.placement.table import greedy_by_bytes, round_robin

    specs = [VariableSpec(f"v{i}", (10 * (i + 1),)) for i in range(5)]
    rr = round_robin(specs, 2, {"v1": 1, "v2": 1})
    assert [e.ps_task for e in rr] == [0, 1, 1, 1, 0]  # v0, v3, v4: the 0th, 1st, 2nd free
    greedy = greedy_by_bytes(specs, 2, {"v4": 0})  # v4 (200 B) counts on ps:0 first
    assert [e.ps_task for e in greedy] == [1, 1, 1, 0, 0]


def tf1_round_robin(names, num_ps, pins):
    """TensorFlow 1.x's replica_device_setter (device_setter.py), reduced to its rule: its
    _RoundRobinStrategy is called for every variable whose device names no other job,
    pinned or not, and a pin's task then wins the merge (DeviceSpec.merge_from)."""
    turn, tasks = 0, []
    for name in names:
        chosen, turn = turn, (turn + 1) % num_ps
        tasks.append(pins.get(name, chosen))
    return tasks


@pytest.mark.parametrize(
    "pins",
    [
        {"v0": 0, "v1": 0},  # the case: a, b on ps:0; TF1 puts c, d on 0, 1
        {"v1": 1, "v2": 1},
        {"v3": 2},
        {"v0": 2, "v2": 0, "v4": 1},
    ],
)
def test_pins_take_turns_gives_tensorflow_1s_placement(pins):
    names = [f"v{i}" for i in range(6)]
    specs = [VariableSpec(n, (4,)) for n in names]
    tf1 = [e.ps_task for e in round_robin(specs, 3, pins, pins_take_turns=True)]
    assert tf1 == tf1_round_robin(names, 3, pins)


def test_by_default_a_pin_takes_no_turn_and_the_job_key_gives_tf1s_rule():
    """a pinned to ps:0, b and c free on 2 PS: TF1 gives b turn 1 (a used up turn 0), so
    0, 1, 0; mpips's default gives b the first free turn: 0, 0, 1. With an even number of
    pins ahead (a, b pinned to ps:0, then c, d) both rules give 0, 0, 0, 1."""
    import mpips
    from mpips.placement.plan import job_placement

    def tasks(variables, pins, turns=""):
        job = mpips.parse_job(f"[train]\nsteps = 1\n[layout]\n{turns}[layout.pin]\n{pins}")
        specs = [VariableSpec(n, (4,)) for n in variables]
        return [e.ps_task for e in job_placement(job, specs, 2)]

    assert tasks("abc", "a = 0\n") == [0, 0, 1]
    assert tasks("abc", "a = 0\n", "pins_take_turns = true\n") == [0, 1, 0]
    assert tasks("abcd", "a = 0\nb = 0\n") == [0, 0, 0, 1]
    assert tasks("abcd", "a = 0\nb = 0\n", "pins_take_turns = true\n") == [0, 0, 0, 1]


def test_greedy_with_pins_taking_turns_counts_a_pin_where_tf1s_strategy_did():
    """TF1's GreedyLoadBalancingStrategy is asked for a pinned variable too and adds its
    bytes to the task it chose, not to the pin's: a (100 floats) pinned to ps:1 counts on
    ps:0, so b and c go to ps:1 as well. mpips's default counts a on ps:1 first."""
    specs = [VariableSpec("a", (100,)), VariableSpec("b", (10,)), VariableSpec("c", (10,))]
    tf1 = greedy_by_bytes(specs, 2, {"a": 1}, pins_take_turns=True)
    assert [e.ps_task for e in tf1] == [1, 1, 1]
    assert [e.ps_task for e in greedy_by_bytes(specs, 2, {"a": 1})] == [1, 0, 0]


def test_pins_from_the_job_are_checked():
    import mpips
    from mpips.errors import ConfigError
    from mpips.placement.plan import job_placement

    specs = [VariableSpec("w", (4, 4)), VariableSpec("b", (4,))]
    base = '[data]\nbuiltin = "digits"\n[train]\nsteps = 1\n[layout.pin]\n'
    job = mpips.parse_job(base + '"b" = 1\n')
    assert [e.ps_task for e in job_placement(job, specs, 2)] == [0, 1]
    with pytest.raises(ConfigError, match="layout.pin: the model has no variable 'x'"):
        job_placement(mpips.parse_job(base + "x = 0\n"), specs, 2)
    with pytest.raises(ConfigError, match=r"layout.pin.b: 2 is not a ps task .*\(0..1\)"):
        job_placement(mpips.parse_job(base + "b = 2\n"), specs, 2)


def test_an_unbalanced_placement_is_named_with_what_would_fix_it():
    from mpips.placement.table import greedy_by_bytes, imbalance, round_robin

    fmnist = [
        VariableSpec("k0", (784, 256)),
        VariableSpec("b0", (256,)),
        VariableSpec("k1", (256, 128)),
        VariableSpec("b1", (128,)),
    ]
    said = imbalance(round_robin(fmnist, 2), "round_robin")
    assert "ps:0 912.0 KiB, ps:1 1.5 KiB" in said and 'layout.partition = ["k0"]' in said
    even = [
        VariableSpec(n, (256, 256) if n[0] == "k" else (4,))  # kernels all on ps:0
        for i in range(4)
        for n in (f"k{i}", f"b{i}")
    ]
    said = imbalance(round_robin(even, 2), "round_robin")
    assert 'layout.placement = "greedy"' in said
    assert imbalance(greedy_by_bytes(even, 2), "greedy") == ""
    assert imbalance(round_robin(even, 1), "round_robin") == ""


@pytest.mark.launcher
def test_a_job_with_pins_trains_and_places_them(tmp_path):
    """A pin to ps:1 holds in a real run (both modes that keep variables on the PS)."""
    from conftest import run_train

    from mpips import checkpoint

    for mode in ("async", "sync_replicas"):
        (tmp_path / "job.toml").write_text(
            f'[data]\nbuiltin = "digits"\n[train]\nmode = "{mode}"\nsteps = 30\n'
            f'[checkpoint]\ndir = "runs/{mode}"\n[layout]\nps = 2\n'
            '[layout.pin]\n"dense_0/kernel" = 1\n"dense_1/kernel" = 1\n'
        )
        r = run_train(tmp_path, 4, "job.toml", timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        manifest = checkpoint.Checkpoint(checkpoint.latest_checkpoint(tmp_path / f"runs/{mode}"))
        shards = {name: [p.shard for p in e.parts] for name, e in manifest.variables.items()}
        assert shards["dense_0/kernel"] == [1] and shards["dense_1/kernel"] == [1], shards


def test_the_model_api_does_not_depend_on_ps_sharding():
    """mpips.Variable is VariableSpec from models/variables.py, which models/contract.py
    imports; neither reaches placement (where each variable lives on the PS tasks)."""
    import ast
    from pathlib import Path

    import mpips.models.variables

    assert mpips.Variable is mpips.models.variables.VariableSpec
    for name in ("models/contract.py", "models/variables.py"):
        tree = ast.parse((Path(mpips.__file__).parent / name).read_text())
        imported = {  # from ..placement.table, import mpips.placement.table: every part
            part
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom | ast.Import)
            for m in ([n.module or ""] if isinstance(n, ast.ImportFrom) else [])
            + [a.name for a in n.names]
            for part in m.split(".")
        }
        assert "placement" not in imported, (name, imported)
