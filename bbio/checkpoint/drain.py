"""The drain: copies finished checkpoint files from a burst buffer to the PFS, then commits.

It runs as a separate process per node and checkpointer (``python -m
bbio.checkpoint.drainer``), started on the first save, in its own session so it
outlives a crash of the training process; ``bbio ckpt drain --finish`` (a Slurm
epilog) runs the same code in the foreground.  It never touches MPI.

Its queue is a journal on the burst buffer, ``<bb>/ckpt/<name>/.journal/``:
one ``task-<step>.json`` per checkpoint to drain, written by the training
process once the node's file is durable, which then writes a byte into the
``wake`` FIFO there: an idle drain waits on it (and looks at the journal every
20 ms anyway), so it starts copying at once.  An exclusive ``flock`` on
``drain.lock`` makes one drainer per journal; it is released when the process
dies, and a drain started meanwhile waits for it, then drains.  A task is
removed only once its file is on the PFS, verified, recorded, and the
checkpoint committed if this node was the last, so replaying the journal
after a crash is idempotent.

For each task: copy ``node-N.h5`` (native copy, CRC32C in the same pass, in
file order) to the PFS, at its final name if no file is there (such a file
counts for nothing without its record and a manifest), else under a temporary
name; fsync it on the descriptor that wrote it and read it back and compare
(``ckpt_verify``: through the client cache, during the fsync; or from the
device, after it, cached pages dropped); meanwhile, if the bytes copied are
those the save recorded (size and CRC32C), write the node's record for the PFS
(size, CRC32C, and what the file holds, read from the BB copy) under its
temporary name, durably; only if the node file was not saved again
meanwhile, rename the copy into place (if it is not there) and record it on
the BB too; then, if every other node's record is there, this node is the
last: it takes the commit lock, writes ``global.h5`` (virtual datasets over
the node files, built in memory from the records: at its final name if no file
is there, then fsyncs the step's directory, its own node file's name in it too;
else under a temporary name, renamed, then the fsync) and ``manifest.json``
(under a temporary name) at once, and renames ``manifest.json`` last; then it
renames its own record into place (unless the step was saved again since),
also if the commit failed (a node that is
not the last renames it first and looks again; if it is still not the last, it
fsyncs the directory: a commit's own directory fsync covers the renames).  The
drain reports the commit in ``status.json`` (``committed``, and each step's save
in ``committed_saves``: waiting ranks learn of it there, before the drain is done
with its task), and while other nodes have still to commit a step it drained
(``awaiting``) a thread of its own
looks for their manifest (also while the drain copies the next checkpoint),
after a tenth of the time it has waited so far (5 to 50 ms): waiting ranks read
the status, so one process per node, not every rank, polls the PFS; and they sleep
on their own FIFO in ``waiters/``, into which the drain writes a byte at each
new status, so they take no CPU from the copy and learn of the commit at once.  Then PFS
retention, and this node's BB copies beyond ``keep_bb`` that are committed
are trimmed (again every second while idle, until none is left waiting for
other nodes' commits; the PFS is read only when copies are over the limit).
A task that fails is retried with exponential backoff while the tasks after
it go on, and the failure is reported in ``status.json`` until the task
succeeds or leaves.  A node file that is not a checkpoint file (damaged in the
burst buffer) can never be drained: its save is set aside by a marker beside
its task, ``damaged-<step>.json``, and one on the PFS for the other nodes'
drains, ``damaged.json`` in the step's directory; it is reported (``damaged``) and not
retried, so it holds back neither later checkpoints nor ``close`` nor a
backpressure policy.  A task file that is damaged (not JSON, or not a task's
fields) cannot be drained either: its save (known from the node's BB record)
is set aside the same way, the task file kept for the admin.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bbio import _native
from bbio.checkpoint import layout
from bbio.checkpoint.globalview import describe_node_file, global_view, merge_descriptions
from bbio.errors import BBIOError, BBIOTimeoutError, IntegrityError, from_oserror
from bbio.transfer import files

JOURNAL = ".journal"
LOCK, STATUS, STOP, TARGET, WAKE = "drain.lock", "status.json", "stop", "target.json", "wake"
NEXT_LOCK = "next.lock"  # held by the one background drain waiting for ``LOCK``
#: tells a background drain what the stop file tells it, where that cannot be made
STOP_SIGNAL = signal.SIGUSR1
_told_to_stop = threading.Event()  # set by STOP_SIGNAL
WAITERS = "waiters"  # one FIFO per waiting process, told of every new status
HALF_MADE_WAITER_SECONDS = 60.0  # a hidden waiter FIFO this old was left by a dead process
COMMIT_LOCK = ".commit.lock"
RECORDS_LOCK = "records.lock"  # in the journal: a node's BB records, saved or drained
MANIFEST = "manifest.json"
RETIRING = ".retiring-"  # a checkpoint's directory being deleted by PFS retention
GLOBAL_VIEW = "global.h5"
MANIFEST_FORMAT = "bbio-checkpoint/1"
TASK_DAMAGED = "task_damaged"  # in a set-aside marker: the task file was damaged, not the copy
DAMAGED_SINCE_SAVE = (
    "it was damaged in the burst buffer since its save: this save cannot be drained (it is "
    "set aside; later ones are drained); a restore passes over it"
)
STALE_LOCK_SECONDS = 120.0
COMMIT_PATIENCE_SECONDS = STALE_LOCK_SECONDS + 5  # a held commit lock, waited on by default
MAX_BACKOFF_SECONDS = 30.0
IDLE_TRIM_SECONDS = 1.0
POLL_SECONDS = 0.02  # the journal is on the BB: a listing costs microseconds
AWAIT_POLL_SECONDS = (0.005, 0.05)  # shortest and longest pause between looks for others' commits
AWAIT_POLL_SHARE = 0.1  # between, a pause lasts this share of the time awaited so far
ORPHAN_LOOK_SECONDS = 2.0  # between looks for an awaited commit whose committer is gone
LOOKER_EXIT_SECONDS = 5.0  # how long a leaving drain waits for a look in progress
RECENT_COMMITS = 64  # steps the status remembers as committed
STOPPED = "stopped"


@dataclasses.dataclass(frozen=True)
class Task:
    """One node file to drain (the JSON of a journal entry)."""

    name: str
    step: int
    node: int
    nodes: int
    bb_step_dir: str
    pfs_step_dir: str
    keep_pfs: int
    keep_bb: int = 2
    verify: str = "cache"  # ckpt_verify: read back through the client cache, or the device
    save_time: float | None = None  # which save of the step: its "time" attribute

    def is_save_of(self, document: dict[str, Any] | None) -> bool:
        """True if ``document`` (a node record, or a node file's contents) belongs to this
        task's save of the step."""
        return self.save_time is None or (document or {}).get("time", self.save_time) == (
            self.save_time
        )

    def is_queued_in(self, document: dict[str, Any] | None) -> bool:
        """True if ``document``, a journal entry (``task-<step>.json``), queues this
        task's save of the step, not a later one."""
        return (document or {}).get("save_time") == self.save_time

    @property
    def source(self) -> Path:
        """The node file on the burst buffer."""
        return Path(self.bb_step_dir) / layout.node_filename(self.node)

    @property
    def bb_record(self) -> Path:
        """The node file's record on the burst buffer."""
        return Path(self.bb_step_dir) / layout.node_record_name(self.node)

    @property
    def pfs_record(self) -> Path:
        """The node file's record on the PFS."""
        return Path(self.pfs_step_dir) / layout.node_record_name(self.node)

    @property
    def target(self) -> Path:
        """Where it goes on the PFS."""
        return Path(self.pfs_step_dir) / layout.node_filename(self.node)


def journal_dir(bb_ckpt_dir: Path) -> Path:
    """The journal of one checkpointer on one node."""
    return bb_ckpt_dir / JOURNAL


def task_path(journal: Path, step: int) -> Path:
    """The journal entry of a step."""
    return journal / f"task-{step:08d}.json"


def set_aside_path(journal: Path, step: int) -> Path:
    """The marker that sets a save of ``step`` aside: its burst-buffer file is damaged."""
    return journal / f"damaged-{step:08d}.json"


def damaged_on_pfs(pfs_step_dir: Path) -> Path:
    """The marker by which a node tells the others that its file of the step's latest save
    is damaged: one name per step, so that a look is one open, like the manifest's."""
    return pfs_step_dir / "damaged.json"


def read_damaged(pfs_step_dir: Path) -> dict[str, Any] | None:
    """The PFS marker of a node that set the step's latest save aside, if any (a new save
    of the step removes it).  Not collective; an unreadable marker or PFS counts as none
    (looked at again)."""
    try:
        marker = files.read_json(damaged_on_pfs(pfs_step_dir))
    except (OSError, BBIOError):
        return None
    return marker if isinstance(marker, dict) and "time" in marker else None


def damaged_save(pfs_step_dir: Path, save_time: float | None) -> dict[str, Any] | None:
    """The PFS marker of a node that set the save of time ``save_time`` aside, if any.
    Not collective."""
    marker = read_damaged(pfs_step_dir)
    return marker if marker is not None and marker["time"] == save_time else None


class DamagedNodeFile(IntegrityError):
    """A node file in the burst buffer that is not a checkpoint file: it can never be
    drained, so its save is set aside rather than retried."""


def set_aside(journal: Path) -> dict[int, dict[str, Any]]:
    """The saves set aside in ``journal`` whose task is still the one queued (or still
    the damaged task file that was set aside): {step: {"time": save time, "why":
    message, "node": node}}.  Not collective."""
    found = {}
    for marker in journal.glob("damaged-*.json"):
        with contextlib.suppress(BBIOError, ValueError):
            step = int(marker.stem.partition("-")[2])
            document = files.read_json(marker) or {}
            try:
                task = read_task(task_path(journal, step))
            except IntegrityError:  # still damaged: set aside if that is why
                if document.get(TASK_DAMAGED):
                    found[step] = document
                continue
            if task is not None and task.save_time == document.get("time"):
                found[step] = document
    return found


@contextlib.contextmanager
def records_locked(journal: Path) -> Iterator[None]:
    """Hold this node's lock on the burst-buffer records of ``journal``'s checkpointer (an
    ``flock``, released if the process dies).  A save that drops or writes a step's record
    and a drain that records a drained copy hold it, so a drain finishing an older save of
    a step saved again never writes over the new save's record.  Not collective."""
    fd = os.open(journal / RECORDS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_task(journal: Path, task: Task) -> None:
    """Queue ``task`` (durably).  Not collective."""
    files.write_json_atomic(task_path(journal, task.step), dataclasses.asdict(task))


def wake(journal: Path) -> None:
    """Tell the journal's drain, if one waits, that a task was added.  Never fails: a
    drain that does not wait (busy, starting or gone) finds the task by itself."""
    _poke(journal / WAKE)


def _poke(fifo: Path) -> bool | None:
    """Write a byte into ``fifo``: True if done, False if no process has it open (or it
    is not a FIFO), None if it could not be told (say, out of descriptors).  Never
    blocks: a full FIFO has wake-ups pending anyway."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        return False if exc.errno in (errno.ENXIO, errno.ENOENT) else None
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        with contextlib.suppress(BlockingIOError):
            os.write(fd, b"!")
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


class _Fifo:
    """A FIFO this process reads: pauses that a byte written into it ends at once."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def _open(self, path: Path) -> bool:
        """Open ``path``, a FIFO; False (pauses only sleep) if it is something else."""
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # RDWR: never EOF
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            self.fd = fd
            return True
        os.close(fd)  # a regular file would always be "ready"
        return False

    def pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if a byte is written meanwhile (or was since the
        last pause)."""
        if self.fd is None:
            time.sleep(seconds)
            return
        poller = select.poll()  # not select(): descriptors above 1023 are common in a rank
        poller.register(self.fd, select.POLLIN)
        if poller.poll(max(seconds, 0.0) * 1000):
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 4096)

    @property
    def notified(self) -> bool:
        """True if pauses end when written to (else they only sleep)."""
        return self.fd is not None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Waker(_Fifo):
    """The drain's end of the ``wake`` FIFO: its pauses end when a task is added."""

    def __init__(self, journal: Path) -> None:
        super().__init__()
        try:
            with contextlib.suppress(FileExistsError):
                os.mkfifo(journal / WAKE, 0o600)
            self._open(journal / WAKE)
        except OSError:  # a file system without FIFOs: the polling alone finds tasks
            return

    def ring(self) -> None:
        """Not collective: end the drain's pause now (or its next one), from any of its
        threads."""
        if self.fd is not None:
            with contextlib.suppress(OSError):  # full: a wake-up is pending anyway
                os.write(self.fd, b"!")


class StatusWaiter(_Fifo):
    """A waiting process's FIFO in the journal's ``waiters`` directory: the drain writes
    a byte into each one whenever it writes its status, so a rank waiting for a commit
    sleeps instead of polling and learns of it at once.  Not collective.  Where FIFOs
    cannot be made, :meth:`pause` only sleeps (:attr:`notified` is False)."""

    def __init__(self, journal: Path) -> None:
        super().__init__()
        self.path: Path | None = None
        directory = journal / WAITERS
        name = files.unique_tag()  # never another's to remove
        temp = directory / f".{name}"
        try:
            directory.mkdir(exist_ok=True)
            os.mkfifo(temp, 0o600)
            if self._open(temp):  # opened before it is listed: the drain never finds it
                os.rename(temp, directory / name)  # without a reader, and so drops it
                self.path = directory / name
        except OSError:
            self.close()
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()

    def close(self) -> None:
        """Stop being told (remove the FIFO)."""
        super().close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None


def _wake_waiters(journal: Path) -> None:
    """Write a byte into every waiting process's FIFO; remove those nobody reads any more
    (their process closed or lost it), and hidden ones a process that died left half made
    (older than a minute).  Never fails."""
    try:
        with os.scandir(journal / WAITERS) as it:
            names = [e.name for e in it]
    except OSError:
        return
    for name in names:
        fifo = journal / WAITERS / name
        if name.startswith("."):  # renamed microseconds after it is made, unless its maker
            try:  # died: judged by age, not PID (waiters may be in another PID namespace)
                gone = time.time() - fifo.lstat().st_mtime > HALF_MADE_WAITER_SECONDS
            except OSError:
                gone = False
        else:
            gone = _poke(fifo) is False
        if gone:
            with contextlib.suppress(OSError):
                fifo.unlink()


_TASK_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "step": (int,),
    "node": (int,),
    "nodes": (int,),
    "bb_step_dir": (str,),
    "pfs_step_dir": (str,),
    "keep_pfs": (int,),
    "keep_bb": (int,),
    "verify": (str,),
    "save_time": (int, float, type(None)),
}


def _task_problem(document: dict[str, Any], step: int | None) -> str | None:
    """What makes ``document`` not a task of ``step`` (None if it is one).  Pure."""
    required = {f.name for f in dataclasses.fields(Task) if f.default is dataclasses.MISSING}
    missing, unknown = sorted(required - set(document)), sorted(set(document) - set(_TASK_TYPES))
    if missing or unknown:
        return f"fields missing: {missing}, fields not a task's: {unknown}"
    for name, value in document.items():
        if _mistyped(value, _TASK_TYPES[name]):
            return f"{name} is {value!r}"
    if document.get("verify", "cache") not in ("cache", "device"):
        return f"verify is {document['verify']!r}"
    if not 0 <= document["node"] < document["nodes"]:
        return f"node {document['node']} of {document['nodes']}"
    if step is not None and document["step"] != step:
        return f"it queues step {document['step']}"
    return None


def read_task(path: Path) -> Task | None:
    """The task queued at ``path`` (a journal's ``task-<step>.json``), or None if there is
    none.  Not collective.

    Raises :class:`IntegrityError` naming ``path`` when it is damaged: not a JSON
    object, or not the fields of a task of its step (bbio writes it whole).
    """
    document = files.read_json(path)
    if document is None:
        return None
    problem = _task_problem(document, _queued_step(path))
    if problem is not None:
        raise IntegrityError(
            f"the drain's task file is damaged: {problem}",
            path=path,
            hint="bbio writes it whole, so something else changed it; the drain sets that "
            "save aside (a new save of the step replaces it)",
        )
    return Task(**document)


def _queued_step(path: Path) -> int | None:
    """The step a task file's name (``task-<step>.json``) queues."""
    try:
        return int(path.stem.partition("-")[2])
    except ValueError:
        return None


def read_queue(journal: Path) -> tuple[list[Task], dict[int, IntegrityError]]:
    """The queued tasks, oldest step first, and the damaged task files, {step: why}; but
    for saves set aside (their node file or task file damaged).  Not collective."""
    aside = set_aside(journal)
    tasks, damaged = [], {}
    for path in sorted(journal.glob("task-*.json")):
        step = _queued_step(path)
        if step is None:
            continue  # not a name bbio gives a task
        if step in aside:
            continue
        try:
            task = read_task(path)
        except IntegrityError as exc:
            damaged[step] = exc
            continue
        if task is not None:
            tasks.append(task)
    return tasks, damaged


def pending(journal: Path) -> list[Task]:
    """The queued tasks that can be drained, oldest step first (:func:`read_queue`).
    Not collective."""
    return read_queue(journal)[0]


def set_target(journal: Path, pfs_ckpt_dir: Path, nodes: int, keep_pfs: int) -> None:
    """Record where this journal's checkpoints go (for an epilog that finds them later)."""
    files.write_json_atomic(
        journal / TARGET, {"pfs_ckpt_dir": str(pfs_ckpt_dir), "nodes": nodes, "keep_pfs": keep_pfs}
    )


def commit_ready(journal: Path, patience: float = COMMIT_PATIENCE_SECONDS) -> list[int]:
    """Commit every checkpoint of this journal's target whose node files are all on the PFS
    and whose save this node drained (another job's are its own to commit).

    Finishes the work of a committer that died.  A commit lock held by another
    host's committer is waited on for up to ``patience`` seconds: that committer
    commits, or its lock grows stale and this one takes over.  Returns the steps
    committed now.
    """
    target = files.read_json(journal / TARGET)
    if target is None:
        return []
    ckpt_dir = Path(target["pfs_ckpt_dir"])
    done = []
    if ckpt_dir.is_dir():
        for entry in sorted(ckpt_dir.iterdir()):
            step = layout.parse_step(entry.name)
            try:
                if step is None or committed_save(entry) or not _drained_here(journal, entry):
                    continue
                if try_commit(entry, target["nodes"], patience=patience):
                    apply_pfs_retention(ckpt_dir, target["keep_pfs"])
                    done.append(step)
            except (BBIOError, OSError) as exc:  # one step's damage holds back no other
                print(f"bbio drain: {entry}: not committed: {exc}", file=sys.stderr)
    return done


def _drained_here(journal: Path, pfs_step_dir: Path) -> bool:
    """Did this journal's node drain the save whose record is in ``pfs_step_dir``?  Its BB
    record of the step holds a PFS CRC32C, and the node's PFS record is of that save."""
    bb_step_dir = journal.parent / pfs_step_dir.name
    for bb_record_path in bb_step_dir.glob("node-*.json"):
        bb_record = files.read_json(bb_record_path) or {}
        pfs_record = files.read_json(pfs_step_dir / bb_record_path.name) or {}
        if bb_record.get("crc32c") is not None and bb_record.get("time") == pfs_record.get("time"):
            return True
    return False


def read_status(journal: Path) -> dict[str, Any]:
    """The drain's last report: state, error, retries."""
    return files.read_json(journal / STATUS) or {}


def _write_status(journal: Path, **status: Any) -> None:
    """Write the status (with the writer's pid and host), then tell the waiting processes."""
    writer = {**_identity(), "time": time.time()}
    files.write_json_atomic(journal / STATUS, {**writer, **status})
    _wake_waiters(journal)


def manifest_path(step_dir: Path) -> Path:
    """The commit record of a checkpoint on the PFS."""
    return step_dir / MANIFEST


def read_manifest(step_dir: Path) -> dict[str, Any] | None:
    """The committed manifest of a PFS checkpoint, or None if it is not committed.

    Raises :class:`IntegrityError` for a damaged manifest: not valid JSON, of
    another format, or without what a restore reads (:func:`manifest_problem`).
    """
    path = manifest_path(step_dir)
    document = files.read_json(path)
    if document is None:
        return None
    problem = manifest_problem(document, layout.parse_step(step_dir.name))
    if problem is not None:
        raise IntegrityError(
            f"the manifest is damaged: {problem}",
            path=path,
            hint="bbio writes it whole, so something else changed it; 'bbio ckpt drain "
            "--finish' on the nodes that saved the step commits it again, or remove the "
            "step's directory",
        )
    return document


def record_problem(record: dict[str, Any]) -> str | None:
    """What makes ``record`` not a node record: its size, its CRC32C once drained, and
    what a save by this bbio records (the file's CRC32C, the layout of ranks).  Pure."""
    size = record.get("size")
    if not _is_count(size):
        return f"size is {size!r}"
    for name in ("crc32c", "file_crc32c"):
        if record.get(name) is not None and not _is_count(record[name]):
            return f"{name} is {record[name]!r}"
    if "layout" not in record:  # a save by an earlier bbio
        return None
    ranks = record["layout"]
    fields = ranks if isinstance(ranks, dict) else {}
    if not (
        _is_count(fields.get("ranks"))
        and _is_count(fields.get("nodes"))
        and isinstance(fields.get("node_ranks"), list)
    ):
        return f"layout is {ranks!r}, not the ranks, nodes and node_ranks of the save"
    return None


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _mistyped(value: object, kinds: tuple[type, ...]) -> bool:
    """Is ``value`` of none of ``kinds`` (a JSON ``true`` is not an int)?"""
    return isinstance(value, bool) or not isinstance(value, kinds)


_MANIFEST_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "time": (int, float),
    "ranks": (int,),
    "nodes": (int,),
    "layout": (str,),
    "rank_nodes": (list,),
    "global_shapes": (dict,),
    "attrs": (dict,),
    "files": (list,),
}


def manifest_problem(document: dict[str, Any], step: int | None) -> str | None:
    """What makes ``document`` not the manifest of ``step`` that a restore can read (None
    if it is one): its format, the fields restore reads, a node of each rank and an
    entry (path, size, CRC32C) for each node file and ``global.h5``.  Pure."""
    if document.get("format") != MANIFEST_FORMAT:
        return f"its format is {document.get('format')!r}, not {MANIFEST_FORMAT!r}"
    for name, kinds in _MANIFEST_TYPES.items():
        if _mistyped(document.get(name), kinds):
            return f"{name} is {document.get(name)!r}"
    if step is not None and document["step"] != step:
        return f"it is the manifest of step {document['step']}"
    nodes, rank_nodes = document["nodes"], document["rank_nodes"]
    if document["layout"] not in (layout.PER_RANK, layout.GLOBAL):
        return f"layout is {document['layout']!r}"
    if len(rank_nodes) != document["ranks"] or not all(
        _is_count(n) and n < nodes for n in rank_nodes
    ):
        return f"rank_nodes {rank_nodes!r} is not a node of each of {document['ranks']} ranks"
    paths = []
    for entry in document["files"]:
        fields = entry if isinstance(entry, dict) else {}
        if not isinstance(fields.get("path"), str) or not all(
            _is_count(fields.get(k)) for k in ("size", "crc32c")
        ):
            return f"a file entry is {entry!r}, not its path, size and crc32c"
        paths.append(fields["path"])
    expected = [layout.node_filename(n) for n in range(nodes)] + [GLOBAL_VIEW]
    if sorted(paths) != sorted(expected):
        return f"it lists the files {paths}, not {expected}"
    return None


# ------------------------------------------------------------------ copying


def start_copy(task: Task) -> NodeCopy | None:
    """Not collective: copy ``task``'s node file to the PFS (not yet durable): the copy
    to finish, or None if the step was saved again since the task was queued.  A copy
    drained before (a replay) is not copied again; its record is published if it was
    not."""
    record_path = task.pfs_record
    bb_record = files.read_json(task.bb_record) or {}
    if not task.is_save_of(bb_record):
        return None
    if bb_record.get("crc32c") is not None:  # drained before (a replay): the PFS copy may do
        existing = files.read_json(record_path)
        unpublished = existing is None  # copied and verified, killed before its rename
        if unpublished:
            with contextlib.suppress(IntegrityError):  # half rewritten by a later try: copied
                existing = files.read_json(files.temp_path(record_path))
        if (
            existing is not None
            and task.is_save_of(existing)
            and existing.get("crc32c") == bb_record["crc32c"]
            and _size_of(task.target) == existing.get("size")  # not an older file there
        ):
            if unpublished and not _publish(task):
                return None  # saved again since: not this save's to publish
            return NodeCopy(task, bb_record, drained=existing)
    Path(task.pfs_step_dir).mkdir(parents=True, exist_ok=True)
    copying = NodeCopy(task, bb_record)
    try:
        copying.copy()
    except BaseException:
        copying.abandon()  # a retry copies again; a withdrawn save leaves nothing
        raise
    return copying


def _size_of(path: Path) -> int | None:
    """The size of the file at ``path``; None if there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


class NodeCopy:
    """A node file's copy on the PFS, from :func:`start_copy` to :meth:`finish`.

    The bytes go to the node file's final name when no file is there (then
    nothing is renamed: without its record and a manifest such a file counts
    for nothing), else to its temporary name, renamed over the file there once
    durable and verified.  They are written, fsynced and (``ckpt_verify``
    "cache") read back on descriptors opened once, the reader's during the
    copy, so the flush starts as the last byte is written.  The size and
    CRC32C copied must be those the save recorded (else the node file was
    damaged in the burst buffer since: :class:`DamagedNodeFile`), and only then
    does HDF5 read the file: the commit needs its description (then it reads
    nothing on the PFS), which a thread reads from the BB copy during the
    flush and writes into the PFS record, under its temporary name; a file
    saved again before it is read shows the new save's time, never the old
    (one saved later, a new BB record, read again before the renames).  The
    record is renamed (:meth:`publish`) once the copy is durable, reads back
    right and is in place.
    """

    def __init__(
        self, task: Task, bb_record: dict[str, Any], drained: dict[str, Any] | None = None
    ) -> None:
        self.task, self.bb_record, self.drained = task, bb_record, drained
        self.temp = files.temp_path(task.target)
        self.written = self.temp  # where the bytes go: the final name, or the temporary one
        self.pool = ThreadPoolExecutor(2)  # the reader, the description; the read-back, the record
        self.reader: futures.Future | None = None  # the read-back's descriptor
        self.fd: int | None = None
        self.made: tuple[int, int] | None = None  # (device, inode) of a file made in place
        self.copied: _native.CopyResult | None = None
        self.pfs_record = drained  # as renamed into place on the PFS, once it is

    def copy(self) -> None:
        """Not collective: copy the bytes to the node file's final name if it is free, else
        to its temporary name."""

        def meanwhile() -> None:
            if self.task.verify == "cache":
                self.reader = self.pool.submit(files.open_for_verification, self.written)

        try:
            source = os.open(self.task.source, os.O_RDONLY)
        except OSError as exc:
            raise from_oserror(exc, "open for reading", self.task.source) from None
        try:
            self.fd, self.written = _create_copy(self.task.target, self.temp)
            if self.written == self.task.target:
                made = os.fstat(self.fd)
                self.made = made.st_dev, made.st_ino
            self.copied = _native.copy_whole(
                source,
                self.fd,
                src_path=self.task.source,
                dst_path=self.written,
                checksum=True,
                sequential=True,
                on_open=meanwhile,
            )
        finally:
            os.close(source)

    def abandon(self) -> None:
        """Not collective: give the copy up (its temporary files are deleted, and a file
        it made at the final name if that name is still that file's: not a later save's
        renamed there since)."""
        self.pool.shutdown()
        self._close()
        _discard(self.temp, files.temp_path(self.task.pfs_record))
        with contextlib.suppress(OSError):
            now = self.task.target.stat()
            if (now.st_dev, now.st_ino) == self.made:
                self.task.target.unlink()

    def _close(self) -> None:
        fds = [self.fd]
        if self.reader is not None and self.reader.done() and self.reader.exception() is None:
            fds.append(self.reader.result())
        self.fd = self.reader = None
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def finish(self, journal: Path, publish: bool = True) -> dict[str, Any] | None:
        """Flush the copy, read it back, write the PFS record durably meanwhile, and rename
        the copy into place if it is not there, then (``publish``; else the caller's
        :meth:`publish`) the record; record it on the BB (under :func:`records_locked`):
        the node's record, or None if the file was saved again meanwhile (then its new
        save's drain replaces whatever was renamed).  Not collective."""
        if self.drained is not None:
            return self.drained
        try:
            record = self._seal(journal)
        except BaseException:
            self.abandon()
            raise
        if record is None:
            self.abandon()
            return None
        self.pool.shutdown()
        with records_locked(journal):
            if not _still_saved(self.task):
                return None  # saved again during the renames: the new save's record stays
            drained = {**self.bb_record, **record, "complete": True}
            files.write_json_atomic(self.task.bb_record, drained)
        if publish:
            self.publish()
        return record

    def _seal(self, journal: Path) -> dict[str, Any] | None:
        task, copied = self.task, self.copied
        assert copied is not None, "finish() before copy()"
        saved = self.bb_record.get("size"), self.bb_record.get("file_crc32c")
        if saved[1] is not None and saved != (copied.nbytes, copied.crc32c):
            if not _still_saved(task):
                return None  # saved again during the copy: not this save's file
            raise DamagedNodeFile(
                f"the node file was copied as {copied.nbytes} bytes, CRC32C "
                f"{copied.crc32c:08x}; its save wrote {saved[0]} bytes, {saved[1]:08x}",
                path=task.source,
                hint=DAMAGED_SINCE_SAVE,
            )
        recording = self.pool.submit(_prepare_record, task, copied)
        try:
            size, crc = self._flush_and_read_back()
        finally:
            futures.wait([recording])  # its file is written, or never will be
        try:
            record, contents = recording.result()
        except (OSError, KeyError, ValueError, TypeError, IntegrityError) as exc:
            if not _still_saved(task) or not task.source.exists():
                return None  # saved again or dropped meanwhile: not this save's file
            if isinstance(exc, OSError) and exc.errno is not None:
                raise  # an I/O error of the device: tried again
            raise DamagedNodeFile(  # h5py's errno-less errors, missing or bad attributes
                f"the node file cannot be read as a checkpoint: {exc!r}",
                path=task.source,
                hint="it is damaged: this save cannot be drained (it is set aside; later "
                "ones are drained); a restore passes over it",
            ) from None
        if size != copied.nbytes or crc != copied.crc32c:
            raise IntegrityError(
                f"the copy reads back as {size} bytes, CRC32C {crc:08x}; "
                f"{copied.nbytes} bytes, {copied.crc32c:08x} were written",
                path=self.written,
                hint="the PFS may be failing; the drain will copy it again",
            )
        renaming = self.written != task.target
        # a save drops the BB record under the lock before it writes: never renamed after
        with records_locked(journal) if renaming else contextlib.nullcontext():
            if not task.is_save_of(contents) or not _still_saved(task):
                return None  # saved again during the copy: never renamed over the new file
            if renaming:  # the commit fsyncs the directory before its manifest
                files.rename_sealed([task.target])
        self.pfs_record = {**record, "contents": contents}
        return record

    def publish(self) -> bool:
        """Rename the node's PFS record into place (durable under its temporary name since
        :meth:`finish`), see :func:`_publish`; False if the step was saved again since.
        Not collective."""
        return self.drained is not None or _publish(self.task)

    def _flush_and_read_back(self) -> tuple[int, int]:
        """fsync the copy on the descriptor that wrote it and read it back: its (size,
        CRC32C).

        ``ckpt_verify`` "cache": through the client cache, on the descriptor
        opened during the copy, in a thread during the fsync (both release the
        GIL), so it costs no time when the flush is the slower; "device": after
        the fsync, with the cached pages dropped.
        """
        fd = self.fd
        assert fd is not None, "flushed twice"
        try:
            if self.task.verify == "device":
                _fsync(fd, self.written)
                return files.checksum_file(self.written, drop_cache=True)
            assert self.reader is not None
            reader = self.reader.result()
            reading = self.pool.submit(files.checksum_fd, reader, self.written)
            try:
                _fsync(fd, self.written)
            finally:
                futures.wait([reading])
            return reading.result()
        finally:
            self._close()


def _publish(task: Task) -> bool:
    """Rename ``task``'s PFS record into place from its temporary name: the other nodes'
    drains see the file drained.  Not if the step was saved again since (its BB record
    is gone or another save's): that save's copy puts its own record there, and this
    one, renamed after, would replace it; the temporary record is deleted, and False
    returned.  Under :func:`records_locked`, which a save holds while it drops the
    step's BB record, before anything of the new save is written.  Not collective."""
    with records_locked(journal_dir(Path(task.bb_step_dir).parent)):
        if _still_saved(task):
            files.rename_sealed([task.pfs_record])
            return True
    _discard(files.temp_path(task.pfs_record))
    return False


def _create_copy(final: Path, temp: Path) -> tuple[int, Path]:
    """Create the file a node file is copied into: (its descriptor, its path).  At the
    final name if no file is there, else under the temporary name (truncated)."""
    try:
        return os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), final
    except FileExistsError:
        pass
    except OSError as exc:
        raise from_oserror(exc, "create", final) from None
    try:
        return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), temp
    except OSError as exc:
        raise from_oserror(exc, "create", temp) from None


def _fsync(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise from_oserror(exc, "fsync", path) from None


def _prepare_record(
    task: Task,
    copied: _native.CopyResult,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Describe ``task``'s node file in the burst buffer (its copy checked first to hold
    the bytes its save recorded) and write its PFS record, of the ``copied`` size and
    CRC32C and those contents, under its temporary name, durably: (record, contents)."""
    contents = describe_node_file(task.source, task.node)
    record = {
        "size": copied.nbytes,
        "crc32c": copied.crc32c,
        "node": task.node,
        "time": contents["time"],
    }
    document = json.dumps({**record, "contents": contents}, separators=(",", ":"))
    files.write_temp(task.pfs_record, document.encode())
    return record, contents


def _discard(*temps: Path) -> None:
    """Delete temporary files that will not be renamed (best effort: a retry rewrites
    them, and a later run's cleanup finds them by name)."""
    for temp in temps:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)


# --------------------------------------------------------------- committing


def _lock_owner(lock: Path) -> dict[str, Any]:
    """Who holds the commit lock ``lock``: its owner's host, pid, start and the time it
    took the lock, as the lock says ({} if it cannot say).  Not collective."""
    try:
        owner = json.loads(os.readlink(lock))
    except (OSError, ValueError):  # gone, or not a lock bbio made
        return {}
    return owner if isinstance(owner, dict) else {}


def _lock_is_stale(lock: Path) -> bool:
    """Is the commit lock left by a committer that died?  One of this host is judged by
    its owner's process; one of another host, or one that names no owner, by its age."""
    owner = _lock_owner(lock)
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return not _process_alive(owner["pid"], owner.get("started"))
    try:
        return time.time() - lock.lstat().st_mtime > STALE_LOCK_SECONDS
    except FileNotFoundError:
        return True


def _remove_if_stale(lock: Path) -> bool:
    """Remove the commit lock ``lock`` if it is stale (:func:`_lock_is_stale`); True once
    it is gone (here, or by another committer), False if a live one holds it."""
    try:
        judged = os.readlink(lock)
    except FileNotFoundError:
        return True
    except OSError:
        judged = None  # not a link: stale by its age alone
    if not _lock_is_stale(lock):
        return False
    return _remove_if_still(lock, judged)


def _remove_if_still(lock: Path, judged: str | None) -> bool:
    """Remove ``lock`` if it is still the link to ``judged`` (the lock judged stale): it is
    moved aside first, and put back if it is another (of two committers that judged one
    stale lock at once, the second removed the lock the first had just taken, and both
    committed).  True once the judged lock is gone.  Not collective."""
    aside = files.unique_temp_path(lock)
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return True  # another committer removed it
    try:
        moved = os.readlink(aside)
    except OSError:
        moved = None
    if moved != judged:  # a lock taken since, by a live committer: given back
        os.rename(aside, lock)
        return False
    aside.unlink(missing_ok=True)
    return True


def _take_commit_lock(step_dir: Path) -> Path | None:
    """The commit lock of ``step_dir``, or None if a live committer holds it.  The lock
    is a symbolic link whose target names its owner (:func:`_lock_owner`): made with its
    owner in one PFS call, never seen without one."""
    lock = step_dir / COMMIT_LOCK
    owner = json.dumps({**_identity(), "time": time.time()}, separators=(",", ":"))
    for _ in range(2):
        try:
            os.symlink(owner, lock)
        except FileExistsError:
            if not _remove_if_stale(lock):
                return None
            continue
        except OSError as exc:
            raise from_oserror(exc, "take the commit lock", lock) from None
        return lock
    return None


def try_commit(
    step_dir: Path,
    nodes: int,
    known: dict[int, dict[str, Any] | None] | None = None,
    on_commit: Callable[[], object] = lambda: None,
    patience: float = COMMIT_PATIENCE_SECONDS,
    known_current: Callable[[], bool] = lambda: True,
) -> bool:
    """Commit the checkpoint in ``step_dir`` if every node's file of one save is there.

    Idempotent.  Returns True if it is committed (now or before).  Records of
    different saves of the step (saved again while draining) are not committed
    together, and a manifest of an older save is replaced; nor are files saved
    by another node count than ``nodes`` (a later job's ``target.json``).  PFS
    retention is the caller's next step (:func:`apply_pfs_retention`), once it
    has said so.  ``known``: node records the caller has (not read on the PFS:
    just renamed into place, or durable under their temporary names and renamed
    after).  ``on_commit`` is called once the step is known to be
    committed, before this call gives its commit lock up: a drain reports the
    commit that much sooner.  A commit lock another committer holds is waited
    on for up to ``patience`` seconds: that one commits (then so is this save),
    gives the lock up, or dies and leaves it stale (see :func:`_lock_is_stale`),
    and then this call looks at the records again and commits; False if the lock
    is still held at ``patience``.  Under the lock, while ``global.h5`` and the
    manifest are written, the records read on the PFS are read again, and
    ``known_current`` says whether the ``known`` ones are still of the save: a
    save of the step made again uncommits it under the same lock
    (:func:`uncommit`), and the manifest of the older save is then never renamed
    into place (False).
    """
    known = known or {}
    deadline = time.monotonic() + patience
    pause = 0.005
    documents: tuple[float | None, tuple[bytes, dict[str, Any]]] | None = None
    while True:
        records = [
            known.get(n) or files.read_json(step_dir / layout.node_record_name(n))
            for n in range(nodes)
        ]
        if any(r is None for r in records):
            return False
        saves = {r.get("time") for r in records}
        if len(saves) != 1:
            return False  # a node has not drained the latest save yet
        if {(r.get("contents") or {}).get("nodes", nodes) for r in records} != {nodes}:
            return False  # saved by another node count (a later job's target): its own drains
        save = saves.pop()
        if documents is None or documents[0] != save:  # built once a save, not once a look
            documents = save, _commit_documents(step_dir, nodes, records)
        view, manifest = documents[1]
        lock = _take_commit_lock(step_dir)
        if lock is not None:
            break
        if committed_save(step_dir, save):  # another node's drain committed it
            on_commit()
            return True
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)  # until the lock's owner commits, lets it go, or is found dead
        pause = min(pause * 2, 1.0)

    def records_unchanged() -> bool:
        for n in range(nodes):
            if n in known:
                continue
            now = files.read_json_if_sound(step_dir / layout.node_record_name(n))
            if now is None or now.get("time") != save:
                return False
        return known_current()

    try:
        committed = _write_view_then_manifest(step_dir, view, manifest, save, records_unchanged)
        if committed:
            on_commit()
    finally:
        lock.unlink(missing_ok=True)
    return committed


def _commit_documents(
    step_dir: Path, nodes: int, records: list[dict[str, Any]]
) -> tuple[bytes, dict[str, Any]]:
    """``global.h5`` (its bytes) and the manifest of the checkpoint in ``step_dir`` whose
    node ``records`` are all there."""
    contents = [
        r.get("contents") or describe_node_file(step_dir / layout.node_filename(n), n)
        for n, r in enumerate(records)
    ]
    meta = merge_descriptions(contents, step_dir)
    view, view_crc = global_view(meta)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": meta["step"],
        "time": meta["time"],
        "ranks": meta["ranks"],
        "nodes": nodes,
        "layout": meta["layout"],
        "rank_nodes": meta["rank_nodes"],
        "global_shapes": meta["global_shapes"],
        "attrs": meta["user_attrs"],
        "bbio": meta["bbio"],
        "files": [
            {"path": layout.node_filename(n), **_file_entry(records[n])} for n in range(nodes)
        ]
        + [{"path": GLOBAL_VIEW, "size": len(view), "crc32c": view_crc}],
    }
    return view, manifest


def _write_view_then_manifest(
    step_dir: Path,
    view: bytes,
    manifest: dict[str, Any],
    save: float | None,
    records_unchanged: Callable[[], bool],
) -> bool:
    """Under the commit lock: write ``global.h5`` and the manifest durably at once, the
    manifest under a temporary name of its own (a committer that took a lock judged
    stale never shares it), ``global.h5`` at its final name if no file is there (it
    counts for nothing without a manifest), else under a temporary name of its own;
    fsync the checkpointer's directory (the step's entry in it), and meanwhile read the
    manifest in place and check ``records_unchanged``.  Unless that one is of this
    ``save`` already (then the new files are dropped: True), or the records changed
    (the step was uncommitted to be saved again: the new files are dropped, False),
    remove it (of an older save, or damaged), rename ``global.h5`` if it is not in
    place, fsync the step's directory (in the writing thread for one made in place),
    and rename the manifest last: True."""
    document = json.dumps(manifest, separators=(",", ":")).encode()
    view_temp = files.unique_temp_path(step_dir / GLOBAL_VIEW)
    manifest_temp = files.unique_temp_path(manifest_path(step_dir))
    try:
        with ThreadPoolExecutor(2) as pool:
            view_write = pool.submit(_write_view, step_dir, view, view_temp)
            manifest_write = pool.submit(_write_with_entry, manifest_temp, document, step_dir)
            try:
                in_place, current = _manifest_in_place(step_dir)
                unchanged = records_unchanged()
            finally:
                futures.wait([view_write, manifest_write])
            made_in_place = view_write.result()
            manifest_write.result()
        if current is not None and current.get("time") == save:
            _discard(view_temp, manifest_temp)  # committed before, by a committer now gone
            return True
        if not unchanged:
            _discard(view_temp, manifest_temp)
            return False
        if in_place:
            manifest_path(step_dir).unlink(missing_ok=True)
        if not made_in_place:
            files.rename_durably(view_temp, step_dir / GLOBAL_VIEW)
        files.rename_durably(manifest_temp, manifest_path(step_dir))
    except BaseException:
        _discard(view_temp, manifest_temp)
        raise
    return True


def _write_view(step_dir: Path, view: bytes, temp: Path) -> bool:
    """Write ``global.h5`` durably at its final name if no file is there, then fsync
    ``step_dir`` (its entry, and the node files' made before it, durable before the
    manifest's rename): True; else under ``temp``: False."""
    if files.create_durably(step_dir / GLOBAL_VIEW, view):
        files.fsync_dirs([step_dir])
        return True
    files.write_durably(temp, view)
    return False


def _write_with_entry(path: Path, data: bytes, step_dir: Path) -> None:
    """Write ``data`` durably to ``path``, then fsync the directory above ``step_dir``
    (the step's own entry, made by a mkdir)."""
    files.write_durably(path, data)
    files.fsync_dirs([step_dir.parent])


def _manifest_in_place(step_dir: Path) -> tuple[bool, dict[str, Any] | None]:
    """Is there a manifest in ``step_dir``, and the sound one it is (None if damaged or
    not a manifest)?  Not collective."""
    try:
        document = read_manifest(step_dir)
    except IntegrityError:
        return True, None
    return document is not None, document


def committed_save(step_dir: Path, save: float | None = None) -> bool:
    """Is ``step_dir`` committed, by the save of time ``save`` (None: any save)?  Not with
    a damaged manifest: a commit replaces it, as it does one of an older save.  Not
    collective."""
    manifest = _sound_manifest(step_dir)
    return manifest is not None and (save is None or manifest.get("time") == save)


def uncommit(step_dir: Path, nodes: int, patience: float = COMMIT_PATIENCE_SECONDS) -> None:
    """Uncommit the step in ``step_dir`` for a save of it made again: remove its manifest, a
    damaged save's marker and ``nodes`` nodes' records, under its commit lock, so that no
    commit of the older save lands after (:func:`try_commit` reads the records again
    under the lock).  A lock a live committer holds is waited on for up to
    ``patience`` seconds.  Not collective."""
    if not step_dir.is_dir():
        return
    deadline = time.monotonic() + patience
    pause = 0.005
    while (lock := _take_commit_lock(step_dir)) is None:
        if time.monotonic() + pause > deadline:
            raise BBIOTimeoutError(
                f"cannot replace the checkpoint: another process held its commit lock for "
                f"{patience:.0f} s",
                path=step_dir / COMMIT_LOCK,
                hint="see which host and process the lock names ('readlink' it); once "
                "that one is gone, save the step again",
            )
        time.sleep(pause)
        pause = min(pause * 2, 1.0)
    try:
        manifest_path(step_dir).unlink(missing_ok=True)
        damaged_on_pfs(step_dir).unlink(missing_ok=True)
        for n in range(nodes):
            (step_dir / layout.node_record_name(n)).unlink(missing_ok=True)
    finally:
        lock.unlink(missing_ok=True)


def _sound_manifest(step_dir: Path) -> dict[str, Any] | None:
    """The committed manifest of ``step_dir``; None without one, or with a damaged one."""
    try:
        return read_manifest(step_dir)
    except IntegrityError:
        return None


def _file_entry(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k in ("size", "crc32c", "node")}


def steps_in(ckpt_dir: Path) -> list[int]:
    """Steps with a directory under a checkpoint directory (committed or not), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(s for e in ckpt_dir.iterdir() if (s := layout.parse_step(e.name)) is not None)


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps with a committed manifest under a PFS checkpoint directory, oldest first.

    A step whose manifest is damaged is not committed: restore passes over it,
    retention neither counts nor removes it, and its BB copies are kept.
    """
    return sorted(committed_saves(ckpt_dir))


def newest_committed_step(ckpt_dir: Path, at_least: int | None = None) -> int | None:
    """The newest step with a committed manifest under a PFS checkpoint directory, looking
    no lower than ``at_least``; None if there is none.  Manifests are read newest first,
    up to the first sound one (a damaged one does not count, as in
    :func:`committed_steps`): one or two for a drain's trim, not one per step kept.
    Not collective."""
    for step in reversed(steps_in(ckpt_dir)):
        if at_least is not None and step < at_least:
            break
        if _sound_manifest(ckpt_dir / layout.step_dirname(step)) is not None:
            return step
    return None


def committed_saves(ckpt_dir: Path) -> dict[int, Any]:
    """{step: the committed save's time} of a PFS checkpoint directory (as
    :func:`committed_steps`).  Not collective."""
    saves = {}
    if ckpt_dir.is_dir():
        for entry in ckpt_dir.iterdir():
            step = layout.parse_step(entry.name)
            manifest = None if step is None else _sound_manifest(entry)
            if manifest is not None:
                saves[step] = manifest.get("time")
    return saves


def describe_pfs(pfs_ckpt_dir: Path) -> tuple[dict[int, str], dict[int, Any]]:
    """Steps on the PFS: committed, draining (some node files there), "damaged manifest"
    (not valid JSON), "damaged node N" (node N's file of the step's latest save is
    damaged: set aside, never committed) or "damaged task N" (node N's drain task file
    of it is damaged: set aside, its files whole); and the committed saves' times, as
    :func:`committed_saves` (each manifest is read once).  Not collective."""
    states: dict[int, str] = {}
    saves: dict[int, Any] = {}
    for step in steps_in(pfs_ckpt_dir):
        step_dir = pfs_ckpt_dir / layout.step_dirname(step)
        try:
            manifest = read_manifest(step_dir)
        except IntegrityError:
            states[step] = "damaged manifest"
            continue
        damaged = None if manifest else read_damaged(step_dir)
        if damaged is not None:
            what = "task" if damaged.get(TASK_DAMAGED) else "node"
            states[step] = f"damaged {what} {damaged.get('node')}"
        else:
            states[step] = "committed" if manifest else "draining"
        if manifest is not None:
            saves[step] = manifest.get("time")
    return states, saves


def apply_pfs_retention(ckpt_dir: Path, keep: int) -> list[int]:
    """Delete committed checkpoints older than the ``keep`` newest, and the directories of
    steps older than those that were never committed (a save killed after some nodes'
    files were copied: retention would delete them the moment they were committed, and
    a drain still trying one retires it, :func:`_retired`).  A step directory with a
    manifest (damaged) or another node's damaged-file marker is kept, for the admin.
    Returns the steps removed.

    Each one's directory is first renamed to a hidden name of its own
    (``.retiring-step-...``; then the checkpointer's directory is fsynced), so
    a checkpoint is whole or gone, never half deleted (nor, for a drain killed
    while deleting, left as a step that is not committed), then deleted, with
    whatever such directories drains killed earlier left.  Several nodes'
    drains may apply it at once (each that sees the commit): a directory
    another one renamed or deleted meanwhile is not an error.  Not collective.
    """
    removed = []
    committed = committed_steps(ckpt_dir)
    retiring = committed[:-keep] if keep > 0 else []
    if keep > 0 and len(committed) >= keep:
        retiring += [
            step
            for step in steps_in(ckpt_dir)
            if step < committed[-keep] and _abandoned(ckpt_dir / layout.step_dirname(step))
        ]
    for step in sorted(retiring):
        step_dir = ckpt_dir / layout.step_dirname(step)
        try:
            os.rename(step_dir, ckpt_dir / f"{RETIRING}{step_dir.name}.{files.unique_tag()}")
        except FileNotFoundError:
            continue  # retired by another drain meanwhile
        except OSError as exc:
            raise from_oserror(exc, "retire the checkpoint", step_dir) from None
        removed.append(step)
    if removed:
        files.fsync_dirs([ckpt_dir])  # gone for good before any of its files is
        for entry in ckpt_dir.iterdir():
            if entry.name.startswith(RETIRING):
                _remove_tree(entry)
    return removed


def _abandoned(step_dir: Path) -> bool:
    """A PFS step directory (a real one: not a file or a symlink named like it) with
    neither a manifest nor a damaged-file marker: never committed, nothing kept for the
    admin.  Not collective."""
    if not files.is_real_dir(step_dir):
        return False
    return not manifest_path(step_dir).exists() and not damaged_on_pfs(step_dir).exists()


def _remove_tree(path: Path) -> None:
    """Remove ``path`` and everything below it, never following a symlink (``path`` itself
    included); what another process removes meanwhile is passed over.  Not collective."""
    if not files.is_real_dir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    for top, dirs, names in os.walk(path, topdown=False):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(top, name))
        for name in dirs:
            child = os.path.join(top, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.islink(child):
                    os.unlink(child)
                else:
                    os.rmdir(child)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


# ------------------------------------------------------------------ the loop


def trim_bb(
    bb_ckpt_dir: Path,
    node: int,
    keep: int,
    pfs_ckpt_dir: Path,
    journal: Path,
    recycle: bool = True,
) -> int:
    """Delete ``node``'s oldest BB copies beyond the ``keep`` newest, once safe.

    A copy goes only when this node's drain has copied it to the PFS (its BB
    record carries the PFS copy's CRC32C) or found its step retired by PFS
    retention (``retired``), it is not queued in ``journal``, and
    that step or a newer one is committed on the PFS (the copy is then not the
    only complete one; retention may already have dropped the step itself).  A
    copy just written, or one still draining, is never touched.  With
    ``recycle``, a copy whose record names its layout key (``ckpt_recycle``)
    leaves its file behind as the node's one spare instead, for the next save
    of that layout to rewrite in place, while the file is within the record's
    ``max_bytes`` (rewrites grow it a little).  Not collective: the node's
    drain calls it after each task, and a save calls it (without ``recycle``)
    when the burst buffer is short of room.  The PFS is looked at only when
    there are copies beyond ``keep``, and then for its newest committed step
    (:func:`newest_committed_step`), or when a step directory holds no record (below).
    Returns how many are left beyond it.

    A node file (or temporary file) without a record, of a step older than both
    this node's newest recorded copy and the newest committed step, and not
    queued, is deleted too: a save killed before it recorded the file left it,
    and nothing would ever restore, drain or trim it.
    """
    steps = steps_in(bb_ckpt_dir)
    record_name = layout.node_record_name(node)
    recorded = {s for s in steps if (bb_ckpt_dir / layout.step_dirname(s) / record_name).exists()}
    copies = sorted(recorded)
    surplus = copies[: max(len(copies) - keep, 0)]
    # a save killed before its record: its file (or temporary file) is nobody's
    unrecorded = [
        s
        for s in steps
        if s not in recorded
        and s < (copies or [-1])[-1]
        and files.is_real_dir(bb_ckpt_dir / layout.step_dirname(s))
    ]
    if not surplus and not unrecorded:
        return 0
    tasks, damaged = read_queue(journal)  # read after the listing
    queued = {t.step for t in tasks} | set(damaged)  # a damaged task's copy is kept
    aside = set_aside(journal)  # damaged: kept for the admin, and not waited for
    newest = newest_committed_step(pfs_ckpt_dir, at_least=min(surplus + unrecorded))
    for step in unrecorded:
        if newest is not None and step < newest and step not in queued and step not in aside:
            _drop_unrecorded(bb_ckpt_dir / layout.step_dirname(step), node)
    left = 0
    for step in surplus:
        if step in aside:
            continue
        step_dir = bb_ckpt_dir / layout.step_dirname(step)
        # a damaged record: kept for the admin, never trimmed
        record = files.read_json_if_sound(step_dir / layout.node_record_name(node)) or {}
        if record and record_problem(record) is not None:
            record = {}  # damaged too (not a record's fields): kept the same way
        drained = record.get("crc32c") is not None or record.get("retired") is True
        if not drained or step in queued or newest is None or newest < step:
            left += 1
            continue
        record_path, node_file = (step_dir / name for name in layout.node_copy_names(node))
        try:
            record_path.unlink(missing_ok=True)  # first: the copy is gone once its record is
            if not (recycle and _keep_as_spare(bb_ckpt_dir, node, node_file, record)):
                node_file.unlink(missing_ok=True)
        except OSError as exc:
            raise from_oserror(exc, "delete an old burst-buffer copy", node_file) from None
        with contextlib.suppress(OSError):
            step_dir.rmdir()
    return left


def _drop_unrecorded(step_dir: Path, node: int) -> None:
    """Delete ``node``'s file and temporary file of a save that never recorded them (killed
    in between), and the step's directory if that leaves it empty.  Not collective."""
    node_file = step_dir / layout.node_filename(node)
    try:
        for path in (node_file, files.temp_path(node_file)):
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise from_oserror(exc, "delete a burst-buffer file never recorded", node_file) from None
    with contextlib.suppress(OSError):
        step_dir.rmdir()


def _keep_as_spare(bb_ckpt_dir: Path, node: int, node_file: Path, record: dict[str, Any]) -> bool:
    """Make a trimmed node file the node's spare, if its record allows; True if kept."""
    spare = record.get("spare") or {}
    try:
        if not spare or node_file.stat().st_size > spare["max_bytes"]:
            return False
    except FileNotFoundError:
        return False
    drop_spares(bb_ckpt_dir, node)
    target = bb_ckpt_dir / layout.spare_filename(node, spare["layout_key"])
    try:
        os.replace(node_file, target)
    except OSError as exc:
        raise from_oserror(exc, "keep a trimmed burst-buffer file as the spare", target) from None
    return True


def spare_bytes(bb_ckpt_dir: Path, node: int) -> int:
    """Not collective: the bytes of ``node``'s spare files, room a save of that node may
    count as free."""
    total = 0
    for spare in bb_ckpt_dir.glob(layout.spare_pattern(node)):
        with contextlib.suppress(OSError):
            total += spare.stat().st_size
    return total


def drop_spares(bb_ckpt_dir: Path, node: int | None = None) -> None:
    """Not collective: delete ``node``'s spare files (every node's, for None).  A spare
    that another process claims or deletes meanwhile is simply gone."""
    for spare in bb_ckpt_dir.glob(layout.spare_pattern(node)):
        try:
            spare.unlink(missing_ok=True)
        except OSError as exc:
            raise from_oserror(exc, "delete a spare checkpoint file", spare) from None


def claim_spare(bb_ckpt_dir: Path, node: int, key: str, target: Path) -> bool:
    """Not collective (a node leader, before its node writes): move ``node``'s spare of
    layout ``key`` to ``target``; True if there was one.  The rename is atomic, so a
    drain trimming meanwhile either hands the file over or keeps it."""
    try:
        os.replace(bb_ckpt_dir / layout.spare_filename(node, key), target)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise from_oserror(exc, "take the spare checkpoint file", target) from None
    return True


def _trim_after(journal: Path, task: Task, recycle: bool = True) -> bool:
    """BB retention for ``task``'s node and checkpointer; True if copies are left to trim
    later (tolerates a vanished directory)."""
    bb_ckpt_dir, pfs_ckpt_dir = Path(task.bb_step_dir).parent, Path(task.pfs_step_dir).parent
    try:
        left = trim_bb(bb_ckpt_dir, task.node, task.keep_bb, pfs_ckpt_dir, journal, recycle)
        return left > 0
    except (OSError, BBIOError):
        return True


def _begin(journal: Path, task: Task, retry: bool = False) -> NodeCopy | None:
    """The first half of draining ``task``: its checks and the copy of its bytes (see
    :func:`start_copy`).  None if there is nothing to finish (done before, set aside,
    withdrawn, never recorded, retired, or saved again: its new task copies the new
    file); the caller reports it.  ``retry``: a try after a failed one, or of a task
    an earlier drain left (see :func:`_retired`)."""
    bb_record = task.bb_record
    if not task.source.exists() and files.read_json(bb_record) is None:
        if committed_save(Path(task.pfs_step_dir), task.save_time):
            _remove_task(journal, task)  # drained and committed before a crash: done
            return None
        if not task.is_queued_in(files.read_json(task_path(journal, task.step))):
            return None  # the save was withdrawn (it failed) or replaced: not damage
        gone = f"its burst-buffer copy is gone (no {task.source} nor its record)"
        _set_aside(journal, task, gone)  # never drainable; said, not retried for ever
        return None
    if _never_recorded(journal, task):
        return None
    if _retired(task, retry):
        _retire(journal, task)  # committed, then deleted by PFS retention since: done
        return None
    if retry and _superseded(task):
        _retire(journal, task)  # an earlier job's, its step saved again by a later job
        return None
    if not task.is_save_of(files.read_json(bb_record)):
        _not_copied(journal, task)  # saved again or withdrawn: before any mkdir on the PFS
        return None
    made = _make_step_dir(Path(task.pfs_step_dir))
    elsewhere = None if made else damaged_save(Path(task.pfs_step_dir), task.save_time)
    if elsewhere is not None:  # another node's file of this save is damaged: never commits
        why, node = str(elsewhere.get("why")), elsewhere.get("node")
        _set_aside(journal, task, why, node, task_damaged=bool(elsewhere.get(TASK_DAMAGED)))
        return None
    copying = start_copy(task)
    if copying is None:
        _not_copied(journal, task)
    return copying


def _never_recorded(journal: Path, task: Task) -> bool:
    """True if ``task``'s save never recorded this node's copy: the job was killed after
    the save queued the task and before it wrote the node's burst-buffer record.  The
    task is dropped, not set aside: that save never returned, and without its record no
    restore takes the copy, so no drain commits it either.  A save queues its task and
    writes its record under :func:`records_locked`, so a drain that finds no record
    takes that lock before it looks again.  Not collective."""
    bb_record = task.bb_record
    if files.read_json(bb_record) is not None:
        return False
    with records_locked(journal):
        if files.read_json(bb_record) is not None:
            return False
        removed = _unqueue(journal, task)
    if removed:
        _wake_waiters(journal)
    return True


def _make_step_dir(step_dir: Path) -> bool:
    """Create the PFS ``step_dir`` (and its parents) if it is missing.  True if this call
    made it: then no other node's damaged-file marker can be in it yet, and the drain
    need not look for one (a missing name is slow to look up on a PFS).  Not
    collective."""
    try:
        step_dir.mkdir(parents=True)
    except FileExistsError:
        return False
    except OSError as exc:
        raise from_oserror(exc, "create the checkpoint's directory", step_dir) from None
    return True


def _retired(task: Task, retry: bool = False) -> bool:
    """Has PFS retention passed ``task``'s step by?  Its directory is gone and ``keep_pfs``
    newer steps are committed (a retry of a step that other nodes committed and retention
    deleted since): copied again, it could never commit.  Looks at the PFS only for a
    ``retry`` or when this node has drained a newer step (its BB record holds the PFS
    CRC32C): never for a first try when the steps drain in order."""
    bb_ckpt_dir = Path(task.bb_step_dir).parent

    def drained(step: int) -> bool:
        record = bb_ckpt_dir / layout.step_dirname(step) / layout.node_record_name(task.node)
        return (files.read_json(record) or {}).get("crc32c") is not None

    try:
        later = (step for step in steps_in(bb_ckpt_dir) if step > task.step)
        if not retry and not any(drained(step) for step in later):
            return False
        step_dir = Path(task.pfs_step_dir)
        newer = [step for step in committed_steps(step_dir.parent) if step > task.step]
        return not step_dir.exists() and len(newer) >= task.keep_pfs
    except (OSError, BBIOError):
        return False  # copied again, as before


def _superseded(task: Task) -> bool:
    """Has a later save of ``task``'s step reached the PFS: committed there (its manifest)
    or on its way (the record there of the same node index: a later job's node file at
    the name this task would copy to)?  A task an earlier job left in this journal (its
    drain killed, this host not in the jobs since) whose step a later job saved again
    and drained: copied now, it would tear that job's committed checkpoint, or replace
    it with the older save.  Two PFS lookups, made only for a ``retry`` (see
    :func:`_begin`), whatever the number of nodes.  Not collective."""
    step_dir, saved = Path(task.pfs_step_dir), task.save_time
    if saved is None:  # a task of a bbio that did not say which save: copied, as before
        return False

    def later(document: dict[str, Any] | None) -> bool:
        when = (document or {}).get("time")
        return isinstance(when, (int, float)) and when > saved

    try:
        if later(_sound_manifest(step_dir)):
            return True
        return later(files.read_json_if_sound(step_dir / layout.node_record_name(task.node)))
    except OSError:
        return False  # copied, as before


def _complete(journal: Path, task: Task, commits: _Commits, copying: NodeCopy) -> bool:
    """The second half of draining ``task``: make its copy durable, verify it and put it
    in place, commit the checkpoint if this node is the last (before its own record is
    published: one rename sooner), publish the record (unless the step was saved again
    meanwhile), drop the copy from the page cache (if not committed here, the looking
    thread drops it once it sees the commit: not while another node commits), apply
    retention.  True if BB copies are left to trim once other nodes commit.  A commit
    lock another committer holds is not waited on: its owner commits, and should it
    die, :meth:`_Commits.look` finds its lock stale and commits instead.

    Left in the page cache, every drained checkpoint would hold a second copy
    of itself in the node's memory (a first one when the burst buffer is
    tmpfs) and push out the job's own pages.

    The commit is reported (``commits.settle``, naming its save) while the
    commit lock is held, before the lock is removed, the record published and the
    task taken out of the journal: the waiting ranks learn of it from the status
    (:func:`step_committed`) three PFS round trips sooner, and a drain killed in
    between leaves its task, which its replay finishes.
    """
    if copying.finish(journal, publish=False) is None:
        _not_copied(journal, task)
        return False
    set_aside_path(journal, task.step).unlink(missing_ok=True)  # of an earlier save, if any

    def commit() -> bool:
        return try_commit(
            Path(task.pfs_step_dir),
            task.nodes,
            {task.node: copying.pfs_record},
            on_commit=lambda: commits.settle(task, True),  # the waiting ranks learn of it now
            patience=0.0,  # a lock taken: its owner commits (or, gone, the looks take over)
            known_current=lambda: _still_saved(task),
        )

    try:
        committed = commit()  # the others' records are all there: this node is the last
    finally:
        published = copying.publish()  # also after a failed commit: for the others, the retry
    if not committed and published:  # not published: saved again, the new task drains it
        committed = commit()  # the others may have published meanwhile (its fsync covers ours)
        if not committed:
            files.fsync_dirs([Path(task.pfs_step_dir)])  # our renames durable before we leave
            commits.settle(task, False)
    _remove_task(journal, task)
    if committed:
        files.forget_cached_pages(task.target)  # once the waiting ranks know: off their path
        apply_pfs_retention(Path(task.pfs_step_dir).parent, task.keep_pfs)
    return _trim_after(journal, task)


def _still_saved(task: Task) -> bool:
    """Is ``task``'s save still the one its node's burst buffer records (not dropped, to be
    saved again, nor replaced by a new save's record)?  Not collective."""
    now = files.read_json(task.bb_record)
    return now is not None and task.is_save_of(now)


def _not_copied(journal: Path, task: Task) -> None:
    """``task``'s file was not copied because it is not of the task's save: saved again
    (its new task copies it), or, if the queued save is still this one, never will be."""
    if task.is_queued_in(files.read_json(task_path(journal, task.step))):  # not saved again
        _set_aside(journal, task, "its burst-buffer copy is not of the queued save")


def _remove_task(journal: Path, task: Task) -> None:
    """Remove ``task``'s journal entry, unless it now holds a newer save of the step; tell
    the waiting processes (a step that leaves the journal may be done)."""
    with records_locked(journal):  # not while a save of the step queues its own task
        removed = _unqueue(journal, task)
    if removed:
        _wake_waiters(journal)


def _retire(journal: Path, task: Task) -> None:
    """Drop ``task``, whose step PFS retention has passed by, and mark its burst-buffer
    record ``retired``: never to be drained, the copy is trimmed like a drained one
    once it is beyond ``keep_bb``, now and by later trims (before, it stayed in the
    burst buffer for good).  Not collective."""
    bb_record = task.bb_record
    with records_locked(journal):
        record = files.read_json(bb_record)
        if (
            record is not None
            and task.is_save_of(record)
            and task.is_queued_in(files.read_json(task_path(journal, task.step)))
        ):
            files.write_json_atomic(bb_record, {**record, "retired": True})
        removed = _unqueue(journal, task)
    if removed:
        _wake_waiters(journal)
        _trim_after(journal, task)


def _unqueue(journal: Path, task: Task) -> bool:
    """Under :func:`records_locked`: remove ``task``'s journal entry if it still queues
    ``task``'s save (a save of the step made since has queued its own); True if it did."""
    path = task_path(journal, task.step)
    if not task.is_queued_in(files.read_json(path)):
        return False
    path.unlink(missing_ok=True)
    return True


@dataclasses.dataclass(frozen=True)
class _Failure:
    """A task that failed: how often, the pause before its next try, when that is, why."""

    count: int
    backoff: float
    failed_at: float  # time.monotonic()
    retry_at: float  # time.monotonic()
    message: str


class _Commits:
    """What one drain knows of commits and failures, published in its status for
    waiting ranks.

    ``committed``: recent steps seen committed; ``awaiting``: steps this node
    drained whose commit waits on other nodes; ``failures``: tasks (by step and
    save) waiting to be tried again, the latest one's error reported until it
    succeeds; ``busy``: the tasks being drained (copied, or finished in the background),
    each with its previous failure; ``rest``: the state when none is (idle,
    retrying a step, stopped).
    :meth:`look` polls the PFS for
    the awaited ones: the one poller per node, on the thread of :meth:`looking`,
    so that no copy in the drain's loop holds it up.  Its pauses last a tenth
    of the time awaited so far, from 5 ms up to 50 ms, so a commit is seen at
    most about a tenth later than it happened, and a long wait costs the PFS
    20 looks a second.  It looks for another node's damaged-file marker at
    most every 50 ms: that is rare and no commit waits on it, while each look
    takes the PFS from the committing node.  Every 2 s, and not in the first 2 s
    of a wait, it commits an awaited step whose records are all there and whose
    commit lock is gone or stale (:func:`_commit_orphan`).  The drain's loop, its finishing
    thread and the looking thread share it: every method, and the loop's
    changes to ``failures``, hold ``lock``.
    """

    def __init__(self, journal: Path) -> None:
        self.journal = journal
        self.lock = threading.RLock()
        self.busy: dict[int, tuple[Task, _Failure | None]] = {}
        self.rest: dict[str, Any] = {"state": "idle"}
        self.awaiting: dict[int, Task] = {}
        self.committed: dict[int, float | None] = {}  # recent steps committed: their save
        self.failures: dict[tuple[int, float | None], _Failure] = {}
        self.damaged_elsewhere: dict[int, dict[str, Any]] = {}  # awaited, set aside by a node
        self.since = self.next_look = self.next_damaged_look = self.next_orphan_look = 0.0
        self.news = threading.Event()  # a step is awaited anew, or the looking stops

    def report(self, **rest: Any) -> None:
        """Write the status.  ``state``: "copying" while a task is drained (``step``: the
        latest begun, with ``error`` and ``retries`` of its previous try), else the
        ``rest`` state (when given, it replaces the last one); ``error`` and ``retries``
        otherwise of the latest failure still to retry; the steps failing, the steps
        set aside as damaged (with why) and the commits."""
        with self.lock:
            if rest:
                self.rest = rest
            latest = max(self.failures.values(), key=lambda f: f.failed_at, default=None)
            trouble = {"error": latest.message, "retries": latest.count} if latest else {}
            activity = self.rest
            if self.busy:
                task, failure = list(self.busy.values())[-1]
                retried = {"retries": failure.count, "error": failure.message} if failure else {}
                activity = {"state": "copying", "step": task.step, **retried}
            damaged = {**self.damaged_elsewhere, **set_aside(self.journal)}
            _write_status(
                self.journal,
                awaiting=sorted(self.awaiting),
                committed=list(self.committed),
                committed_saves={str(step): save for step, save in self.committed.items()},
                failing=sorted({step for step, _ in self.failures}),
                damaged={str(step): damaged[step] for step in sorted(damaged)},
                **{"error": None, "retries": 0, **trouble, **activity},
            )

    def begin(self, task: Task, failure: _Failure | None) -> None:
        """The drain takes ``task`` (``failure``: of its previous try, if any)."""
        with self.lock:
            self.busy[task.step] = (task, failure)
            self.report()

    def end(self, task: Task, **rest: Any) -> None:
        """``task`` is done with (drained, failed, set aside or dropped); ``rest``: the
        state to report once no task is busy (default idle)."""
        with self.lock:
            self.busy.pop(task.step, None)
            self.report(**(rest or {"state": "idle"}))

    def settle(self, task: Task, done: bool) -> None:
        """``task`` is drained: its step is committed (``done``) or awaits other nodes.
        Either way the awaited steps are looked for again soon."""
        with self.lock:
            self._forget(task.step)
            self.damaged_elsewhere.pop(task.step, None)  # of an earlier save of the step
            first = not self.awaiting
            if done:
                self._add(task.step, task.save_time)
            else:
                self.awaiting[task.step] = task
            self.report()
            self.since = time.monotonic()
            self.next_look = self.since + AWAIT_POLL_SECONDS[0]
            if first:  # the others are still copying: no look for an orphan before this
                self.next_orphan_look = self.since + ORPHAN_LOOK_SECONDS
        self.news.set()

    def look(self) -> None:
        """Poll the PFS for the awaited steps, if the pause since the last look is over."""
        now = time.monotonic()
        with self.lock:
            if not self.awaiting or now < self.next_look:
                return
            awaited = dict(self.awaiting)
        seen = {step for step, task in awaited.items() if _is_committed(task)}
        damaged = {}
        if now >= self.next_damaged_look:  # rare, and no commit waits on it: less often
            damaged = {
                step: marker
                for step, task in awaited.items()
                if step not in seen
                and (marker := damaged_save(Path(task.pfs_step_dir), task.save_time)) is not None
            }  # another node's file of this save is damaged
            self.next_damaged_look = now + AWAIT_POLL_SECONDS[1]
        orphans = set()  # committed by this look, of whichever save has every record there
        if now >= self.next_orphan_look:  # rarer still: a committer that died, or gave up
            orphans = {
                step
                for step, task in awaited.items()
                if step not in seen and step not in damaged and _commit_orphan(task)
            }
            seen |= orphans
            self.next_orphan_look = now + ORPHAN_LOOK_SECONDS
        with self.lock:
            still = {step for step, task in self.awaiting.items() if awaited.get(step) is task}
            for step in seen & still:
                self._forget(step)
                self._add(step, None if step in orphans else awaited[step].save_time)
            for step in damaged.keys() & still:
                self._forget(step)
                self.damaged_elsewhere[step] = damaged[step]
            settled = (seen | damaged.keys()) & still
            if settled:
                self.since = now
                self.report()
            pause = AWAIT_POLL_SHARE * (now - self.since)
            self.next_look = now + min(max(pause, AWAIT_POLL_SECONDS[0]), AWAIT_POLL_SECONDS[1])
        for step in settled:  # reported: now off the waiting ranks' path
            files.forget_cached_pages(awaited[step].target)

    def until_next_look(self) -> float | None:
        """Seconds until :meth:`look` has something to do (None when nothing is awaited)."""
        with self.lock:
            if not self.awaiting:
                return None
            return max(self.next_look - time.monotonic(), 0.0)

    @contextlib.contextmanager
    def looking(self) -> Iterator[None]:
        """Look for the awaited steps on a thread of its own while in this block."""
        stopping = False

        def look_until_stopped() -> None:
            while not stopping:
                try:
                    self.look()
                    pause = self.until_next_look()
                except Exception as exc:  # it outlives a failure (a status unwritten): said
                    print(f"bbio drain: looking for other nodes' commits: {exc}", file=sys.stderr)
                    pause = AWAIT_POLL_SECONDS[1]
                if self.news.wait(pause):
                    self.news.clear()

        looker = threading.Thread(target=look_until_stopped, name="bbio-drain-look", daemon=True)
        looker.start()
        try:
            yield
        finally:
            stopping = True
            self.news.set()
            looker.join(LOOKER_EXIT_SECONDS)  # a look stuck on a hung PFS holds no exit
            with self.lock:
                still_awaited = list(self.awaiting.values())
            for task in still_awaited:  # no look will see their commit: dropped now
                files.forget_cached_pages(task.target)

    def _forget(self, step: int) -> None:
        self.awaiting.pop(step, None)
        self.committed.pop(step, None)

    def _add(self, step: int, save: float | None) -> None:
        self.committed[step] = save  # the newest last: _forget took any earlier entry
        for old in list(self.committed)[:-RECENT_COMMITS]:
            del self.committed[old]


def _commit_orphan(task: Task) -> bool:
    """Commit ``task``'s step if every node's record is there and no live committer holds
    its commit lock (none there, or a stale one: the committer died, or failed and gave
    the lock up), then apply PFS retention; True if it is committed.  The drain that
    found the lock taken left the commit to its owner; this is the look that finds the
    owner gone.  Not collective; failures are left to the next look."""
    step_dir = Path(task.pfs_step_dir)
    try:  # a live owner's lock: try_commit leaves the step to it
        if not try_commit(step_dir, task.nodes, patience=0.0):
            return False
        apply_pfs_retention(step_dir.parent, task.keep_pfs)
    except (BBIOError, OSError) as exc:
        print(f"bbio drain: {step_dir}: not committed: {exc}", file=sys.stderr)
        return False
    return True


def _is_committed(task: Task) -> bool:
    """Is ``task``'s save committed?  (:func:`was_committed`)"""
    return was_committed(Path(task.pfs_step_dir), task.step, task.save_time)


def was_committed(step_dir: Path, step: int, save: float | None = None) -> bool:
    """Is ``step`` committed in ``step_dir`` (by the save of time ``save``; None: any)?
    Also when PFS retention has removed it since: its directory is gone and a newer
    step is committed.  False when the PFS cannot be read.  Not collective."""
    try:
        if committed_save(step_dir, save):
            return True
        if step_dir.exists():
            return False
        return newest_committed_step(step_dir.parent, at_least=step + 1) is not None
    except (OSError, BBIOError):
        return False


def step_committed(journal: Path, step: int, save: float | None = None) -> bool | None:
    """What this node's drain knows of ``step``: committed (True), not yet (False), or None.

    True as soon as the drain reports the step committed by the save of time
    ``save`` (before the drain is done with its task); else False while the step
    is queued (it may be a later save's), and None when the step is not in the
    journal and no drain is running to tell: only the PFS manifest can say then.
    Cheap (the journal is on the BB), so every waiting rank asks here and only
    the drain looks at the PFS.
    """
    if save is not None:
        reported = read_status(journal).get("committed_saves") or {}
        if reported.get(str(step)) == save:
            return True
    if task_path(journal, step).exists():
        return False
    status = read_status(journal)  # read after the task's look: a status at least as new
    if step in status.get("committed", ()):
        return True
    awaited = step in status.get("awaiting", ())
    alive = _process_alive(status.get("pid"), status.get("started"))
    if awaited and status.get("state") != STOPPED and alive:
        return False
    return None


_IDENTITY: dict[int, dict[str, Any]] = {}  # this process's, by pid (a fork has its own)


def _identity() -> dict[str, Any]:
    """Who this process is, for a lock or a status that others judge alive or dead.
    Read once per process (a status is written at every step of a drain, and a commit
    takes its lock, on its critical path), unless ``/proc`` could not say when it
    started: then asked again next time."""
    pid = os.getpid()
    known = _IDENTITY.get(pid)
    if known is None:
        known = {"pid": pid, "host": socket.gethostname(), "started": _started(pid)}
        if known["started"] is not None:
            _IDENTITY[pid] = known
    return dict(known)


def _started(pid: int) -> str | None:
    """When process ``pid`` started: the boot's ID and the clock ticks since boot (field 22
    of ``/proc/PID/stat``), which tell a process from a later one given its reused PID;
    None where ``/proc`` cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


def _process_alive(pid: int | None, started: str | None = None) -> bool:
    """Is process ``pid`` of this host running, and the one that started at ``started``
    (:func:`_started`; not checked when either side cannot say)?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _started(pid) if started else None
    return now is None or now == started


def is_draining(journal: Path) -> bool:
    """Does a drain hold ``journal`` (its lock) now?  Not collective."""
    return _held(journal / LOCK)


def has_waiting_drain(journal: Path) -> bool:
    """Is a background drain waiting to drain ``journal`` once the drain holding it
    leaves?  It drains whatever is queued by then.  Not collective."""
    return _held(journal / NEXT_LOCK)


def _held(lock: Path) -> bool:
    """Does a drain hold the ``flock`` on ``lock`` now?  Drains hold it exclusive; a look
    takes it shared for an instant, so that two looks at once (the ranks of a node) do
    not see each other as a drain."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False  # no journal yet: nothing drains it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases a lock taken here
    return False


def _lock_soon(fd: int, tries: int = 10) -> bool:
    """Take the ``flock`` on ``fd`` if it is free now or within ``tries`` short sleeps:
    a look (:func:`_held`) holds it for an instant."""
    for _ in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.01)
    return False


def run(
    journal: Path,
    parent: int | None,
    finish: bool,
    timeout: float | None,
    parent_started: str | None = None,
) -> int:
    """Drain ``journal`` until it is empty (and, in the background, until told to stop).

    Background mode (``finish`` False) exits once the queue is empty and the
    training process ``parent`` is gone (or a later process has its PID: one that did
    not start at ``parent_started``, :func:`_started`, when given) or has asked it to
    stop.  Finish mode
    exits when the queue is empty, or with status 1 at ``timeout``.  Returns
    the exit status.

    One drain per journal: a drain that finds another holding the journal waits
    for it to leave, then drains what is queued.  A background drain does not
    give up instead: the other one may be leaving (its queue was empty, its
    training process gone) and never see a task queued meanwhile, whose save
    would then wait for ever.  But one waiter is enough (it drains whatever was
    queued before it took the journal): a background drain that finds another
    waiting (holding ``NEXT_LOCK``) exits at once with status 0, so drains do
    not pile up behind one that cannot finish its queue.
    """
    journal.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(journal / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    next_fd = None if finish else os.open(journal / NEXT_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if next_fd is not None and not _lock_soon(next_fd):
            return 0  # the waiting drain drains what is queued now
        while True:  # one drainer per journal: wait for (or outlive) any other
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if finish else 0))
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() > deadline:
                    print(f"bbio drain: {journal} is held by another drain", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        if next_fd is not None:  # before the queue is read: a drain started now may leave
            os.close(next_fd)
            next_fd = None
        with contextlib.closing(_Waker(journal)) as waker:
            return _drain(journal, (parent, parent_started), finish, deadline, waker)
    finally:
        if next_fd is not None:
            os.close(next_fd)
        os.close(lock_fd)  # releases the lock


@dataclasses.dataclass
class _Finishing:
    """A task whose copy is being finished (:func:`_complete`) in the background."""

    task: Task
    failure: _Failure | None
    outcome: futures.Future


def _drain(
    journal: Path,
    parent: tuple[int | None, str | None],
    finish: bool,
    deadline: float | None,
    waker: _Waker,
) -> int:
    """The drain's loop: tasks in step order; one that fails is tried again after a
    backoff (1 s, doubling up to 30 s) while the others go on.  A save whose node
    file or task file is damaged is set aside (:func:`_set_aside`); in finish mode
    the drain then exits with status 1.

    Draining is a pipeline of two: while a thread finishes a task (the flush, the
    read-back, the renames and the commit, mostly waiting on the PFS), the loop
    copies the next task's bytes (mostly CPU), so a queue of checkpoints drains
    at the rate of the slower half, not of both in a row.  Never two tasks of
    one step at once, and the loop waits for the finishing task before it finishes
    another, before it idles and before it leaves.
    """
    untrimmed: Task | None = None  # the last task drained, while copies wait to be trimmed
    trimmed_at = announced_at = 0.0
    announced: set[tuple[int, float | None]] = set()  # saves set aside, their PFS marker there
    commits = _Commits(journal)
    inherited = {_task_key(t) for t in read_queue(journal)[0]}  # an earlier drain's, maybe tried
    failures = commits.failures
    finishing: _Finishing | None = None

    def failed(task: Task, failure: _Failure | None, exc: Exception) -> None:
        """``task`` failed: set aside if it never can be drained, else tried again later."""
        if isinstance(exc, DamagedNodeFile):  # never drainable: set aside, not retried
            _set_aside(journal, task, str(exc))
            commits.end(task)
            print(f"bbio drain: {exc} (set aside, not retried)", file=sys.stderr)
            return
        count = failure.count + 1 if failure else 1
        backoff = min(failure.backoff * 2, MAX_BACKOFF_SECONDS) if failure else 1.0
        message = _describe_failure(exc, task)
        now = time.monotonic()
        retry_at = now + backoff
        if deadline is not None and now < deadline:  # a last try at the deadline, not before
            retry_at = min(retry_at, deadline)
        with commits.lock:
            failures[_task_key(task)] = _Failure(count, backoff, now, retry_at, message)
        commits.end(task, state="retrying", step=task.step)
        print(f"bbio drain: {message} (retry {count} in {retry_at - now:.0f} s)", file=sys.stderr)

    def finished() -> None:
        """Wait for the finishing task, if any, and take its outcome: copies left to trim,
        or its failure."""
        nonlocal finishing, untrimmed, trimmed_at
        if finishing is None:
            return
        task, failure, outcome = finishing.task, finishing.failure, finishing.outcome
        finishing = None
        try:
            untrimmed = task if outcome.result() else None
        except Exception as exc:  # the drain outlives any one failure, and says why
            failed(task, failure, exc)
        else:
            trimmed_at = time.monotonic()
            commits.end(task)

    commits.report()
    with (
        commits.looking(),
        ThreadPoolExecutor(1, thread_name_prefix="bbio-drain-finish") as finisher,
    ):
        while True:
            if finishing is not None and finishing.outcome.done():
                finished()
            if time.monotonic() - announced_at > IDLE_TRIM_SECONDS:  # busy or not
                _announce_set_aside(journal, announced)
                announced_at = time.monotonic()
            tasks, damaged = read_queue(journal)
            for step, why in damaged.items():  # never drainable: set aside, not retried
                done = _set_aside_damaged_task(journal, step, why)
                if done == "set aside":
                    print(f"bbio drain: {why} (set aside, not retried)", file=sys.stderr)
                elif done == "removed":
                    print(f"bbio drain: {why} (removed: its save is committed)", file=sys.stderr)
            if damaged:
                commits.report()
            with commits.lock:
                for gone in set(failures) - {_task_key(t) for t in tasks}:
                    del failures[gone]  # removed, or saved again: a new task
            if finishing is not None:
                tasks = [t for t in tasks if t.step != finishing.task.step]
            now = time.monotonic()
            ready = [t for t in tasks if now >= getattr(failures.get(_task_key(t)), "retry_at", 0)]
            if not ready and finishing is not None:  # until it is done, or a task comes
                if finishing.outcome.done():
                    finished()
                else:
                    waker.pause(POLL_SECONDS)
                continue
            if not tasks:
                now = time.monotonic()
                if untrimmed is not None and now - trimmed_at > IDLE_TRIM_SECONDS:
                    if not _trim_after(journal, untrimmed):  # other nodes may have committed
                        untrimmed = None
                    trimmed_at = now
                if finish or _asked_to_stop(journal) or not _process_alive(*parent):
                    _announce_set_aside(journal, announced)  # a last try before leaving
                    if untrimmed is not None:
                        _trim_after(journal, untrimmed, recycle=False)
                    with contextlib.suppress(BBIOError):  # no save will come to reuse them
                        drop_spares(journal.parent)
                    commits.report(state=STOPPED)
                    aside = set_aside(journal) if finish else {}
                    for step, marker in sorted(aside.items()):
                        print(
                            f"bbio drain: step {step} set aside: {marker.get('why')}",
                            file=sys.stderr,
                        )
                    return 1 if aside else 0
                waker.pause(POLL_SECONDS)
                continue
            if not ready:  # every task waits for its next try
                soonest = min(failures[_task_key(t)].retry_at for t in tasks)
                if deadline is not None and soonest > deadline:
                    _announce_set_aside(journal, announced)
                    return 1
                waker.pause(min(POLL_SECONDS, max(soonest - now, 0.001)))
                continue
            task = ready[0]
            with commits.lock:
                failure = failures.pop(_task_key(task), None)
            commits.begin(task, failure)
            try:
                copying = _begin(journal, task, failure is not None or _task_key(task) in inherited)
            except Exception as exc:  # the drain outlives any one failure, and says why
                copying = None
                failed(task, failure, exc)
            else:
                if copying is None:  # nothing to finish
                    untrimmed, trimmed_at = None, time.monotonic()
                    commits.end(task)
            try:
                finished()  # one task finishing at a time
            except BaseException:  # interrupted: the copy is not handed on
                if copying is not None:
                    copying.abandon()
                raise
            if copying is not None:
                outcome = finisher.submit(_complete, journal, task, commits, copying)
                outcome.add_done_callback(lambda _: waker.ring())
                finishing = _Finishing(task, failure, outcome)
            if deadline is not None and time.monotonic() > deadline:
                finished()
                _announce_set_aside(journal, announced)
                return 1


def _set_aside(
    journal: Path, task: Task, why: str, node: int | None = None, task_damaged: bool = False
) -> None:
    """Set ``task``'s save aside because ``node``'s file of it (default: this node's) is
    damaged (``task_damaged``: its drain task file, its node file whole): a marker beside
    its task (which a new save of the step replaces, and the marker then no longer
    matches), and, unless there is one, one on the PFS for the other nodes' drains (if
    that fails, tried again every second and before the drain exits)."""
    marker = {"time": task.save_time, "why": why, "node": task.node if node is None else node}
    if task_damaged:
        marker[TASK_DAMAGED] = True
    files.write_json_atomic(set_aside_path(journal, task.step), marker)
    _tell_other_nodes(task, marker)


def _set_aside_damaged_task(journal: Path, step: int, why: IntegrityError) -> str | None:
    """Set aside the save whose task file (of ``step``) is damaged, as :func:`_set_aside`
    does: the save is the one the node's BB record names (a new save of the step writes
    a new task, and the marker then no longer applies).  If that save is committed on
    the PFS, the task file is removed instead: there is nothing left to drain.  Returns
    what was done, "set aside" or "removed", or None if a new save of the step queued
    its own task or record meanwhile (looked at again).  The file is looked at again
    under :func:`records_locked`, which a save holds while it queues its task and writes
    its record.  Not collective."""
    stand_in = _stand_in(journal, step)
    committed = stand_in is not None and committed_save(
        Path(stand_in.pfs_step_dir), stand_in.save_time
    )
    path = task_path(journal, step)
    with records_locked(journal):
        try:
            read_task(path)
            return None  # a new save's task: drained as any
        except IntegrityError:
            pass
        if _stand_in(journal, step) != stand_in:
            return None  # a new save's record: its task comes next
        if committed:
            path.unlink(missing_ok=True)
        else:
            marker = {
                "time": None if stand_in is None else stand_in.save_time,
                "why": str(why),
                "node": None if stand_in is None else stand_in.node,
                TASK_DAMAGED: True,
            }
            files.write_json_atomic(set_aside_path(journal, step), marker)
    if committed:
        _wake_waiters(journal)
        return "removed"
    if stand_in is not None:
        _tell_other_nodes(stand_in, marker)
    return "set aside"


def _stand_in(journal: Path, step: int) -> Task | None:
    """The task of ``step`` as the node's BB record (its node, its save) and the
    journal's ``target.json`` (the PFS directory, the node count) tell it, for a step
    whose task file is damaged; None if they cannot.  Not collective."""
    bb_step_dir = journal.parent / layout.step_dirname(step)
    try:
        target = files.read_json(journal / TARGET) or {}
        nodes = layout.nodes_in(bb_step_dir)
        record = files.read_json(bb_step_dir / layout.node_record_name(nodes[0])) if nodes else None
        return Task(
            journal.parent.name,
            step,
            nodes[0],
            int(target["nodes"]),
            str(bb_step_dir),
            str(Path(target["pfs_ckpt_dir"]) / layout.step_dirname(step)),
            int(target["keep_pfs"]),
            save_time=(record or {})["time"],
        )
    except (BBIOError, OSError, KeyError, IndexError, TypeError, ValueError):
        return None


def _task_or_stand_in(journal: Path, step: int) -> Task | None:
    """The task queued for ``step``, or its :func:`_stand_in` if its file is damaged."""
    try:
        return read_task(task_path(journal, step))
    except IntegrityError:
        return _stand_in(journal, step)


def _tell_other_nodes(task: Task, marker: dict[str, Any]) -> bool:
    """Put ``marker`` (``task``'s save set aside) on the PFS unless one of that save is
    there; True if it is there now.  Never into a step directory that does not exist
    (retention removed it, or no node has copied yet: tried again later), and never
    fails: the PFS may be what fails."""
    step_dir = Path(task.pfs_step_dir)
    try:
        if damaged_save(step_dir, task.save_time) is not None:
            return True
        if not step_dir.is_dir():
            return False
        files.write_json_atomic(damaged_on_pfs(step_dir), marker, make_parent=False)
    except (OSError, BBIOError):
        return False
    return True


def _announce_set_aside(journal: Path, announced: set[tuple[int, float | None]]) -> None:
    """Tell the other nodes of the saves set aside in ``journal`` whose PFS marker is not
    known to be there (its first write failed: the PFS, or the step directory not made
    yet), so that their drains and waiting ranks stop waiting; ``announced`` keeps those
    done.  Not collective."""
    for step, marker in set_aside(journal).items():
        with contextlib.suppress(BBIOError):
            task = _task_or_stand_in(journal, step)
            if task is None or task.save_time != marker.get("time") or _task_key(task) in announced:
                continue  # saved again meanwhile, or said
            if _tell_other_nodes(task, marker):
                announced.add(_task_key(task))


def _task_key(task: Task) -> tuple[int, float | None]:
    """A task's identity: its step and save (a step saved again is a new task)."""
    return task.step, task.save_time


def _describe_failure(exc: Exception, task: Task) -> str:
    if isinstance(exc, BBIOError):
        return str(exc)
    if isinstance(exc, OSError):
        return str(from_oserror(exc, "drain", task.target))
    return f"unexpected {type(exc).__name__} while draining {task.target}: {exc}"


def journals(bb_root: Path) -> Iterable[Path]:
    """Every checkpointer's journal under a node's burst buffer."""
    base = bb_root / layout.CKPT_DIR
    if base.is_dir():
        for name in sorted(base.iterdir()):
            if (name / JOURNAL).is_dir():
                yield name / JOURNAL


def main(argv: list[str] | None = None) -> int:
    """``python -m bbio.checkpoint.drainer --journal DIR [--parent PID]``: the background
    drain."""
    parser = argparse.ArgumentParser(prog="python -m bbio.checkpoint.drainer")
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--parent", type=int, help="exit once this process is gone and idle")
    args = parser.parse_args(argv)
    run_on_any_cpu()
    signal.signal(STOP_SIGNAL, lambda *_: _told_to_stop.set())
    started = _started(args.parent) if args.parent else None  # it started this drain
    return run(args.journal, args.parent, finish=False, timeout=None, parent_started=started)


def _asked_to_stop(journal: Path) -> bool:
    """Has the training process asked this drain to stop once idle: the journal's stop
    file, or :data:`STOP_SIGNAL` where that file could not be made?"""
    return _told_to_stop.is_set() or (journal / STOP).exists()


def run_on_any_cpu() -> None:
    """Let this process run on any CPU the job may use (its cgroup still bounds it).

    A training rank that starts the drain is often bound to one core (``srun
    --cpu-bind``, ``mpirun`` with few ranks), and the drain inherits that
    binding: it would then share the rank's core and make it a straggler
    instead of using a spare one.
    """
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no affinity API
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
