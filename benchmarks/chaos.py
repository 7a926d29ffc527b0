"""Chaos: kill -9 of a random rank at a random moment of a training run, in every mode, under
``python -m mpips.launch --restarts 2``; what the run does about it, measured.

Run:  python benchmarks/chaos.py [--trials 3] [--seed 0] [--only async,sync] [--victims far,node]

Each trial trains the digits job (MLP 64-64-10, checkpoint.every_secs = 1) to its step
target on 4 ranks (1 PS + 3 workers; sync mode: 3 replicas), waits for its first
checkpoint, sleeps a random 0-1.5 s, and kills one rank (or every rank of one of two
emulated nodes) with SIGKILL. A trial passes when the run ends with exit 0 at its target
within the deadline. Per trial it reports:

* how the run got there: ``in place`` (the victim's death cost its step; mpips.launch ran
  the command once) or ``restarts N`` (it ran again from the latest checkpoint);
* time to recover: from the kill to the line that says the run goes on (``lost rank ...``
  in place; ``restored global_step`` of the restarted run);
* work lost: in place, the dead worker's step in progress (one update); after a restart,
  the global steps between the checkpoint it resumed from and the last checkpoint committed
  before the kill (0 unless a newer one was committed and then lost), and the seconds of
  training between that checkpoint's commit and the kill (bounded by every_secs plus the
  commit's latency);
* test accuracy against an undisturbed run of the same job (made once per mode).

The deadline and the step targets are for 2 loaded cores; tests/test_chaos_mpi.py runs a
few trials of this harness in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import mpiexec

ROOT = Path(__file__).resolve().parents[1]
FAKE_SSH = ROOT / "tests" / "fake_ssh"
TWO_NODES = ("node", "far")  # the victims of runs on two emulated nodes
EVERY_SECS = 1.0
DEADLINE = 150.0  # seconds a trial may take, restarts included
# step targets: 4-10 s of training on 2 cores, so the kill (1-3 s in) lands mid-run
STEPS = {"async": 30000, "sync_replicas": 4000, "sync": 4000}
# (mode, victim): victim "worker" = a worker other than the chief, "chief", "ps",
# "replica" (sync mode: a rank that is not rank 0), "node" (the second of two emulated
# nodes: its ranks and its MPI proxy), "far" (a worker on the second of two emulated nodes)
CASES = [
    ("async", "worker"),
    ("async", "chief"),
    ("async", "ps"),
    ("async", "node"),
    ("async", "far"),
    ("sync_replicas", "worker"),
    ("sync_replicas", "far"),
    ("sync_replicas", "chief"),
    ("sync_replicas", "ps"),
    ("sync", "replica"),
]


@dataclass
class Outcome:
    """What one trial measured."""

    mode: str
    victim: str
    killed: list[str]  # the tasks killed
    code: int | None  # mpips.launch's exit code (None: the deadline passed)
    global_step: int | None
    target: int
    restarts: int
    recover_s: float | None  # kill -> the run goes on
    lost_steps: int | None  # after a restart: committed before the kill, not resumed from
    lost_s: float | None  # after a restart: training between the resumed checkpoint and the kill
    accuracy: float | None
    seconds: float
    output: str = field(repr=False, default="")

    @property
    def passed(self) -> bool:
        return self.code == 0 and self.global_step == self.target

    @property
    def how(self) -> str:
        return f"restarts {self.restarts}" if self.restarts else "in place"


def job_text(mode: str, steps: int) -> str:
    return (
        f'[data]\nbuiltin = "digits"\n[train]\nmode = "{mode}"\nsteps = {steps}\n'
        f'[checkpoint]\ndir = "ckpt"\nevery_secs = {EVERY_SECS}\n'
    )


def command(mode: str, victim: str, restarts: int = 2) -> list[str]:
    """mpips.launch over mpiexec: 4 ranks (sync: 3), on one node or on two emulated ones."""
    ranks = 3 if mode == "sync" else 4
    hosts: list[str] = []
    if victim in TWO_NODES:  # node0: the PS and the chief; node1: two workers
        hosts = ["-hosts", "node0:2,node1:2", "-launcher", "ssh", "-launcher-exec", str(FAKE_SSH)]
    return [
        sys.executable,
        "-m",
        "mpips.launch",
        "--restarts",
        str(restarts),
        mpiexec(),
        *hosts,
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpips",
        "train",
        "job.toml",
        "--no-progress",
        "--log-every",
        "0",
        "--result",
        "result.json",
    ]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["MPIPS_VERBOSE"] = "1"  # each rank's pid and host
    return env


START_LINE = re.compile(
    r"^\[(/job:\w+/task:\d+)\] rank (\d+), pid (\d+) on (\S+), node (\d+)", re.M
)


def victims(text: str, mode: str, victim: str, rng: random.Random) -> list[tuple[str, int]]:
    """(task, pid) of the rank(s) to kill, from the run's start-up lines; a node's: every
    rank on it, and then the MPI proxy that started them (a lost node takes it along)."""
    ranks = [(t, int(r), int(p), int(n)) for t, r, p, _, n in START_LINE.findall(text)]
    if victim == "node":
        lost = [(t, p) for t, _, p, n in ranks if n == 1]
        return lost + [("the MPI proxy of node1", node_proxy(lost[0][1]))]
    if victim == "far":
        return [rng.choice([(t, p) for t, _, p, n in ranks if n == 1])]
    if victim == "replica":
        pick = [(t, p) for t, r, p, _ in ranks if r != 0]
    elif victim == "chief":
        pick = [(t, p) for t, _, p, _ in ranks if t == "/job:worker/task:0"]
    elif victim == "ps":
        pick = [(t, p) for t, _, p, _ in ranks if t.startswith("/job:ps/")]
    else:
        pick = [(t, p) for t, _, p, _ in ranks if t.startswith("/job:worker/") and t[-2:] != ":0"]
    return [rng.choice(pick)]


def node_proxy(pid: int) -> int:
    """The MPI proxy (hydra_pmi_proxy) that started rank ``pid``: its supervisor's parent."""

    def parent(p: int) -> int:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])

    proxy = parent(parent(pid))
    name = Path(f"/proc/{proxy}/comm").read_text().strip()
    if not name.startswith("hydra_pmi_prox"):  # (comm is cut at 15 characters)
        raise RuntimeError(f"the rank's grandparent {proxy} is {name!r}, not MPICH's proxy")
    return proxy


def expected_ranks(mode: str) -> int:
    return 3 if mode == "sync" else 4


class Watch:
    """The run's output file, read as it grows; when each pattern first appeared."""

    def __init__(self, path: Path):
        self.path, self.seen = path, {}

    def text(self) -> str:
        return self.path.read_text() if self.path.exists() else ""

    def first(self, pattern: str) -> float | None:
        if pattern not in self.seen and re.search(pattern, self.text(), re.M):
            self.seen[pattern] = time.monotonic()
        return self.seen.get(pattern)


def committed(folder: Path) -> list[tuple[int, float]]:
    """(step, commit time) of each checkpoint manifest in ``folder``."""
    out = []
    for manifest in folder.glob("ckpt-*.json"):
        m = re.fullmatch(r"ckpt-(\d+)\.json", manifest.name)
        if m:
            out.append((int(m.group(1)), manifest.stat().st_mtime))
    return sorted(out)


def trial(workdir: Path, mode: str, victim: str, seed: int, deadline: float = DEADLINE) -> Outcome:
    """One trial (see the module's docstring) in ``workdir`` (made empty by the caller)."""
    rng = random.Random(seed)
    steps = STEPS[mode]
    (workdir / "job.toml").write_text(job_text(mode, steps))
    log = workdir / "out.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(mode, victim),
            cwd=workdir,
            env=environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    watch = Watch(log)
    killed: list[str] = []
    t_kill = None
    before: list[tuple[int, float]] = []
    try:
        while time.monotonic() - t0 < deadline and proc.poll() is None:
            text = watch.text()
            if len(START_LINE.findall(text)) >= expected_ranks(mode) and watch.first(
                r"saved checkpoint"
            ):
                break
            time.sleep(0.05)
        if proc.poll() is None:
            time.sleep(rng.uniform(0.0, 1.5))
            before = committed(workdir / "ckpt")  # what a restart may resume from
            for task, pid in victims(watch.text(), mode, victim, rng):
                with contextlib.suppress(ProcessLookupError):  # (ended already: not killed)
                    os.kill(pid, signal.SIGKILL)
                    killed.append(task)
            t_kill = time.time()
            kill_mono = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < deadline:
            watch.first(r"lost rank \d+ .* the job goes on without it")
            watch.first(r"mpips\.launch: restart 1 of")
            watch.first(r"restored global_step \d+")
            time.sleep(0.05)
        code = proc.poll()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = watch.text()
    restarts = len(re.findall(r"^mpips\.launch: restart \d+ of", text, re.M))
    result = {}
    if (workdir / "result.json").exists():
        result = json.loads((workdir / "result.json").read_text())
    recover = lost_steps = lost_s = None
    if t_kill is not None:
        if restarts:
            after = text.split("mpips.launch: restart 1 of", 1)[1]
            m = re.search(r"restored global_step (\d+)", after)
            when = watch.seen.get(r"restored global_step \d+")
            if m:
                resumed = int(m.group(1))
                last = max((s for s, _ in before), default=0)
                lost_steps = max(last - resumed, 0)
                at = dict(before).get(resumed)
                lost_s = t_kill - at if at is not None else None
            if when is not None:
                recover = when - kill_mono
        else:
            when = watch.seen.get(r"lost rank \d+ .* the job goes on without it")
            recover = when - kill_mono if when is not None else None
    return Outcome(
        mode,
        victim,
        killed,
        code,
        result.get("global_step"),
        steps,
        restarts,
        recover,
        lost_steps,
        lost_s,
        result.get("test_accuracy"),
        time.monotonic() - t0,
        text,
    )


def undisturbed(workdir: Path, mode: str) -> float | None:
    """The test accuracy of the same job, nothing killed."""
    steps = STEPS[mode]
    (workdir / "job.toml").write_text(job_text(mode, steps))
    cmd = command(mode, "worker", restarts=0)
    r = subprocess.run(cmd, cwd=workdir, env=environment(), capture_output=True, timeout=DEADLINE)
    if r.returncode != 0:
        return None
    return json.loads((workdir / "result.json").read_text()).get("test_accuracy")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=3, help="trials per case (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="modes, comma-separated (default: all)")
    ap.add_argument("--victims", default="", help="victims, comma-separated (default: all)")
    args = ap.parse_args()
    modes = [m for m in args.only.split(",") if m]
    victims = [v for v in args.victims.split(",") if v]
    cases = [c for c in CASES if (not modes or c[0] in modes) and (not victims or c[1] in victims)]
    base: dict[str, float | None] = {}
    rows: list[Outcome] = []
    for mode in dict.fromkeys(m for m, _ in cases):
        with tempfile.TemporaryDirectory() as d:
            base[mode] = undisturbed(Path(d), mode)
        print(f"{mode}: undisturbed test accuracy {base[mode]}", flush=True)
    for i in range(args.trials):
        for k, (mode, victim) in enumerate(cases):
            with tempfile.TemporaryDirectory() as d:
                o = trial(Path(d), mode, victim, args.seed * 1000 + i * 100 + k)
            rows.append(o)
            print(
                f"{mode:>13} {victim:>7}: {'ok ' if o.passed else 'FAIL'} {o.how:>10}, "
                f"recover {fmt(o.recover_s)} s, lost {fmt(o.lost_steps)} steps / "
                f"{fmt(o.lost_s)} s, accuracy {fmt(o.accuracy, 4)}, {o.seconds:.1f} s "
                f"(killed {', '.join(o.killed)}; exit {o.code})",
                flush=True,
            )
            if not o.passed:
                print(o.output[-2000:], flush=True)
    summarize(rows, base)
    return 0 if all(o.passed for o in rows) else 1


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summarize(rows: list[Outcome], base: dict[str, float | None]) -> None:
    print(
        "\n| mode | rank killed | trials | reached the target | in place | restarted | "
        "time to recover (s, max) | work lost after a restart (s, max) | "
        "accuracy (min) / undisturbed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, victim in dict.fromkeys((o.mode, o.victim) for o in rows):
        these = [o for o in rows if (o.mode, o.victim) == (mode, victim)]
        rec = [o.recover_s for o in these if o.recover_s is not None]
        lost = [o.lost_s for o in these if o.lost_s is not None]
        acc = [o.accuracy for o in these if o.accuracy is not None]
        print(
            f"| {mode} | {victim} | {len(these)} | {sum(o.passed for o in these)} | "
            f"{sum(o.passed and not o.restarts for o in these)} | "
            f"{sum(o.restarts > 0 for o in these)} | {fmt(max(rec, default=None))} | "
            f"{fmt(max(lost, default=None))} | {fmt(min(acc, default=None), 4)} / "
            f"{fmt(base.get(mode), 4)} |"
        )


if __name__ == "__main__":
    sys.exit(main())
