"""Jobs on two nodes of this machine (conftest's ``nodes=``: MPICH's ssh launcher through
tests/fake_ssh): ranks on different nodes share no memory and talk over TCP, so mpips'
multi-node code paths run for real. Each mode equals its one-process reference across
nodes; checkpoints move between node layouts; a preempted node stops the job with a
checkpoint; a rank killed outright on the other node is named; what needs one node is
refused; and where the PS tasks run across nodes is shown and checked."""

import json
import os
import re
import shutil
import signal
import time

import pytest
from conftest import RESULT, ROOT, BackgroundJob, read_result, run_mpi, run_train
from test_hybrid import CRC as HYBRID_CRC
from test_hybrid import assert_close, hybrid_job, lockstep
from test_optimizers_mpi import write_job as async_job
from test_sync_mpi import CRC, SAYS, assert_one_process
from test_sync_mpi import write_job as sync_job
from test_train_mpi import DIED, PROMPT
from test_zero_copy import assert_reference, zero_copy_job

from mpips.checkpoint import Checkpoint
from mpips.cli import main
from mpips.placement.layout import block_nodes, node_indices, ps_imbalance

launcher = pytest.mark.launcher
TWO = (2, 2)  # ranks per node: 2 + 2
DIED_AT = re.compile(DIED.pattern + r" at ([\d:.]+):")  # rank, task, pid, when
STARTED = re.compile(r"\[(/job:\w+/task:\d+)\] rank (\d+), pid (\d+) on ")

PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
import mpips
import test_store_mpi as store
from mpips.store import allgather_json

with mpips.abort_on_error():
    s = store.Store()  # 1 ps + 3 workers
    seen = allgather_json(s.comm, dict(
        node_ranks=list(s.cluster.node_ranks),
        one_node=s.cluster.one_node,
        shared_counters=s.windows.control_shared,
        counters=type(s.control.counters).__name__,
    ))
    s.close()
    # the counters lose no step and stop exactly at the target, through what was chosen
    store.test_global_steps_are_unique_and_gapless()
    store.test_tickets_stop_exactly_at_target()
    if s.comm.rank == 0:
        print("PROBE " + json.dumps(seen))
"""


@launcher
def test_a_node_is_what_mpi_says_and_the_counters_are_mpi_atomics_across(tmp_path):
    """Each rank sees the ranks of its own node. The job's control counters are node-shared
    memory moved with the CPU's atomics only when every rank shares one node
    (test_store_mpi.py checks that case); across nodes they are MPI atomics, and there
    they count every step once and stop exactly at the target."""
    (tmp_path / "probe.py").write_text(PROBE.format(tests=str(ROOT / "tests")))
    r = run_mpi(4, ["probe.py"], tmp_path, nodes=TWO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    seen = json.loads(r.stdout.split("PROBE ", 1)[1].splitlines()[0])
    assert [s["node_ranks"] for s in seen] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert not any(s["one_node"] or s["shared_counters"] for s in seen), seen
    assert {s["counters"] for s in seen} == {"_MpiCounters"}


@launcher
def test_one_async_worker_on_the_other_node_equals_one_process(tmp_path):
    """The PS on one node, the worker on the other: SGD through MPI's accumulates, which
    move across nodes only while the PS is inside MPI. (Adam, applied by the PS tasks: the
    checkpoint test below.)"""
    job = async_job(tmp_path, "sgd", 30)
    r = run_mpi(2, ["-m", "mpips", "train", "job.toml"], tmp_path, nodes=(1, 1))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_reference(tmp_path / "runs/ckpt/ckpt-30.json", job, 30)


@launcher
def test_sync_replicas_on_two_nodes_exchange_messages_and_equal_one_process(tmp_path):
    """4 replicas, 2 per node: not one node's shared memory, messages (Ireduce_scatter and
    Iallgatherv) over both nodes; bitwise identical replicas equal to one process with 4x
    the batch (variables and Adam's slots)."""
    job = sync_job(tmp_path, "adam")
    r = run_train(tmp_path, 4, "job.toml", nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(SAYS["messages"]) == 4, r.stdout[-3000:]
    assert len({crc for _, crc in CRC.findall(r.stdout)}) == 1
    assert r.result["global_step"] == 20
    assert assert_one_process(tmp_path, job, 4) == [20] * 4


@launcher
def test_sync_replicas_mode_through_a_ps_on_two_nodes_equals_one_process(tmp_path):
    """train.mode = "sync_replicas" (no backup worker): 1 PS + 3 workers over 2 + 2 ranks
    aggregates every gradient, as one process with 3x the batch."""
    job = sync_job(tmp_path, "adam")
    text = (tmp_path / "job.toml").read_text()
    text = text.replace('mode = "sync"', 'mode = "sync_replicas"')
    text = re.sub(r"(check_every|bucket_bytes) = .*\n", "", text)  # allreduce sync's own
    (tmp_path / "job.toml").write_text(text)
    r = run_train(tmp_path, 4, "job.toml", nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.result["global_step"] == 20
    assert_one_process(tmp_path, job, 3)


@launcher
def test_hybrid_on_two_nodes_equals_lockstep(tmp_path):
    """A PS task and a worker on each node: the dense replicas are reduced across nodes and
    stay bit for bit the same; the tables (on both nodes' PS tasks) follow the reference."""
    job = hybrid_job(tmp_path, "wide_deep", "sgd", 0.5, 16)
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "0,2"], tmp_path, nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    crcs = HYBRID_CRC.findall(r.stdout)
    assert len(crcs) == 2 and crcs[0] == crcs[1], r.stdout[-2000:]
    variables, _ = Checkpoint(tmp_path / "runs/s/ckpt-16.json").read_all()
    assert_close(variables, lockstep(job, 16, 2))


@launcher
def test_a_checkpoint_from_two_nodes_resumes_on_one_node_and_on_three_per_node(tmp_path):
    """10 steps of one async worker on 2 + 2 ranks (3 PS tasks over both nodes), then on to
    20 on one node (1 PS) and, from the same checkpoint, on 3 + 3 ranks (5 PS tasks): both
    equal 20 steps of one process, bit for bit (variables and Adam's slots)."""
    async_job(tmp_path, "adam", 10, "runs/two")
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "3"], tmp_path, nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Checkpoint(tmp_path / "runs/two/ckpt-10.json").num_shards == 3
    shutil.copytree(tmp_path / "runs/two", tmp_path / "runs/three")
    for ckpt, ranks, nodes, ps in (("two", 2, None, "1"), ("three", 6, (3, 3), "5")):
        job = async_job(tmp_path, "adam", 20, f"runs/{ckpt}")
        r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml", "--ps", ps], tmp_path, nodes=nodes)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "restored global_step 10" in r.stdout, r.stdout[-2000:]
        assert_reference(tmp_path / f"runs/{ckpt}/ckpt-20.json", job, 20)


def started(job: BackgroundJob, ranks: int) -> dict[int, tuple[str, int]]:
    """Each rank's (task, pid), from the start-up lines (the job runs verbose)."""
    job.wait_for(r"saved checkpoint")  # training is under way, a checkpoint behind it
    found = {int(rank): (task, int(pid)) for task, rank, pid in STARTED.findall(job.text())}
    assert sorted(found) == list(range(ranks)), job.text()[-3000:]
    return found


@launcher
def test_preempting_one_node_stops_the_job_with_a_checkpoint(tmp_path):
    """SIGTERM to both ranks of the second node (two of the three workers), as a scheduler
    reclaiming that node does: the job stops with exit 3 and a checkpoint."""
    job = BackgroundJob(tmp_path, 4, "--steps", str(10**9), "--result", RESULT, nodes=TWO)
    ranks = started(job, 4)
    t0 = time.monotonic()
    for rank in (2, 3):  # node 1
        os.kill(ranks[rank][1], signal.SIGTERM)
    assert job.end(PROMPT) == 3, job.text()[-3000:]
    assert time.monotonic() - t0 < PROMPT
    res = read_result(tmp_path)
    assert res and res["stopped_by"] == "SIGTERM", job.text()[-3000:]
    step = res["global_step"]
    said = f"stopped early by SIGTERM: checkpoint at global_step {step} in runs/default"
    assert said in job.text()
    assert (tmp_path / f"runs/default/ckpt-{step}.json").exists()


@launcher
def test_kill_9_of_a_rank_on_the_other_node_ends_the_job_naming_it(tmp_path):
    """Rank 3 (node 1, beside rank 2) killed outright: node 1's watcher names it, once,
    with the earliest time, and the job ends promptly. (A rank of the other node may fail in
    MPI's network layer on finding its peer gone before the launcher ends it; its watcher
    then names it too, with a later time: each node's watcher prints its own verdict, so
    the order of the lines is not the order of the deaths, the times are.)"""
    job = BackgroundJob(tmp_path, 4, "--steps", str(10**9), nodes=TWO)
    ranks = started(job, 4)
    task, pid = ranks[3]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert job.end(PROMPT) != 0
    assert time.monotonic() - t0 < PROMPT
    named = sorted((at, who) for *who, at in DIED_AT.findall(job.text()))
    assert [tuple(who) for _, who in named[:1]] == [("3", task, str(pid))], job.text()[-3000:]
    assert [tuple(who) for _, who in named].count(("3", task, str(pid))) == 1, job.text()


@launcher
def test_zero_copy_is_refused_across_nodes(tmp_path):
    zero_copy_job(tmp_path, "sgd", 10)
    r = run_train(tmp_path, 4, "job.toml", nodes=TWO)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "train.zero_copy: every rank must run on one node" in r.stderr
    assert "this job has 2 of its 4 ranks here" in r.stderr
    assert r.stderr.count("every rank must run on one node") == 1  # said once


@launcher
def test_ps_per_node_puts_one_ps_task_on_each_node(tmp_path):
    r = run_train(tmp_path, 4, "--steps", "30", "--ps", "per_node", nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    tasks = {int(rank): task for task, rank, _ in STARTED.findall(r.stdout)}
    assert [tasks[r] for r in (0, 2)] == ["/job:ps/task:0", "/job:ps/task:1"], tasks
    nodes = dict(re.findall(r"rank (\d+), pid \d+ on \S+, node (\d) of 2$", r.stdout, re.M))
    assert nodes == {"0": "0", "1": "0", "2": "1", "3": "1"}, r.stdout[-3000:]
    assert sum(t.startswith("/job:ps") for t in tasks.values()) == 2
    assert r.result["global_step"] == 30
    assert "warning: all" not in r.stdout + r.stderr


@launcher
def test_every_ps_task_on_one_node_is_warned_once_at_start_up(tmp_path):
    r = run_train(tmp_path, 4, "--steps", "10", "--ps", "2", nodes=TWO)
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert said.count("warning: all 2 ps tasks run on node 0 (ranks 0-1) of 2 nodes") == 1, said


def test_ps_imbalance_names_the_node_that_holds_every_ps_task():
    two = block_nodes(8, 2)  # ranks 0-3 on node 0, 4-7 on node 1
    said = ps_imbalance([0, 1], two)
    assert said and said.startswith("all 2 ps tasks run on node 0 (ranks 0-3) of 2 nodes")
    assert 'ps = "per_node"' in said
    assert ps_imbalance([5, 7], two).startswith("all 2 ps tasks run on node 1 (ranks 4-7)")
    assert "(ranks 0,2)" in ps_imbalance([0, 2], [0, 1, 0, 1])  # nodes interleaved
    assert ps_imbalance([0, 4], two) is None  # one on each node
    assert ps_imbalance([0], two) is None  # one PS task is on one node by necessity
    assert ps_imbalance([0, 1], [0] * 8) is None  # one node
    assert ps_imbalance([], two) is None  # sync mode without PS
    assert node_indices([0, 0, 3, 3, 3, 5]) == [0, 0, 1, 1, 1, 2]


def test_layout_shows_each_ranks_node_and_warns_of_ps_tasks_on_one_node(capsys):
    assert main(["layout", "-n", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 8 ranks on 2 nodes: 2 ps, 6 workers" in out
    rows = re.findall(r"^ +(\d+) +(\d+)  (/job:\S+)", out, re.M)
    assert [(int(r), int(n)) for r, n, _ in rows] == [(r, r // 4) for r in range(8)]
    assert out.count("warning: all 2 ps tasks run on node 0 (ranks 0-3) of 2 nodes") == 1
    assert main(["layout", "-n", "8", "--nodes", "2", "--ps", "per_node"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +4 +1  /job:ps/task:1$", out, re.M) and "warning" not in out
    assert main(["layout", "-n", "8"]) == 0  # one node: no node column
    out = capsys.readouterr().out
    table = out.split("\nplacement")[0]  # (the pulls line below may say "one node")
    assert "rank  task" in table and "node" not in table


def test_layout_of_a_sync_job_on_two_nodes_says_nothing_of_ps_tasks(tmp_path, capsys):
    """Sync mode's PS tasks (if any) hold nothing: where they run is no imbalance."""
    job = tmp_path / "sync.toml"
    job.write_text('[data]\nbuiltin = "digits"\n[train]\nmode = "sync"\nsteps = 10\n')
    assert main(["layout", str(job), "-n", "8", "--nodes", "2", "--ps", "2"]) == 0
    out = capsys.readouterr().out
    assert "ps task(s) hold nothing" in out and "warning" not in out
