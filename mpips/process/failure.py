"""Never hang: an error on any rank ends the whole job, naming the rank and its task.

Errors every rank knows about (bad job or layout, agreed collectively) are printed once by
rank 0 and every rank exits 2. Anything else on one rank prints there and aborts the world,
the way ``python -m mpi4py`` does, so no other rank waits forever in a collective; a rank
whose failure another rank reports (AlreadyReported) aborts quietly, a little later.

A rank killed outright (kill -9, the out-of-memory killer, a crash) cannot speak, and MPICH's
launcher then SIGKILLs every other rank at once (no SIGTERM first, so they cannot either)
and names a PID of its own choosing, often not the dead one. So one watcher process per node
(``start_watcher``; in a session of its own, which the launcher does not kill) names it: the
node's ranks connect to it at start-up, say who they are, hand it copies of what the
launcher watches (stdout, stderr and hydra's PMI connection), and say "bye" when they exit
on purpose. Hydra notices a death when the dead rank's PMI connection closes; the watcher
holds it open, so it sees the death first, names the rank on the dead rank's stderr, then
lets go, and the launcher ends the job. It names nobody when the other ranks of the node
are already being ended too (the launcher's teardown after a failure elsewhere, a second
Ctrl-C), nor after a rank said it aborts (that rank speaks for itself).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ..errors import AgreedError, AlreadyReported, MpipsError


class FailureState:
    """What failure handling knows of this process: its task (named in its messages), its
    connection to its node's watcher, the name of the node's traceback claim (known once
    it joined the watcher), and that claim once this rank holds it (it printed the node's
    traceback)."""

    def __init__(self) -> None:
        self.role: str | None = None
        self.watch: socket.socket | None = None
        self.explain_name: str | None = None
        self.explains: socket.socket | None = None

    def reset(self) -> None:
        """Forget it all, closing the sockets without a word to the watcher (for tests)."""
        for sock in (self.watch, self.explains):
            if sock is not None:
                sock.close()
        self.role = self.explain_name = None
        self.watch = self.explains = None


STATE = FailureState()  # this process's: never rebound


def set_role(role: object) -> None:
    """Record this rank's task so failure messages can name it."""
    STATE.role = str(role)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def where() -> str:
    rank = _world().rank
    return f"rank {rank} ({STATE.role})" if STATE.role else f"rank {rank}"


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Run a rank's work; turn any exception into a clean exit (agreed) or a world abort."""
    try:
        yield
    except AgreedError as e:
        if _world().rank == 0:
            say(f"mpips: error: {e}")
        sys.exit(e.exit_code)
    except AlreadyReported as e:
        time.sleep(QUIET_GRACE_SECONDS)  # let the reporting rank's abort (and message) come first
        _abort(e.exit_code)
    except MpipsError as e:
        say(f"mpips: error on {where()}: {e}")
        _abort(e.exit_code)
    except KeyboardInterrupt:
        say(f"mpips: {where()} interrupted; aborting the job")
        _abort(130)
    except Exception as e:
        _say_failed(e)
        _abort(1)


def _say_failed(e: Exception) -> None:
    """What a rank says of an unexpected exception: where it raised in the user's own code
    and why, in a few lines (the full traceback when verbose, or when no frame is the
    user's: a bug in mpips); one line on the other ranks of the node (the same bug on
    every worker: said once a node, not once a rank)."""
    said = f"mpips: {where()} failed with {type(e).__name__}: {e}"
    frame = user_frame(e)
    full = _verbose() or frame is None
    if _first_to_explain():
        if full:
            tb = "".join(traceback.format_exception(e))
            say(f"mpips: {where()} failed:\n{tb}{said}; aborting the job")
        else:
            say(f"{in_user_code(e)}\nmpips: {where()} failed there; aborting the job ({FULL})")
        return
    last = frame or (traceback.extract_tb(e.__traceback__) or [None])[-1]
    at = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
    other = "printed a traceback" if full else "said where"
    time.sleep(ABORT_GRACE_SECONDS / 2)  # after the explaining rank's lines: they lead
    say(f"{said}{at}; aborting the job (another rank of this node {other})")


FULL = "the full traceback: -v, or MPIPS_VERBOSE=1"


def _verbose() -> bool:
    """Whether the run prints details (-v, MPIPS_VERBOSE): full tracebacks too."""
    from .log import verbose

    return verbose()


def user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The frame of ``e``'s traceback where the user's own code (a model, a hook, a script)
    raised, or called what raised: the last frame that is neither Python's library's nor an
    installed package's (numpy's) nor one of the layers a model calls (mpips.layers). None
    if mpips's own code raised: a bug in mpips, or a script's call into mpips.train."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        where = _whose(frame.filename)
        if where == "user":
            return frame
        if where == "mpips":
            return None
    return None


def _whose(filename: str) -> str:
    """Whose code a traceback's file is: "user", "mpips", or "library" (Python's own, an
    installed package, a module of mpips's that models call, a frame with no file)."""
    if filename.startswith("<"):  # <string>, <frozen importlib._bootstrap>
        return "library"
    path = Path(filename).resolve()
    if path.is_relative_to(_PACKAGE):
        return "library" if path.relative_to(_PACKAGE).as_posix() in MODEL_API else "mpips"
    if {"site-packages", "dist-packages"} & set(path.parts):
        return "library"
    return "library" if any(path.is_relative_to(d) for d in _library_dirs()) else "user"


_PACKAGE = Path(__file__).resolve().parents[1]  # mpips/
MODEL_API = (  # what models call, as numpy
    "layers.py",
    "models/mlp.py",
    "device/backend.py",
    "device/arrays.py",
    "device/staging.py",
)


def _library_dirs() -> list[Path]:
    """Where Python's own library and installed packages live (this environment's)."""
    import sysconfig

    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return [Path(paths[k]).resolve() for k in keys if k in paths]


def in_user_code(e: BaseException) -> str:
    """``e`` where it raised in the user's code, compiler style: ``file:line: in
    function: Type: message`` and the line's source, indented (the file relative to the
    working directory when below it). Empty if no frame of the traceback is the user's."""
    frame = user_frame(e)
    if frame is None:
        return ""
    name = frame.filename
    with suppress(ValueError):
        name = str(Path(name).resolve().relative_to(Path.cwd().resolve()))
    line = f"\n    {frame.line.strip()}" if frame.line else ""
    return f"{name}:{frame.lineno}: in {frame.name}: {type(e).__name__}: {e}{line}"


def say(text: str) -> None:
    """``text`` and its newline on stderr in one write, so lines of ranks that fail at once
    do not run into each other in the launcher's merged output."""
    with suppress(OSError, ValueError):
        sys.stderr.flush()
    data = (text + "\n").encode(errors="backslashreplace")
    try:
        while data:
            data = data[os.write(sys.stderr.fileno(), data) :]
    except (OSError, ValueError, AttributeError):  # (no file descriptor: a test's capture)
        print(text, file=sys.stderr, flush=True)


def _first_to_explain() -> bool:
    """Whether this rank prints its traceback: the first rank of its node to fail does (it
    binds the node's claim, an abstract socket name released when the process ends); the
    others say one line. Before the ranks know their node's watcher, every rank does."""
    if STATE.explains is not None or STATE.explain_name is None:
        return True
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(STATE.explain_name)
    except OSError:
        claim.close()
        return False
    STATE.explains = claim
    return True


ABORT_GRACE_SECONDS = 0.5
QUIET_GRACE_SECONDS = 4 * ABORT_GRACE_SECONDS  # a quiet rank aborts later than the speaker


def _abort(code: int) -> None:
    comm = _world()
    if comm.size > 1:
        # MPI_Abort tears the launcher's stdio forwarding down at once; without a moment's
        # grace the message just written (the one that names this rank) was sometimes lost
        time.sleep(ABORT_GRACE_SECONDS)
        leaving(ABORT)  # this rank speaks for itself: the node's watcher stays quiet
        try:
            _unlink_runtime_shm()
            _quiet_runtime()
        finally:
            comm.Abort(code)
    sys.exit(code)


def _quiet_runtime() -> None:
    """Unless verbose: this rank's stderr to /dev/null, once it has said why it aborts, so
    the MPI runtime's own line (``Abort(1) on node 1 (rank 1 in comm 0): application called
    MPI_Abort(MPI_COMM_WORLD, 1) - process 1``) does not bury it. Never raises."""
    if _verbose():
        return
    with suppress(OSError, ValueError, AttributeError):
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stderr.fileno())
        os.close(null)


RUNTIME_SHM = b"/dev/shm/mpich_shm_"  # MPICH's node segment, named until MPI_Finalize


def unlink_runtime_shm() -> None:
    """Remove the names of MPICH's shared-memory files of this node (see
    _unlink_runtime_shm): for a rank that leaves without MPI_Finalize (survive mode)."""
    _unlink_runtime_shm()


def _unlink_runtime_shm() -> None:
    """Best effort: remove the names of the MPI runtime's shared-memory files this process
    maps. MPICH (5.x) keeps one per node named until MPI_Finalize, so a job ended by
    MPI_Abort would leave it in /dev/shm (a few MB of memory each) until someone deletes it;
    the ranks' mappings stay valid until they exit. Never raises: the abort must follow."""
    try:
        with open("/proc/self/maps", "rb") as f:  # bytes: any path, whatever its encoding
            paths = {line.split(maxsplit=5)[-1].rstrip(b"\n") for line in f}
        for path in paths:
            if path.startswith(RUNTIME_SHM) and b"(deleted)" not in path:
                with suppress(OSError):  # another rank of the node was first
                    os.unlink(path)
    except Exception:  # noqa: BLE001 (whatever /proc says, the job must still abort)
        pass


# -- the node's watcher: names a rank that died without a word ----------------------------

BYE, ABORT = b"bye\n", b"abort\n"  # what a rank says to its watcher when it ends on purpose


def _address(pid: int, token: int) -> str:
    """The watcher's socket: in the abstract namespace (no file to leave behind)."""
    return f"\0mpips-watch-{pid}-{token:x}"


def start_watcher() -> tuple[int, int]:
    """The node's first rank: listen, and start the watcher (in its own session, so the
    launcher's SIGKILL of the ranks does not reach it) on that socket. Returns the
    address to hand to the node's ranks, as (pid, token); (0, 0) if it could not start
    (the job runs unwatched)."""
    if STATE.watch is not None:  # a second Cluster in this process: its ranks are watched already
        return 0, 0
    token = secrets.randbits(62)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(_address(os.getpid(), token))
            listener.listen(socket.SOMAXCONN)  # every rank of a big node at once
            package = str(Path(__file__).resolve().parents[1])  # mpips/
            code = (  # mpips.process.failure alone: the package (numpy, the models) is not needed
                "import sys, types; p = types.ModuleType('mpips'); p.__path__ = [sys.argv[1]]; "
                "sys.modules['mpips'] = p; "
                "from mpips.process.failure import watch; watch(int(sys.argv[2]))"
            )
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", code, package, str(listener.fileno())],
                pass_fds=(listener.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                # what the interpreter itself may need to start (a module-built Python's
                # libpython); nothing of the job's own environment
                env={k: os.environ[k] for k in _INTERPRETER_ENV if k in os.environ},
            )
    except OSError:
        return 0, 0
    return os.getpid(), token


_INTERPRETER_ENV = ("LD_LIBRARY_PATH", "PYTHONHOME", "PATH")
MAX_HELLO = 1 << 16  # what a rank says to its watcher is a line of JSON: more is not a rank


def join_watcher(pid: int, token: int, rank: int, task: str) -> None:
    """Every rank of the node: tell the watcher who this rank is, hand it copies of this
    process's stdout and stderr, and say "bye" to it at a deliberate exit. Best effort: a
    rank that cannot reach it runs unwatched."""
    if not pid or STATE.watch is not None:
        return
    STATE.explain_name = _address(pid, token) + "-traceback"
    hello = {"rank": rank, "task": task, "pid": os.getpid(), "host": socket.gethostname()}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(_address(pid, token))
        socket.send_fds(sock, [json.dumps(hello).encode() + b"\n"], _launcher_fds())
    except OSError:
        sock.close()
        return
    STATE.watch = sock
    atexit.register(leaving, BYE)


def _launcher_fds() -> list[int]:
    """What the launcher watches to see this process end: stdout, stderr, and MPICH hydra's
    PMI connection (``PMI_FD``: its closing, not the pipes', starts hydra's teardown)."""
    fds = [1, 2]
    with suppress(ValueError, OSError):
        pmi = int(os.environ.get("PMI_FD", ""))
        os.fstat(pmi)
        fds.append(pmi)
    return fds


def leaving(word: bytes) -> None:
    """Tell the watcher this rank ends on purpose (BYE), or aborts and speaks for itself
    (ABORT). Never raises: it runs on the way out."""
    sock, STATE.watch = STATE.watch, None
    if sock is not None:
        with suppress(OSError):
            sock.sendall(word)
            sock.close()


class _Peer:
    """One rank as its watcher knows it."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buffer = conn, b""
        self.fds: list[int] = []
        self.who: dict = {}
        self.said = b""
        self.aborted = False  # it said ABORT: it speaks for itself

    def hear(self) -> bool:
        """Take in what the rank sent (its hello, then BYE or ABORT, and its descriptors);
        False once its connection is closed (or it sent more than a rank says)."""
        try:
            data, fds, _, _ = socket.recv_fds(self.conn, 4096, 4)
        except OSError:
            data, fds = b"", []
        self.fds += fds
        self.buffer += data
        if len(self.buffer) > MAX_HELLO:  # not a rank speaking: drop it, quietly
            self.buffer, self.said, data = b"", BYE, b""
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if not self.who:
                with suppress(ValueError):
                    self.who = json.loads(line)
            else:
                self.said = line + b"\n"
                self.aborted = self.aborted or self.said == ABORT
        return bool(data)

    def name(self) -> str:
        w = self.who
        return f"rank {w['rank']} ({w['task']}, pid {w['pid']} on {w['host']})" if w else "a rank"

    def release(self) -> None:
        """Close this rank's output pipes (the launcher then sees it gone) and its socket."""
        for fd in self.fds:
            with suppress(OSError):
                os.close(fd)
        self.fds = []
        self.conn.close()


_HARMLESS = sum(
    1 << (s - 1) for s in (signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG, signal.SIGCONT)
)


def _running(pid: int) -> bool:
    """Whether process ``pid`` lives and nothing is ending it (not exiting, no signal
    pending that could end it): what tells one rank's death from the launcher's SIGKILL of
    them all, which marks every rank of the node before the first of them is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip()[:1] in ("Z", "X"):
        return False
    if any(int(fields.get(k, "0").strip() or "0", 16) & ~_HARMLESS for k in ("SigPnd", "ShdPnd")):
        return False  # a signal on its way: SIGKILL from the launcher, a second Ctrl-C...
    flags = int(stat.rsplit(")", 1)[1].split()[6])  # field 9 of /proc/PID/stat
    return not flags & 0x4  # PF_EXITING


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a unix socket (-1 if unknown)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", creds)[1])
    except OSError:
        return -1


def _clock() -> str:
    """The wall-clock time to the millisecond (nodes' clocks agree to about that, by NTP)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def watch(listener_fd: int) -> None:
    """The watcher's loop (a process of its own, stdlib only): until every rank that
    connected is gone. Blocks in select: it uses no CPU while the job runs. It holds four
    descriptors a rank: it raises its own limit as far as it may."""
    with suppress(ValueError, OSError):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    listener = socket.socket(fileno=listener_fd)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    peers: list[_Peer] = []
    quiet = False  # a rank aborted (it speaks for itself), or a death was judged
    deadline = time.monotonic() + 600  # nobody connects at all: go
    accepted = False
    while peers or (not accepted and time.monotonic() < deadline):
        gone = []
        for key, _ in sel.select(5.0):
            if key.fileobj is listener:
                peer = _accept(listener, sel)
                if peer is not None:
                    peers.append(peer)
                    accepted = True
                continue
            peer = key.data
            if not peer.hear():
                sel.unregister(peer.conn)
                peers.remove(peer)
                gone.append(peer)
            quiet = quiet or peer.aborted
        quiet = _judge(gone, peers, quiet)
        for p in gone:
            p.release()  # the launcher sees it gone now
    for p in peers:
        p.release()


def _accept(listener: socket.socket, sel: selectors.BaseSelector) -> _Peer | None:
    """A rank connecting to the watcher, now watched; None if it is no rank of this user's
    (or the watcher is out of descriptors: it watches who came and takes no more)."""
    try:
        conn, _ = listener.accept()
    except OSError:
        sel.unregister(listener)
        return None
    if _peer_uid(conn) != os.getuid():  # only this user's processes are ranks
        conn.close()
        return None
    peer = _Peer(conn)
    sel.register(conn, selectors.EVENT_READ, peer)
    return peer


def _judge(gone: list[_Peer], peers: list[_Peer], quiet: bool) -> bool:
    """Name the ranks of ``gone`` that died without a word, on their own stderr, if another
    rank of the node is alive and untouched (they died alone: not the launcher ending the
    job), unless ``quiet``. Returns whether the watcher is quiet from now on: one verdict,
    as what follows a death is the launcher ending the job."""
    dead = [p for p in gone if not p.said]  # their launcher connections are still held
    if not dead or quiet:
        return quiet
    if any(_running(p.who.get("pid", 0)) for p in peers if not p.said):
        seen = _clock()  # to order the verdicts of several nodes' watchers
        for p in dead:
            message = (
                f"mpips: {p.name()} died without a word at {seen}: killed (kill -9, the "
                f"out-of-memory killer) or crashed. The launcher now ends the job; "
                f"the PID its message names may be another rank's, one it stopped\n"
            )
            with suppress(OSError, IndexError):
                os.write(p.fds[1], message.encode())  # its stderr
    return True
