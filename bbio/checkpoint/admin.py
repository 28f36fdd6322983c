"""Checkpoint administration from one node, without MPI: what ``bbio ckpt`` does.

These run in a shell, a Slurm prolog or epilog: they look at one node's burst
buffer (``bb_root``, already expanded for that node) and at the PFS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

from bbio.arguments import seconds_argument
from bbio.checkpoint import drain, layout
from bbio.checkpoint import restore as reader
from bbio.errors import BBIOError, BBIOTimeoutError, IntegrityError, NotFoundError
from bbio.transfer import files


@dataclasses.dataclass(frozen=True)
class Row:
    """One checkpoint step of one name, as seen from this node."""

    name: str
    step: int
    bb: str  # this node's copy: "complete", "complete, not the committed save" or "-"
    pfs: str  # as in :func:`bbio.checkpoint.drain.describe_pfs`, or "-"
    queue: str  # this node's drain journal: "queued", "set aside" (damaged), "damaged task" or "-"


def names(bb_root: Path, pfs_root: Path) -> list[str]:
    """Checkpointer names found on this node's burst buffer or on the PFS.  Not collective."""
    found = set()
    for base in (bb_root / layout.CKPT_DIR, pfs_root / layout.CKPT_DIR):
        if base.is_dir():
            found.update(p.name for p in base.iterdir() if p.is_dir())
    return sorted(found)


def _names_to_look_at(bb_root: Path, pfs_root: Path, name: str | None) -> list[str]:
    """``[name]``, or every name found; a typo in a root or a name is an error, not nothing.

    Raises :class:`NotFoundError` when neither ``bb_root`` nor ``pfs_root`` is a
    directory, or when ``name`` is in neither.
    """
    if not bb_root.is_dir() and not pfs_root.is_dir():
        raise NotFoundError(
            f"neither the burst buffer {bb_root} nor the PFS root {pfs_root} exists",
            hint="check --bb-root, --pfs-root and --node (defaults: BBIO_BB_ROOT, BBIO_PFS_ROOT)",
        )
    found = names(bb_root, pfs_root)
    if name is None:
        return found
    if name not in found:
        raise NotFoundError(
            f"no checkpointer {name!r} in {bb_root / layout.CKPT_DIR} "
            f"or {pfs_root / layout.CKPT_DIR}",
            hint=f"checkpointers there: {', '.join(found)}"
            if found
            else "there is none: check --bb-root, --pfs-root and --node",
        )
    return [name]


def list_checkpoints(
    bb_root: Path, pfs_root: Path, node: int, name: str | None = None
) -> list[Row]:
    """Every step of every (or one) checkpointer: its state in this node's BB and on the PFS.

    Not collective.  Raises :class:`NotFoundError` when neither root exists, or
    ``name`` is in neither.
    """
    rows = []
    for n in _names_to_look_at(bb_root, pfs_root, name):
        bb_dir, pfs_dir = bb_root / layout.CKPT_DIR / n, pfs_root / layout.CKPT_DIR / n
        local = reader.bb_copies(bb_dir, node)
        pfs, committed = drain.describe_pfs(pfs_dir)
        journal = drain.journal_dir(bb_dir)
        queue = {step: "set aside" for step in drain.set_aside(journal)}
        tasks, damaged = drain.read_queue(journal)
        queue.update((t.step, "queued") for t in tasks)
        queue.update((step, "damaged task") for step in damaged)
        for step in sorted(set(local) | set(pfs) | set(queue)):
            bb = "-"
            if step in local:  # an older save of a step saved again since is not restored
                stale = step in committed and local[step].get("time") != committed[step]
                bb = "complete, not the committed save" if stale else "complete"
            rows.append(Row(n, step, bb, pfs.get(step, "-"), queue.get(step, "-")))
    return rows


def verify(bb_root: Path, pfs_root: Path, node: int | None = None, name: str | None = None) -> int:
    """Re-read every committed PFS checkpoint and this node's BB copies; count files.

    Not collective.  Raises :class:`IntegrityError` naming every file whose size
    or CRC32C differs, every damaged manifest or BB record, every step on the PFS
    that a node's damaged file keeps from being committed, and this node's
    damaged files that its drain set aside; :class:`NotFoundError` when neither
    root exists or ``name`` is in neither.
    """
    problems, checked = [], 0
    for n in _names_to_look_at(bb_root, pfs_root, name):
        pfs_dir = pfs_root / layout.CKPT_DIR / n
        for step in drain.steps_in(pfs_dir):
            try:
                manifest = reader.pfs_manifest(pfs_dir, step)
            except IntegrityError as exc:
                problems.append(str(exc))
                continue
            damaged = None if manifest else drain.read_damaged(pfs_dir / layout.step_dirname(step))
            if damaged is not None:
                what = "drain task file" if damaged.get(drain.TASK_DAMAGED) else "file"
                problems.append(
                    f"{pfs_dir / layout.step_dirname(step)}: step {step} is never committed: "
                    f"node {damaged.get('node')}'s {what} is damaged ({damaged.get('why')}); "
                    "save the step again, or remove that step directory"
                )
            for entry in manifest["files"] if manifest else []:
                checked += 1
                try:
                    reader.verify_file(
                        pfs_dir / layout.step_dirname(step) / entry["path"],
                        entry["size"],
                        entry["crc32c"],
                    )
                except (IntegrityError, OSError) as exc:
                    problems.append(str(exc))
        bb_dir = bb_root / layout.CKPT_DIR / n
        problems += [str(exc) for exc in reader.damaged_bb_records(bb_dir, node)]
        problems += [str(exc) for exc in drain.read_queue(drain.journal_dir(bb_dir))[1].values()]
        problems += _set_aside_here(bb_dir, node)
        for step, record in sorted(reader.bb_copies(bb_dir, node).items()):
            crc = reader.bb_file_crc(record)
            if crc is None:
                continue  # saved by a bbio that recorded no file CRC, and not drained yet
            checked += 1
            path = bb_dir / layout.step_dirname(step) / layout.node_filename(record["node"])
            try:
                reader.verify_file(path, record["size"], crc)
            except (IntegrityError, OSError) as exc:
                problems.append(str(exc))
    if problems:
        raise IntegrityError(
            f"{len(problems)} checkpoint file(s) damaged or differing from their record: "
            + "; ".join(problems)
        )
    return checked


def _set_aside_here(bb_dir: Path, node: int | None) -> list[str]:
    """This node's damaged BB files that its drain set aside, as problems for
    :func:`verify` (the node is the one its tasks name; ``node`` if they cannot say).
    Not collective."""
    problems = []
    journal = drain.journal_dir(bb_dir)
    for step, marker in sorted(drain.set_aside(journal).items()):
        if marker.get(drain.TASK_DAMAGED):
            if not _task_damaged(journal, step):
                continue  # another node's task file is: its PFS marker says so
            problems.append(
                f"{drain.task_path(journal, step)}: set aside by the drain, never drained: "
                f"{marker.get('why')}; save step {step} again, or remove it, "
                f"{drain.set_aside_path(journal, step)} and the step's directories"
            )
            continue
        damaged_node = marker.get("node")
        try:
            here = (files.read_json(drain.task_path(journal, step)) or {}).get("node", node)
        except BBIOError:  # damaged or unreadable: the caller's node
            here = node
        if not isinstance(damaged_node, int) or damaged_node != here:
            continue  # another node's file is the damaged one: this copy is not
        step_dir = bb_dir / layout.step_dirname(step)
        problems.append(
            f"{step_dir / layout.node_filename(damaged_node)}: set aside by the drain, never "
            f"drained: {marker.get('why')}; save step {step} again, or remove {step_dir}, "
            f"{drain.task_path(journal, step)} and {drain.set_aside_path(journal, step)}"
        )
    return problems


def _task_damaged(journal: Path, step: int) -> bool:
    """Whether ``journal``'s task file of ``step`` is damaged.  Not collective."""
    try:
        drain.read_task(drain.task_path(journal, step))
    except IntegrityError:
        return True
    return False


@dataclasses.dataclass(frozen=True)
class Drained:
    """What :func:`finish` did under one burst buffer."""

    bb_root: Path
    queued: dict[str, int]  # checkpointer name -> steps queued in its journal at the start
    failed: list[str]  # journals that could not be drained


def finish(bb_root: Path, timeout: float | None) -> Drained:
    """Drain every journal of this node to the end (an epilog's job, ``bbio ckpt drain
    --finish``).  Not collective.

    Waits for a drain that is still running, takes over a dead one, retries
    failures until ``timeout``.  Then commits any checkpoint whose node files
    are all on the PFS but whose committer died.  Raises :class:`NotFoundError`
    when ``bb_root`` is not a directory (a typo there must not pass for a node
    with nothing queued), :class:`UsageError` for a negative or NaN ``timeout``.
    """
    timeout = seconds_argument("drain: timeout", timeout)
    if not bb_root.is_dir():
        raise NotFoundError(
            f"no burst-buffer directory {bb_root}: nothing to drain there",
            path=bb_root,
            hint="check --bb-root and --node (default: BBIO_BB_ROOT)",
        )
    journals = list(drain.journals(bb_root))
    queued = {}
    for journal in journals:  # a damaged task file counts: it is said when its journal drains
        tasks, damaged = drain.read_queue(journal)
        queued[journal.parent.name] = len(tasks) + len(damaged)
    return Drained(bb_root, queued, finish_journals(journals, timeout))


def finish_journals(journals: list[Path], timeout: float | None) -> list[str]:
    """Drain each of ``journals`` to the end, all within ``timeout``, as :func:`finish`
    does; returns those that could not be drained.  Not collective."""
    failed = []
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 1.0)

    for journal in journals:
        try:
            if drain.run(journal, parent=None, finish=True, timeout=left()) != 0:
                failed.append(str(journal))
        except (BBIOError, OSError) as exc:  # this journal's; the next ones are drained
            print(f"bbio drain: {journal}: {exc}", file=sys.stderr)
            failed.append(f"{journal} ({exc})")
            continue
        try:
            drain.commit_ready(journal, left() or drain.COMMIT_PATIENCE_SECONDS)
        except (BBIOError, OSError) as exc:  # this node's files are on the PFS: said, not failed
            print(f"bbio drain: {journal}: committing what is ready failed: {exc}", file=sys.stderr)
    return failed


def wait_committed(
    bb_root: Path, pfs_root: Path, name: str, step: int, timeout: float | None
) -> None:
    """Block until checkpoint ``name`` ``step`` is committed on the PFS.  Not collective.

    Raises :class:`NotFoundError` at once when ``name`` is neither on this
    node's burst buffer ``bb_root`` nor on the PFS (a typo would wait for
    ever), or as soon as the step is neither on the PFS nor queued on this
    node while a later one is committed (retention removed it, or it was never
    saved: it will not come); :class:`BBIOTimeoutError` at ``timeout``.  A
    damaged manifest counts as not committed yet (a drain replaces it).
    :class:`UsageError` for a negative or NaN ``timeout``.
    """
    timeout = seconds_argument("wait: timeout", timeout)
    _names_to_look_at(bb_root, pfs_root, name)
    step_dir = pfs_root / layout.CKPT_DIR / name / layout.step_dirname(step)
    queued_here = drain.task_path(drain.journal_dir(bb_root / layout.CKPT_DIR / name), step)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not drain.committed_save(step_dir):
        set_aside_here = drain.set_aside(queued_here.parent).get(step)
        if set_aside_here is not None:
            raise IntegrityError(
                f"checkpoint {name} step {step} will not be committed: set aside on this "
                f"node: {set_aside_here.get('why')}",
                path=queued_here,
                hint="save the step again, or wait for a later one",
            )
        damaged = drain.read_damaged(step_dir)
        if damaged is not None and _of_the_latest_save(damaged["time"], step_dir, queued_here):
            raise IntegrityError(
                f"checkpoint {name} step {step} will not be committed: node "
                f"{damaged.get('node')}'s file is damaged: {damaged.get('why')}",
                path=step_dir,
                hint="save the step again, or wait for a later one",
            )
        gone = not step_dir.exists() and not queued_here.exists()
        later = [s for s in drain.committed_steps(step_dir.parent) if s > step] if gone else []
        if later:
            raise NotFoundError(
                f"checkpoint {name} step {step} is not on the PFS, and step {later[-1]} is "
                "committed: retention removed it, or it was never saved",
                path=step_dir,
                hint=f"wait for step {later[-1]}, or look with 'bbio ckpt ls {name}'",
            )
        if deadline is not None and time.monotonic() > deadline:
            reported = None
            with contextlib.suppress(BBIOError):  # what the drain said is a help, not a need
                reported = drain.read_status(queued_here.parent).get("error")
            raise BBIOTimeoutError(
                f"checkpoint {name} step {step} is not committed after {timeout:g} s; this "
                f"node's drain reports: {reported or 'no error'}",
                path=step_dir,
                hint="is a drain running? 'bbio ckpt drain --finish' runs one",
            )
        time.sleep(0.1)


def _of_the_latest_save(save_time: float | None, step_dir: Path, queued_here: Path) -> bool:
    """Is ``save_time`` the step's latest save: no other save queued on this node, nor
    recorded on the PFS?  Not collective."""
    times = {(files.read_json(queued_here) or {}).get("save_time", save_time)}
    for node in layout.nodes_in(step_dir):
        times.add((files.read_json(step_dir / layout.node_record_name(node)) or {}).get("time"))
    return times <= {save_time, None}


def newest_local_step(bb_root: Path, pfs_root: Path, name: str, node: int | None = None) -> int:
    """The newest step of ``name`` in this node's burst buffer.  Not collective.  A
    ``name`` in neither tier is the :class:`NotFoundError` of ``bbio ckpt ls``, which
    lists the names there are."""
    _names_to_look_at(bb_root, pfs_root, name)
    bb_dir = bb_root / layout.CKPT_DIR / name
    copies = reader.bb_copies(bb_dir, node)
    if not copies:
        raise NotFoundError(
            f"no checkpoint {name!r} in this burst buffer",
            path=bb_dir,
            hint="wait for a given step with --step (a step trimmed here or saved straight "
            "to the PFS has no copy here), or check --bb-root and --node",
        )
    return max(copies)
