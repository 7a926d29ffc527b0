import pytest

from mpips.nn import MLP
from mpips.placement import ALIGN, VariableSpec, greedy_by_bytes, round_robin


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
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
        assert p.ps_bytes(task) >= (spans[-1][1] if spans else 0)


def test_greedy_balances_bytes():
    big = [VariableSpec("a", (1000,)), VariableSpec("b", (10,)), VariableSpec("c", (10,)),
           VariableSpec("d", (990,))]
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
