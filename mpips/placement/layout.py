"""Rank layout: which MPI rank plays which role (``/job:ps/task:i`` or ``/job:worker/task:i``)."""

from __future__ import annotations

import bisect
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..process.files import read_text
from ..process.settings import launch_hint
from ..schema import check_keys, check_ps, is_int

PS, WORKER = "ps", "worker"


@dataclass(frozen=True)
class Role:
    """One rank's job and task index; the chief is worker task 0."""

    job: str
    task: int

    @property
    def is_chief(self) -> bool:
        return self.job == WORKER and self.task == 0

    def __str__(self) -> str:
        return f"/job:{self.job}/task:{self.task}"


@dataclass(frozen=True)
class Layout:
    """The PS ranks of a world; every other rank is a worker, in rank order."""

    world_size: int
    ps_ranks: tuple[int, ...]

    @cached_property
    def worker_ranks(self) -> tuple[int, ...]:
        ps = set(self.ps_ranks)
        return tuple(r for r in range(self.world_size) if r not in ps)

    @cached_property
    def _ps_tasks(self) -> dict[int, int]:
        """Each PS rank's task index."""
        return {r: task for task, r in enumerate(self.ps_ranks)}

    @cached_property
    def _sorted_ps(self) -> list[int]:
        return sorted(self.ps_ranks)

    @property
    def num_ps(self) -> int:
        return len(self.ps_ranks)

    @property
    def num_workers(self) -> int:
        return self.world_size - len(self.ps_ranks)

    @property
    def chief_rank(self) -> int:
        """Worker task 0's rank."""
        return self.worker_ranks[0]

    def role(self, rank: int) -> Role:
        """The role of ``rank``, in constant time or nearly (``mpips layout -n N`` asks it
        of every rank: a search of the worker ranks each time made that quadratic)."""
        task = self._ps_tasks.get(rank)
        if task is not None:
            return Role(PS, task)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        return Role(WORKER, rank - bisect.bisect_left(self._sorted_ps, rank))

    def rank_of(self, job: str, task: int) -> int:
        return (self.ps_ranks if job == PS else self.worker_ranks)[task]


def default_num_ps(world_size: int) -> int:
    """One PS per four ranks, at least one: 8 -> 2 PS + 6 workers, 3 -> 1 PS + 2 workers."""
    return max(1, world_size // 4)


PER_NODE = "per_node"
# the most ranks `mpips layout -n` shows: as many as a checkpoint may have shards
# (checkpoint.MAX_SHARDS, one per PS task); more is a typo, not a world
MAX_WORLD_SIZE = 1 << 20


def check_world(world_size: int, num_nodes: int, what: str = "-n") -> None:
    """ConfigError unless ``world_size`` (said by ``what``) is in 1..MAX_WORLD_SIZE and
    ``num_nodes`` in 1..world_size (each node runs at least one rank): the sizes
    ``mpips layout`` is asked to show, checked before anything is built for each rank."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(
            f"{what} {world_size}: the number of ranks must be in 1..{MAX_WORLD_SIZE}"
        )
    if not 1 <= num_nodes <= world_size:
        raise ConfigError(
            f"--nodes {num_nodes}: must be in 1..{world_size} (each node runs at least one "
            f"of the {world_size} ranks)"
        )


def block_nodes(world_size: int, num_nodes: int) -> list[int]:
    """Each rank's node (its lowest rank) when ranks fill nodes in blocks, as srun and
    mpiexec place them by default."""
    per = -(-world_size // max(1, num_nodes))
    return [r // per * per for r in range(world_size)]


def node_indices(nodes: Sequence[int]) -> list[int]:
    """Each rank's node as 0, 1, ... in order of their lowest ranks (``nodes`` names each
    rank's node by its lowest rank), as ``mpips layout`` and the warnings say them."""
    order = {node: i for i, node in enumerate(sorted(set(nodes)))}
    return [order[node] for node in nodes]


def ps_imbalance(ps_ranks: Sequence[int], nodes: Sequence[int]) -> str | None:
    """A warning, or None: every PS task (two or more) on one node of several. That node's
    network link then carries every other node's pulls and pushes, and its cores serve
    them all, while the other nodes' links to it wait. (One PS task is on one node by
    necessity: nothing to say.) ``nodes``: each rank's node, named by its lowest rank."""
    hosts = sorted(set(nodes))
    on = {nodes[r] for r in ps_ranks}
    if len(ps_ranks) < 2 or len(hosts) < 2 or len(on) != 1:
        return None
    (node,) = on
    ranks = [r for r, n in enumerate(nodes) if n == node]
    here = (
        f"ranks {ranks[0]}-{ranks[-1]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1))
        else ("ranks " + ",".join(map(str, ranks)))
    )
    return (
        f"all {len(ps_ranks)} ps tasks run on node {hosts.index(node)} ({here}) of "
        f"{len(hosts)} nodes: that node's network link carries every pull and push of the "
        f'other nodes\' workers; ps = "per_node" puts one ps task on each node (or list '
        f"ranks on several nodes: ps = [...])"
    )


def make_layout(
    world_size: int,
    ps: int | list[int] | str | None = None,
    expected_world_size: int | None = None,
    source: str = "layout",
    sync: bool = False,
    nodes: list[int] | None = None,
) -> Layout:
    """Validate a PS spec (count, explicit rank list, ``"per_node"`` or None for the default)
    for a world size.

    ``nodes``: each rank's node, named by its lowest rank (``"per_node"`` puts one PS on
    each node: that lowest rank); None means one node. ``sync``: synchronous replicas need
    no PS, so ``ps = 0`` is allowed and is the default.
    """
    if expected_world_size is not None and expected_world_size != world_size:
        raise ConfigError(
            f"{source}: world_size = {expected_world_size}, but the job runs "
            f"on {world_size} ranks ({launch_hint(expected_world_size)}?)"
        )
    least = 1 if sync else 2
    if world_size < least:
        raise ConfigError(
            f"{source}: mpips needs at least 2 ranks (1 ps + 1 worker), got "
            f"{world_size}; launch with e.g. `{launch_hint(3)} python -m mpips train`"
        )
    if ps is None:
        ps = 0 if sync else default_num_ps(world_size)
    if sync and (ps == 0 or ps == []):
        return Layout(world_size, ())
    if ps == PER_NODE:
        ps = sorted(set(nodes or [0] * world_size))
        if len(ps) >= world_size:
            raise ConfigError(
                f'{source}: ps = "per_node" leaves no worker: every one of '
                f"the {len(ps)} nodes runs a single rank"
            )
    if isinstance(ps, bool) or not isinstance(ps, (int, list)):
        raise ConfigError(
            f'{source}: ps must be a count, a list of ranks or "per_node", got {ps!r}'
        )
    if isinstance(ps, int):
        if not 1 <= ps < world_size:
            raise ConfigError(
                f"{source}: ps = {ps} needs 1 <= ps < world size {world_size} (at least one worker)"
            )
        return Layout(world_size, tuple(range(ps)))
    return Layout(world_size, _listed_ps(ps, world_size, source))


def _listed_ps(ps: list[Any], world_size: int, source: str) -> tuple[int, ...]:
    """The PS ranks ``ps = [...]`` lists, checked: distinct ranks of the world, and not
    every one of them (ConfigError naming the first that is not, from ``source``)."""
    if not ps:
        raise ConfigError(f"{source}: ps = [] names no PS rank")
    bad = [r for r in ps if isinstance(r, bool) or not isinstance(r, int)]
    if bad:
        raise ConfigError(f"{source}: ps ranks must be integers, got {bad[0]!r}")
    out = [r for r in ps if not 0 <= r < world_size]
    if out:
        raise ConfigError(
            f"{source}: ps rank {out[0]} is out of range for "
            f"{world_size} ranks (0..{world_size - 1})"
        )
    dups = sorted({r for r in ps if ps.count(r) > 1})
    if dups:
        raise ConfigError(f"{source}: ps rank {dups[0]} is listed more than once")
    if len(ps) >= world_size:
        raise ConfigError(f"{source}: every rank is a PS; at least one worker is needed")
    return tuple(ps)


LAYOUT_KEYS = ("ps", "world_size")


def read_layout_file(path: str | Path) -> dict[str, Any]:
    """Parse a rank-layout TOML file (``ps = 2`` or ``ps = [0, 4]``, optional ``world_size``)."""
    text = read_text(path, ConfigError, f"layout file {path}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"layout file {path}: invalid TOML: {e}") from None
    check_keys(data, LAYOUT_KEYS, f"layout file {path}")
    _check_layout_types(data, f"layout file {path}")
    return data


def _check_layout_types(data: dict[str, Any], where: str) -> None:
    """ConfigError naming ``where`` and the key unless ``ps`` is a count, a list of ranks or
    "per_node" and ``world_size`` a positive integer, as a job's [layout] table is checked:
    unchecked, ``world_size = "2"`` was refused as "2, but the job runs on 2 ranks"."""
    check_ps(data.get("ps"), f"{where}: ps")
    size = data.get("world_size")
    if size is not None and not is_int(size):
        raise ConfigError(f"{where}: world_size: expected an integer, got {size!r}")
    if size is not None and not 1 <= size <= MAX_WORLD_SIZE:
        raise ConfigError(f"{where}: world_size: must be in 1..{MAX_WORLD_SIZE}, got {size}")
