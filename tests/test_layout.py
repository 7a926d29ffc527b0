import pytest

from mpips.errors import ConfigError
from mpips.placement.layout import make_layout, read_layout_file


@pytest.mark.parametrize("world,ps,workers", [(8, 2, 6), (3, 1, 2), (2, 1, 1), (16, 4, 12)])
def test_default_layout(world, ps, workers):
    lay = make_layout(world)
    assert (lay.num_ps, lay.num_workers) == (ps, workers)
    assert lay.ps_ranks == tuple(range(ps))
    assert lay.chief_rank == ps


def test_explicit_ranks_and_roles():
    lay = make_layout(8, [0, 4])
    assert lay.worker_ranks == (1, 2, 3, 5, 6, 7)
    assert str(lay.role(4)) == "/job:ps/task:1"
    assert str(lay.role(5)) == "/job:worker/task:3"
    assert lay.role(1).is_chief and not lay.role(2).is_chief
    assert lay.rank_of("worker", 3) == 5 and lay.rank_of("ps", 1) == 4


@pytest.mark.parametrize(
    "world,ps,expected_world,message",
    [
        (8, [0, 9], None, "ps rank 9 is out of range for 8 ranks"),
        (8, [-1], None, "ps rank -1 is out of range"),
        (8, [1, 1], None, "ps rank 1 is listed more than once"),
        (3, [0, 1, 2], None, "at least one worker"),
        (3, 3, None, "needs 1 <= ps < world size 3"),
        (3, 0, None, "needs 1 <= ps < world size 3"),
        (3, [], None, "names no PS rank"),
        (3, True, None, "must be a count, a list of ranks or"),
        (1, "per_node", None, "at least 2 ranks"),
        (3, ["0"], None, "must be integers"),
        (3, None, 8, "world_size = 8, but the job runs on 3 ranks"),
        (1, None, None, "needs at least 2 ranks"),
    ],
)
def test_invalid_layouts(world, ps, expected_world, message):
    with pytest.raises(ConfigError, match=message):
        make_layout(world, ps, expected_world)


def test_layout_file(tmp_path):
    f = tmp_path / "l.toml"
    f.write_text("ps = [0, 4]\nworld_size = 8\n")
    assert read_layout_file(f) == {"ps": [0, 4], "world_size": 8}
    f.write_text("ps = [0, 4]\nwrold_size = 8\n")
    with pytest.raises(ConfigError, match="unknown key 'wrold_size' .did you mean 'world_size'"):
        read_layout_file(f)
    f.write_text("ps = [0, \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        read_layout_file(f)
    with pytest.raises(ConfigError, match="not found"):
        read_layout_file(tmp_path / "missing.toml")


def test_one_ps_per_node():
    from mpips.placement.layout import block_nodes

    assert block_nodes(8, 2) == [0, 0, 0, 0, 4, 4, 4, 4]
    assert make_layout(8, "per_node", nodes=block_nodes(8, 2)).ps_ranks == (0, 4)
    # uneven nodes, as a heterogeneous allocation gives them
    assert make_layout(6, "per_node", nodes=[0, 0, 0, 3, 3, 5]).ps_ranks == (0, 3, 5)
    assert make_layout(3, "per_node").ps_ranks == (0,)  # one node
    with pytest.raises(ConfigError, match="leaves no worker"):
        make_layout(2, "per_node", nodes=[0, 1])
