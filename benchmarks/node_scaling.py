"""One node used whole (issue 31): the reference workload's examples/s from one process up to
1 PS + 8 workers and 8 sync replicas, measured from outside by the wall clock.

Run:  python benchmarks/node_scaling.py [--json node_scaling.json] [--budget 270]
      [--seconds 3] [--quick] [--no-phases]

MLP 784-512-512-10, batch 128 per worker, SGD lr 0.05, on the synthetic set (X ~ N(0,1),
labels argmax(X @ W)); no checkpoints, ``--no-restore``. Each configuration runs twice with
different ``train.steps`` and everything else equal; its rate is the extra examples over the
extra wall seconds (start-up, data loading and the final evaluation cancel out), and the
configurations are interleaved round by round. Each rank's BLAS threads are set by the
script (MPIPS_BLAS_THREADS, one value per group of ranks on mpiexec's command line), to the
shares of ``mpips.device.threads.node_blas_threads``: a PS task 1, its workers the other cores.

The configurations scale to the machine (os.cpu_count()): the goal layout is 1 PS + W
workers with W the largest of 1, 2, 4, 8 for which W + 1 ranks fit the cores; "one worker
alone" is 1 PS + 1 worker with the threads a worker gets in that layout, and the limit of a
configuration of N workers or replicas is N x that rate. Async layouts with 2, 4, 8 workers
and sync with 2 and 8 replicas run when they fit (an async one whose PS has no core of its
own is run and flagged); the others are listed as skipped. With 5 cores or more it also runs
the experiment on why 4 workers gained little over 2 (docs/scaling.md): 2 and 4 workers
with the old even split (cores // ranks each) and 4 workers with 1 thread each, against one
worker alone with those threads. Every MPI configuration also gets one run with the job's
timeline on (its own run: the timeline costs a few percent), giving each phase's ms per
step. A run's CPU seconds (its processes, from getrusage) give the cores it kept busy, and
/proc/stat the CPU that other processes used meanwhile (flagged above 0.3 cores).

Budget: a round starts only while the last one's time still fits in ``--budget`` seconds
(the first always runs); the timeline runs come after the second round, or at the end if
half a round still fits. Sized for a 16-core node in under 5 minutes (13 configurations, 2
rounds and the timeline runs if a run starts in ~2 s; an estimate, not yet measured there).
The JSON (written after every round) holds the machine, every run and the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import DEFAULT_DATA, mpiexec, reference_data

from mpips.device.threads import BLAS_THREADS_ENV, node_blas_threads

ZERO_COPY = "false"  # async: copied pulls, as the recorded figures (--zero-copy: in place)
JOB = """
name = "node-scaling"
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
kind = "sgd"
learning_rate = 0.05
[train]
mode = "{mode}"
steps = 100  # each run sets its own (--steps)
batch_size = 128
log_every = 0
progress = false
zero_copy = {zero_copy}
[layout]
ps = {ps}
[summary]
dir = "{summary_dir}"
every_steps = 0
timeline = {timeline}
"""
BATCH = 128
GUESS_PER_WORKER = 20_000  # examples/s a worker is assumed to reach in the first round
SHORT_SECONDS = 0.4  # of training in the shorter run of a pair
PHASE_SECONDS = 1.5  # of training in the timeline run
OTHER_LOAD_FLAG = 0.3  # cores used by other processes during a pair that flag it


@dataclass
class Config:
    key: str
    label: str
    mode: str  # "one", "async" or "sync"
    ps: int
    workers: int  # async workers or sync replicas (1 for one process)
    threads: list[int]  # BLAS threads of each rank, in rank order (PS tasks first)
    diagnostic: bool = False
    note: str = ""
    guess: float = 0.0  # examples/s used to size the next round's runs
    runs: list[dict] = field(default_factory=list)
    phases: dict = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return self.ps + self.workers

    @property
    def worker_threads(self) -> list[int]:
        return self.threads[self.ps :]

    def examples_per_step(self) -> int:
        return BATCH * (self.workers if self.mode == "sync" else 1)


def goal_workers(cores: int) -> int:
    """The largest of 1, 2, 4, 8 workers that fit the cores with their PS task."""
    return max(w for w in (1, 2, 4, 8) if w + 1 <= max(cores, 2))


def plan(cores: int, diagnose: bool) -> tuple[list[Config], list[str], int, int]:
    """The configurations this machine runs, the ones skipped (why), the goal layout's
    workers and the BLAS threads of one worker in it."""
    w_goal = goal_workers(cores)
    t_goal = node_blas_threads(cores, w_goal + 1, 1)[1]  # the first (largest) worker share
    configs = [
        Config("one", f"one process ({cores} threads)", "one", 0, 1, [cores]),
        Config("lone", f"1 PS + 1 worker alone ({t_goal} thr)", "async", 1, 1, [1, t_goal]),
    ]
    skipped = []
    for w in (2, 4, 8):
        shares = node_blas_threads(cores, w + 1, 1)
        label = f"async 1 PS + {w} workers"
        if w + 1 <= cores:
            configs.append(Config(f"async{w}", label, "async", 1, w, shares))
        elif w <= cores:
            configs.append(
                Config(f"async{w}", label, "async", 1, w, shares, note="PS shares a core")
            )
        else:
            skipped.append(f"{label}: {w + 1} ranks on {cores} cores")
    for r in (2, 8):
        label = f"sync {r} replicas"
        if r <= cores:
            configs.append(Config(f"sync{r}", label, "sync", 0, r, node_blas_threads(cores, r)))
        else:
            skipped.append(f"{label}: {r} ranks on {cores} cores")
    if diagnose and cores >= 5:  # why 4 workers gained little over 2 (docs/scaling.md)
        even4, even2 = max(1, cores // 5), max(1, cores // 3)
        for t in sorted({1, even4, even2} - {t_goal}):
            configs.append(
                Config(
                    f"lone{t}",
                    f"1 PS + 1 worker alone ({t} thr)",
                    "async",
                    1,
                    1,
                    [1, t],
                    diagnostic=True,
                )
            )
        runs = {(4, 1): ""} | {(2, even2): "old even split", (4, even4): "old even split"}
        for (w, t), why in runs.items():
            configs.append(
                Config(
                    f"async{w}x{t}",
                    f"async 1 PS + {w} workers, {t} thr each",
                    "async",
                    1,
                    w,
                    [1] + [t] * w,
                    diagnostic=True,
                    note=why,
                )
            )
    elif diagnose:
        skipped.append("the 2-vs-4-workers experiment: needs 5 cores (1 PS + 4 workers)")
    for c in configs:
        c.guess = GUESS_PER_WORKER * (1 if c.mode == "one" else min(c.workers, cores))
    return configs, skipped, w_goal, t_goal


def busy_cores_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (None off Linux)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def command(c: Config, job: Path, steps: int, result: Path) -> list[str]:
    """The run's command line: one process alone, else mpiexec with one segment per group
    of ranks that share a thread count (ranks keep their order: PS tasks first)."""
    train = [sys.executable, "-m", "mpips", "train", str(job), "--steps", str(steps)]
    train += ["--no-restore", "--no-progress", "--result", str(result)]
    if c.mode == "one":
        return train
    cmd = [mpiexec()]
    groups: list[list[int]] = []
    for t in c.threads:
        if groups and groups[-1][0] == t:
            groups[-1][1] += 1
        else:
            groups.append([t, 1])
    for i, (t, n) in enumerate(groups):
        cmd += [":"] if i else []
        cmd += ["-n", str(n), "-env", BLAS_THREADS_ENV, str(t), *train]
    return cmd


def run_once(c: Config, job: Path, steps: int, workdir: Path) -> dict:
    """One run: wall seconds, the examples its chief counted, CPU seconds of its processes
    and of the machine."""
    result = workdir / f"result-{c.key}.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, MPIPS_VERBOSE="0")
    if c.mode == "one":
        env[BLAS_THREADS_ENV] = str(c.threads[0])
    else:
        env.pop(BLAS_THREADS_ENV, None)
    cpu0, busy0, t0 = children_cpu(), busy_cores_seconds(), time.perf_counter()
    try:
        p = subprocess.run(
            command(c, job, steps, result),
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        failed = p.returncode != 0 or not result.exists()
        output = (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        failed, output = True, f"timed out after {e.timeout} s"
    wall = time.perf_counter() - t0
    busy1 = busy_cores_seconds()
    run = {
        "steps": steps,
        "wall_s": wall,
        "cpu_s": children_cpu() - cpu0,
        "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
    }
    if failed:
        print(f"  {c.label}: run of {steps} steps failed:\n{output}", flush=True)
        return {**run, "failed": True}
    got = json.loads(result.read_text())
    run["examples"] = got["total_examples"]
    if got.get("seconds"):  # the job's own loop time: a first guess at its rate
        run["own_rate"] = got["total_examples"] / got["seconds"]
    return run


def pair(c: Config, job: Path, extra_seconds: float, rnd: int, workdir: Path) -> dict:
    """Two runs differing only in train.steps; the rate from their difference. In the
    first round the shorter run goes first and the job's own rate in it sizes the longer."""
    per_step = c.examples_per_step()
    short = max(10, round(c.guess * SHORT_SECONDS / per_step))
    runs = {}
    if rnd == 0:
        runs[short] = run_once(c, job, short, workdir)
        own = runs[short].get("own_rate")
        c.guess = own if own else c.guess
    long = short + max(20, round(c.guess * extra_seconds / per_step))
    order = (short, long) if rnd % 2 == 0 else (long, short)
    for steps in order:
        if steps not in runs:
            runs[steps] = run_once(c, job, steps, workdir)
    a, b = runs[short], runs[long]
    out: dict = {"round": rnd, "short": a, "long": b}
    if a.get("failed") or b.get("failed"):
        return {**out, "failed": True}
    dw = b["wall_s"] - a["wall_s"]
    dx = b["examples"] - a["examples"]
    out["extra_s"] = dw
    if dw <= 0.5:  # too short to mean anything (a run's start-up varies by ~0.5 s)
        return {**out, "failed": True, "why": f"extra wall {dw:.2f} s"}
    out["rate"] = dx / dw
    out["cores_busy"] = (b["cpu_s"] - a["cpu_s"]) / dw
    if a["machine_busy_s"] is not None and b["machine_busy_s"] is not None:
        total = a["machine_busy_s"] + b["machine_busy_s"]
        out["other_load"] = (total - a["cpu_s"] - b["cpu_s"]) / (a["wall_s"] + b["wall_s"])
    return out


def phases(c: Config, data: str, tmp: Path) -> dict:
    """ms per step of each phase (the job's timeline; the first 10% of each worker's steps
    left out): the mean over workers, and each worker's compute."""
    folder = tmp / f"timeline-{c.key}"
    job = tmp / f"timeline-{c.key}.toml"
    job.write_text(
        JOB.format(
            data=data,
            mode=c.mode,
            ps=c.ps,
            summary_dir=folder,
            timeline="true",
            zero_copy=ZERO_COPY if c.mode == "async" else "false",
        )
    )
    steps = max(20, round(c.guess * PHASE_SECONDS / c.examples_per_step()))
    if run_once(c, job, steps, tmp).get("failed"):
        return {}
    per_worker: dict[str, list[float]] = {}
    for path in sorted((folder / "timeline").glob("worker-*.json")):
        by_name: dict[str, list[float]] = {}
        for e in json.loads(path.read_text())["traceEvents"]:
            if e.get("ph") == "X":
                by_name.setdefault(e["name"], []).append(e["dur"] / 1000)
        for name, durs in by_name.items():
            kept = durs[len(durs) // 10 :]
            per_worker.setdefault(name, []).append(statistics.fmean(kept))
    if not per_worker:
        return {}
    ms = {n: statistics.fmean(v) for n, v in per_worker.items()}
    return {
        "ms_per_step": ms,
        "compute_ms_each_worker": per_worker.get("compute", []),
        "loop_rate": c.workers * BATCH / sum(ms.values()) * 1000,
    }


def machine(cores: int) -> dict:
    """What the numbers were measured on."""
    info: dict = {"cores": cores, "os_cpu_count": os.cpu_count()}
    info["python"] = platform.python_version()
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("model name")),
            platform.processor(),
        )
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text()
        info["threads_per_core"] = len(expand(siblings.strip()))
    except (OSError, StopIteration):
        pass
    try:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            {k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
            for i in threadpool_info()
        ]
    except ImportError:
        pass
    import mpi4py
    import numpy

    info["numpy"], info["mpi4py"] = numpy.__version__, mpi4py.__version__
    repo = Path(__file__).resolve().parent.parent
    try:
        info["commit"] = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = "unknown"
    info["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
    return info


def expand(cpus: str) -> list[int]:
    """A kernel CPU list ("0,8" or "0-1") as numbers."""
    out = []
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def rates(c: Config) -> list[float]:
    return [r["rate"] for r in c.runs if "rate" in r]


def summary(configs: list[Config], w_goal: int, t_goal: int) -> list[dict]:
    """The table's rows: each configuration's median rate against its limits."""
    by_key = {c.key: c for c in configs}
    lone = statistics.median(rates(by_key["lone"])) if rates(by_key["lone"]) else None
    rows = []
    for c in configs:
        got = rates(c)
        row: dict = {"key": c.key, "label": c.label, "ranks": c.ranks, "ps": c.ps}
        row["threads"] = c.threads
        row["note"] = c.note
        row["rounds"] = len(got)
        if not got:
            rows.append(row)
            continue
        med = statistics.median(got)
        row.update(rate=med, low=min(got), high=max(got))
        busy = [r["cores_busy"] for r in c.runs if "cores_busy" in r]
        other = [r["other_load"] for r in c.runs if "other_load" in r]
        row["cores_busy"] = statistics.median(busy) if busy else None
        row["other_load_max"] = max(other) if other else None
        if lone and c.mode != "one":
            row["vs_n_lone"] = med / (c.workers * lone)  # N x one worker alone (t_goal threads)
        if c.mode != "one" and c.key != "lone":
            same = lone_with(configs, c.worker_threads)
            if same:
                row["vs_n_lone_same_threads"] = med / (c.workers * same)
        rows.append(row)
    return rows


def lone_with(configs: list[Config], threads: list[int]) -> float | None:
    """One worker alone's median rate with the threads most of these workers have."""
    t = max(set(threads), key=lambda v: (threads.count(v), v))
    for c in configs:
        if c.mode == "async" and c.workers == 1 and c.worker_threads == [t] and rates(c):
            return statistics.median(rates(c))
    return None


def print_table(rows: list[dict], w_goal: int, t_goal: int, skipped: list[str]) -> None:
    print(
        f"\n{'configuration':<40} {'ranks':>5} {'BLAS threads (ps | workers)':<28} "
        f"{'examples/s median (range)':<28} {'n':>2} {'busy':>5} {'vs N x lone':>11} "
        f"{'same thr':>8}"
    )
    for r in rows:
        th = r["threads"]
        ps = r["ps"]
        shown = " ".join(map(str, th[ps:])) if len(th) <= 9 else f"{th[ps]}..."
        threads = (f"{th[0]} | " if ps else "  | ") + shown
        if "rate" not in r:
            print(f"{r['label']:<40} {r['ranks']:>5} {threads:<28} {'(no valid run)':<28}")
            continue
        rng = f"{r['rate'] / 1e3:.1f}k ({r['low'] / 1e3:.1f}-{r['high'] / 1e3:.1f}k)"
        vs = f"{r['vs_n_lone']:.2f}" if "vs_n_lone" in r else "-"
        same = f"{r['vs_n_lone_same_threads']:.2f}" if "vs_n_lone_same_threads" in r else "-"
        busy = f"{r['cores_busy']:.1f}" if r.get("cores_busy") is not None else "-"
        flag = ""
        if r.get("other_load_max") is not None and r["other_load_max"] > OTHER_LOAD_FLAG:
            flag += f" * other load {r['other_load_max']:.1f} cores"
        if r["note"]:
            flag += f" ({r['note']})"
        print(
            f"{r['label']:<40} {r['ranks']:>5} {threads:<28} {rng:<28} {r['rounds']:>2} "
            f"{busy:>5} {vs:>11} {same:>8}{flag}"
        )
    print(
        f"vs N x lone: the rate over N (workers or replicas) x one worker alone with {t_goal} "
        f"thread(s), the threads a worker gets in the goal layout (1 PS + {w_goal}); same thr: "
        f"over N x one worker alone with these workers' threads; busy: cores the job kept "
        f"busy (its CPU seconds over wall seconds, from the runs' difference)"
    )
    for s in skipped:
        print(f"skipped: {s}")
    for r in rows:
        if r["key"] in (f"async{w_goal}", "sync8") and "vs_n_lone" in r and r["ranks"] > 2:
            ok = "met" if r["vs_n_lone"] >= 0.75 else "NOT met"
            print(f"goal {r['label']} >= 0.75 x N x lone: {r['vs_n_lone']:.2f}, {ok}")
    if w_goal < 8:
        print(
            f"this machine fits 1 PS + {w_goal} worker(s), not the goal's 1 PS + 8: the goal "
            f"is judged on a node with at least 9 cores (16 in issue 31)"
        )


def print_phases(configs: list[Config]) -> None:
    shown = [c for c in configs if c.phases.get("ms_per_step")]
    if not shown:
        return
    print(
        "\nms per step of each phase (timeline run; mean over workers; compute: each worker;"
        " loop rate: N x batch / the phases' sum, the job's inside view)"
    )
    for c in shown:
        ph = c.phases["ms_per_step"]
        parts = ", ".join(f"{n} {v:.2f}" for n, v in ph.items())
        each = " ".join(f"{v:.2f}" for v in c.phases["compute_ms_each_worker"])
        loop = c.phases["loop_rate"]
        print(f"  {c.label:<40} {parts}; compute each: {each}; loop rate {loop / 1e3:.1f}k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="node_scaling.json", help="where to write the results")
    ap.add_argument("--budget", type=float, default=270, help="seconds for the whole script")
    ap.add_argument("--seconds", type=float, default=3.0, help="extra training in a long run")
    ap.add_argument("--rounds", type=int, default=3, help="most rounds (at least 1)")
    ap.add_argument("--cores", type=int, default=0, help="cores to plan for (0: this machine)")
    ap.add_argument("--quick", action="store_true", help="no 2-vs-4-workers experiment")
    ap.add_argument("--no-phases", action="store_true", help="no timeline runs")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="async with zero copy (the default on one node) instead of copied pulls",
    )
    args = ap.parse_args()
    global ZERO_COPY
    ZERO_COPY = "true" if args.zero_copy else "false"
    start = time.perf_counter()
    cores = args.cores or os.cpu_count() or 1
    reference_data(args.data)
    configs, skipped, w_goal, t_goal = plan(cores, not args.quick)
    info = machine(cores)
    print(
        f"{cores} cores ({info.get('cpu', '?')}, {info.get('threads_per_core', '?')} "
        f"thread(s) a core), commit {info['commit']}: goal layout 1 PS + {w_goal} "
        f"worker(s), {t_goal} BLAS thread(s) a worker; {len(configs)} configurations",
        flush=True,
    )
    for s in skipped:
        print(f"skipped: {s}")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        jobs = {}
        for mode, ps in (("one", 0), ("async", 1), ("sync", 0)):
            jobs[mode] = tmp / f"{mode}.toml"
            text = JOB.format(
                data=args.data,
                mode="async" if mode == "one" else mode,
                ps=ps,
                summary_dir="",
                timeline="false",
                zero_copy=ZERO_COPY if mode == "async" else "false",
            )
            jobs[mode].write_text(text)

        def write() -> None:
            rows = summary(configs, w_goal, t_goal)
            out = {"machine": info, "goal_workers": w_goal, "goal_threads": t_goal}
            out |= {"skipped": skipped, "table": rows, "configs": [asdict(c) for c in configs]}
            Path(args.json).write_text(json.dumps(out, indent=1))

        def timeline_runs() -> None:
            print("timeline runs ...", flush=True)
            for c in configs:
                if c.mode != "one":
                    c.phases = phases(c, args.data, tmp)

        rnd, round_s, phases_done = 0, 0.0, args.no_phases
        while rnd < max(1, args.rounds):
            if rnd >= 1 and time.perf_counter() - start + round_s > args.budget:
                break
            if rnd == 2 and not phases_done:  # after 2 rounds, before any more
                timeline_runs()
                phases_done = True
                if time.perf_counter() - start + round_s > args.budget:
                    break
            t0 = time.perf_counter()
            order = configs[rnd % len(configs) :] + configs[: rnd % len(configs)]
            for c in order:
                got = pair(c, jobs[c.mode], args.seconds, rnd, tmp)
                c.runs.append(got)
                if "rate" in got:
                    c.guess = got["rate"]
                elif "short" in got and not got["short"].get("failed"):
                    c.guess *= 2  # start-up noise beat the extra steps: run longer next time
                line = f"{got['rate']:9.0f} examples/s" if "rate" in got else "failed"
                line += f", extra {got.get('extra_s', 0):.1f} s"
                if got.get("other_load") is not None:
                    line += f", other load {got['other_load']:.2f} cores"
                print(f"round {rnd + 1}: {c.label:<40} {line}", flush=True)
            round_s = time.perf_counter() - t0
            rnd += 1
            write()
        if not phases_done and time.perf_counter() - start + round_s / 2 <= args.budget:
            timeline_runs()
        write()
    print_phases(configs)
    print_table(summary(configs, w_goal, t_goal), w_goal, t_goal, skipped)
    print(f"({time.perf_counter() - start:.0f} s; JSON: {args.json})")


if __name__ == "__main__":
    main()
