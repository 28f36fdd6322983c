"""Stage-in, stage-out and verify: the MPI shell around the staging plans.

Every public function here is collective over the communicator it is given.
The steps of a transfer: walk the source in parallel; find, on each node, what
is missing or different at the destination; check capacity before copying
anything; prepare temporary files; copy (directly, or by broadcast across
nodes in replicate mode); commit each file (mode, mtime, fsync, rename);
retry files that changed during the copy; optionally re-read and compare;
write the manifest last.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import posixpath
import shutil
import stat
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bbio import _native
from bbio.arguments import path_argument
from bbio.config import Config
from bbio.errors import (
    AlreadyExistsError,
    BBIOError,
    IntegrityError,
    NoSpaceError,
    UsageError,
    error_class_for_errno,
    from_oserror,
)
from bbio.mpi import (
    Topology,
    agreed,
    agreed_allgather,
    agreed_config,
    allgather_dict,
    deal,
    same_arguments,
    sum_over_ranks,
    topology,
)
from bbio.report import format_bytes, format_table
from bbio.stage import plan, registry
from bbio.stage.executors import Outcome, copy_broadcast, copy_direct, located, make_columns
from bbio.stage.progress import Progress
from bbio.stage.walk import (
    Skipped,
    check_destination,
    check_no_node,
    check_outside,
    check_readable,
    check_source,
    walk,
)
from bbio.transfer import files
from bbio.transfer.manifest import DIR, FILE, META_DIR, SYMLINK, Entry, Manifest

log = logging.getLogger("bbio")

MODES = ("replicate", "shard")
# The settings every rank must share: they shape the plans
PLAN_SETTINGS = ("ranks_per_node", "chunk_size", "stage_round_bytes", "replicate_round_bytes")
MAX_ATTEMPTS = 3
RETRY_BACKOFF_SECONDS = 1.0  # times the attempt number: gives a writer time to finish
PENDING = "stage-out-pending"  # DST/.bbio/stage-out-pending.json: what a stage-out began writing


@dataclasses.dataclass
class StageSummary:
    """What a stage-in or stage-out did (the same on every rank)."""

    operation: str
    mode: str
    nodes: int
    files: int  # files and symlinks committed by this run, summed over nodes
    unchanged: int  # already up to date at the destination, summed over nodes
    dataset_bytes: int  # bytes of the selected source files
    bytes_written: int  # bytes committed by this run, summed over nodes
    source_bytes_read: int  # bytes read from the source (the PFS for stage-in)
    seconds: float
    verified: bool
    skipped: list[Skipped]
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        """Bytes written per second, in GB/s."""
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def report(self) -> str:
        """A human-readable summary table."""
        rows = [
            ("files copied", self.files),
            ("files already up to date", self.unchanged),
            ("bytes", format_bytes(self.bytes_written)),
            ("seconds", f"{self.seconds:.2f}"),
            ("GB/s", f"{self.gb_per_s:.2f}"),
            ("bytes read from the source", format_bytes(self.source_bytes_read)),
            ("dataset", format_bytes(self.dataset_bytes)),
            ("nodes", self.nodes),
            ("verified", "yes (re-read, CRC32C)" if self.verified else "no"),
            ("skipped", len(self.skipped)),
        ]
        title = f"bbio {self.operation}" + (f" ({self.mode})" if self.mode else "")
        notes = "".join(f"\nwarning: {w}" for w in self.warnings)
        return title + "\n" + format_table(["", ""], rows) + notes


# -------------------------------------------------------------------- helpers


def _state_of(full: str | Path) -> plan.DestState | None:
    """What ``full`` holds now (its lstat), or None if nothing is there.  Raises the
    OSError of a failed look.  Not collective."""
    try:
        st = os.lstat(full)
        target = os.readlink(full) if stat.S_ISLNK(st.st_mode) else None
    except (FileNotFoundError, NotADirectoryError):
        return None
    if target is not None:
        return plan.DestState(SYMLINK, 0, st.st_mtime_ns, target)
    if stat.S_ISDIR(st.st_mode):
        return plan.DestState(DIR, 0, st.st_mtime_ns)
    mode = st.st_mode & plan.PERMISSION_BITS
    return plan.DestState(FILE, st.st_size, st.st_mtime_ns, mode=mode)


def dest_state(comm, root: Path, paths: Sequence[str]) -> dict[str, plan.DestState]:
    """Collective over ``comm``: what ``root/path`` holds now, for every path (lstat, dealt out).

    A path below a symlink among ``paths`` is looked at through it
    (:func:`plan.not_through_symlinks` leaves it out).  A path that cannot be
    looked at fails the call on every rank of ``comm``.
    """
    base = os.fspath(root)

    def look() -> dict[str, plan.DestState]:
        found = {}
        for path in deal(paths, comm):
            full = f"{base}/{path}"
            try:
                state = _state_of(full)
            except OSError as exc:
                raise from_oserror(exc, "look at the destination", full) from None
            if state is not None:
                found[path] = state
        return found

    merged: dict[str, plan.DestState] = {}
    for part in agreed_allgather(comm, f"looking at {root}", look):
        merged.update(part)
    return merged


def probe_mtime_granularity(root: Path, node: int | None = None) -> int:
    """Not collective: the granularity (ns) at which the file system of the destination
    directory ``root`` (or the target of a symlink stage-out follows) keeps mtimes
    (:func:`plan.mtime_granularity`), probed on a temporary file in ``root/.bbio``, or else
    in ``root``, whose mtime is set and read back.  1 (compare exactly) when ``root`` does
    not exist yet: nothing there is compared.  Raises the bbio error of a failed probe,
    naming ``node``."""
    where = root / META_DIR if os.path.isdir(root / META_DIR) else root
    if not os.path.isdir(where):
        return 1
    probe = files.unique_temp_path(where / "mtime-probe")
    read_back = []
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        try:
            for mtime_ns in plan.MTIME_PROBES_NS:
                os.utime(probe, ns=(mtime_ns, mtime_ns))
                read_back.append((mtime_ns, os.stat(probe).st_mtime_ns))
        finally:
            probe.unlink()
    except OSError as exc:
        raise from_oserror(
            exc,
            "set and read back the mtime of a probe file",
            probe,
            node=node,
            hint="choose a destination you may write to, or fix its permissions",
        ) from None
    return plan.mtime_granularity(read_back)


def _record_staged(bb_dir: Path, src: Path, dst_root: Path, node: int) -> None:
    """Record in ``bb_dir``'s registry that ``src`` is staged at ``dst_root``, for readers
    that open ``src``.  Not collective.

    A registry that cannot be written (``bb_root`` elsewhere, not writable) fails the
    stage-in only if it still sends readers of ``src`` to another copy (an earlier
    stage-in's, maybe stale): the bbio error of the failed write, naming the registry,
    that copy and what to do.  Otherwise the copy is whole, and a warning says what a
    reader of ``src`` reads (the PFS, or this copy, which the registry already names).
    A damaged registry raises its own :class:`IntegrityError`."""
    try:
        registry.record(bb_dir, src, dst_root)
    except OSError as exc:
        where, here = registry.registry_path(bb_dir), dst_root.resolve()
        hit = registry.lookup(bb_dir, src)
        read = None if hit is None else hit[1] / os.path.relpath(os.path.realpath(src), hit[0])
        if read is not None and read != here:
            raise error_class_for_errno(exc.errno)(
                f"{src} is staged at {here}, but the registry of staged copies could not be "
                f"written ({exc}), and it still sends a reader that opens {src} to {read}, "
                "an earlier copy that may be stale",
                path=where,
                node=node,
                hint=f"stage in to {read} instead (the copy the registry names), or let "
                f"this job write {where} and stage in again; open {here} to read this copy",
                errno=exc.errno,
            ) from None
        log.warning(
            "stage-in: node %d: %s is staged at %s, but the registry %s, which tells "
            "open_dataset to read the staged copy, could not be written (%s): a reader that "
            "opens %s reads %s; open %s instead, or set bb_root to a directory this job "
            "can write",
            node,
            src,
            here,
            where,
            exc,
            src,
            "the PFS" if read is None else "this copy, which the registry already names",
            here,
        )


def _check_capacity(root: Path, needed: int, node: int | None, hint: str) -> None:
    """Raise :class:`NoSpaceError` unless the file system of ``root`` has ``needed`` bytes
    free.  Not collective."""
    free = files.free_bytes(root)
    if needed > free:
        raise NoSpaceError(
            f"{root} needs {format_bytes(needed)} ({needed} bytes) for this transfer, "
            f"{format_bytes(free)} ({free} bytes) free",
            node=node,
            hint=hint,
        )


def _nothing_selected(entries: Sequence[Entry], include, exclude) -> list[str]:
    """The warning when filters left no file or symlink to transfer."""
    if (include or exclude) and all(e.kind == DIR for e in entries):
        return ["--include/--exclude selected no file of the source: nothing was copied"]
    return []


def remove_leftovers(comm, root: Path, writable: Sequence[str], others: Iterable[str]) -> int:
    """Collective over ``comm``: delete temporary files an interrupted run left under ``root``,
    and let the owner write into the ``writable`` directories again.

    Looks in ``root``, its ``.bbio``, and the directories ``writable`` (the tree's, on a
    stage-in) and ``others`` (of an earlier tree, of an interrupted run), dealt out
    over the ranks; returns how many were removed.  Frees their space before the
    capacity check.  A ``writable`` directory copied read-only (its source's mode, set
    when a run finishes) gets the owner's write and search bits back until this run
    finishes it: else nothing new could be copied into it, nor anything removed.
    """
    chmod = set(writable)
    where = sorted({"", META_DIR, *chmod, *others})

    def remove() -> int:
        removed = 0
        for rel in deal(where, comm):
            try:
                if rel in chmod:
                    _let_owner_write(root / rel)
                removed += files.remove_temp_files(root / rel)
            except (FileNotFoundError, NotADirectoryError):
                continue  # not created yet
            except OSError as exc:
                raise from_oserror(
                    exc, "remove an earlier run's temporary files", root / rel
                ) from None
        return removed

    return sum(agreed_allgather(comm, f"removing what an interrupted run left in {root}", remove))


def _let_owner_write(directory: Path) -> None:
    """Add the owner's read, write and search bits to ``directory`` if it lacks any."""
    st = os.lstat(directory)
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
        os.chmod(directory, stat.S_IMODE(st.st_mode) | 0o700)


def _remove_temps(root: Path, paths: Iterable[str]) -> None:
    """Delete the temporary files of ``paths`` under ``root`` (best effort).  Not collective."""
    for path in paths:
        try:
            files.temp_path(root / path).unlink(missing_ok=True)
        except OSError:
            continue  # the next run removes it (remove_leftovers)


def _remove_changing_copies(root: Path, paths: Iterable[str], node: int) -> None:
    """Delete the temporary files of ``paths`` under ``root``, files that kept changing
    while copied; raise the bbio error of one that cannot be deleted, naming it and
    ``node``.  Not collective."""
    for path in paths:
        temp = files.temp_path(root / path)
        try:
            temp.unlink(missing_ok=True)
        except OSError as exc:
            raise from_oserror(
                exc,
                "remove the temporary copy of a file that kept changing",
                temp,
                node=node,
                hint="remove it by hand (a rerun removes it too)",
            ) from None


def _make_dirs(root: Path, dirs: Iterable[Entry], node: int | None) -> None:
    """Create ``root`` and ``dirs`` under it, parents first.  A symlink among ``dirs`` (a
    copy of what the source held before) is replaced, never followed: files copied
    through it would land elsewhere in the tree.  Not collective."""
    below = sorted((root / d.path for d in dirs), key=lambda p: len(p.parts))
    for path in (root, *below):
        try:
            if path != root and path.is_symlink():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise from_oserror(
                exc,
                "create the directory",
                path,
                node=node,
                hint="choose a destination you may write to, or move what is in the way",
            ) from None


def _make_way(
    root: Path, paths: Sequence[str], old: Manifest | None, node: int, granularity_ns: int
) -> None:
    """Stage-in: delete what ``root`` holds at ``paths`` (:func:`plan.kind_changes`: a file
    where the source now has a directory, a directory where it has a file or a symlink),
    when all of it is bbio's earlier copy as the previous manifest ``old`` records it (for
    a directory, everything in it: its own entry may be withdrawn already, by a run that
    failed), at the mtime ``granularity_ns`` of ``root``.  Else raise
    :class:`AlreadyExistsError` naming the paths, before anything is deleted or copied.
    The manifest of ``root`` is marked unfinished first, and what is deleted leaves it
    after: a run stopped half-way leaves what it did not delete recorded, for the rerun
    to delete.  Not collective."""
    recorded = {} if old is None else old.by_path()
    removable: list[tuple[Path, list[str]]] = []
    blocked = []
    for path in paths:
        full = root / path
        inside = _paths_below(root, full) if files.is_real_dir(full) else [path]
        if inside is not None and all(
            _is_recorded_copy(root, p, recorded.get(p), granularity_ns) for p in inside
        ):
            removable.append((full, [path, *inside]))
        else:
            blocked.append(path)
    if blocked:
        raise AlreadyExistsError(
            f"{len(blocked)} path(s) of the copy changed kind in the source (a file now a "
            "directory, or the other way round) and hold what bbio did not copy there: "
            + ", ".join(blocked[:20]),
            path=root,
            node=node,
            hint="move aside what you want to keep there, or remove it, and rerun",
        )
    if not removable:
        return
    current = files.read_manifest(root)
    if current is not None and not current.attrs.get("unfinished"):
        files.withdraw_entries(root, current, [])
    for full, _ in removable:
        try:
            if files.is_real_dir(full):
                _let_owner_write(full)  # copied read-only (0555), as its source was
                for top, dirs, _ in os.walk(full):
                    for name in dirs:
                        _let_owner_write(Path(top) / name)
                shutil.rmtree(full)
            else:
                full.unlink()
        except OSError as exc:
            raise from_oserror(exc, "remove an earlier copy", full, node=node) from None
    if current is not None:
        files.withdraw_entries(root, current, [p for _, gone in removable for p in gone])


def _paths_below(root: Path, directory: Path) -> list[str] | None:
    """The paths (relative to ``root``) of everything below ``directory`` but temporary
    files, or None if a directory there cannot be listed.  Not collective."""
    unlisted: list[OSError] = []
    found = []
    for top, dirs, names in os.walk(directory, onerror=unlisted.append):
        below = os.path.relpath(top, root)
        found += [f"{below}/{n}" for n in (*dirs, *names) if not files.is_temp_name(n)]
    return None if unlisted else found


def _is_recorded_copy(root: Path, path: str, entry: Entry | None, granularity_ns: int) -> bool:
    """Whether ``root/path`` is the version of it the previous manifest's ``entry`` records
    (a directory, a file of its size and mtime at ``granularity_ns``, a symlink to its
    target).  Not collective."""
    if entry is None:
        return False
    now = _state_of(root / path)
    if now is None:
        return True  # gone meanwhile: nothing to keep
    if DIR in (entry.kind, now.kind):
        return entry.kind == now.kind
    return plan.is_recorded(now, [entry], [], granularity_ns)


def _recorded_modes(manifest: Manifest | None) -> dict[str, int]:
    """The mode each file had when the ``manifest`` was written (none without one)."""
    return {} if manifest is None else {e.path: e.mode for e in manifest.entries}


def _set_modes(root: Path, changed: Sequence[Entry]) -> None:
    """Give the copies of ``changed`` (up to date but for their mode) their source's mode.
    Not collective."""
    for e in changed:
        try:
            os.chmod(root / e.path, e.mode & plan.PERMISSION_BITS)
        except OSError as exc:
            raise from_oserror(exc, "set the mode of", root / e.path) from None


def _finish_dirs(root: Path, dirs: Sequence[Entry]) -> None:
    """Give ``dirs`` (under ``root``) their source's mode and mtime, deepest first, and fsync
    them and their parents.  Not collective."""
    for d in sorted(dirs, key=lambda e: e.path.count("/"), reverse=True):
        os.chmod(root / d.path, d.mode)
        os.utime(root / d.path, ns=(d.mtime_ns, d.mtime_ns))
    files.fsync_dirs(
        [root, *((root / d.path).parent for d in dirs), *(root / d.path for d in dirs)]
    )


def _refresh(job: _Transfer, paths: Sequence[str]) -> dict[str, Entry]:
    """Collective over ``job.comm``: re-stat this node's ``paths`` under the source (files
    that changed), shared among the node's ranks; a path gone (no longer a regular
    file, or no longer under a directory) is left out.  Any other failure is every
    rank's error."""
    topo = job.topo

    def stat_share() -> tuple[int, dict[str, Entry]]:
        fresh = {}
        for path in deal(sorted(paths), topo.node_comm):
            try:
                st = os.lstat(job.src_root / path)  # symlinks are never followed
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise from_oserror(exc, "look again at", job.src_root / path) from None
            if not stat.S_ISREG(st.st_mode):
                continue  # replaced by a symlink, a directory...: the file is gone
            fresh[path] = Entry(
                path, FILE, size=st.st_size, mtime_ns=st.st_mtime_ns, mode=st.st_mode & 0o7777
            )
        return topo.node, fresh

    what = f"{job.label}: looking again at the files that changed"
    merged: dict[str, Entry] = {}
    for node, fresh in agreed_allgather(job.comm, what, stat_share):
        if node == topo.node:
            merged.update(fresh)
    return merged


# ------------------------------------------------------------ copy and commit


@dataclasses.dataclass
class _Copied:
    """Per node: CRC32C of each committed file, its entry as committed (a file that changed
    while copied has its new size and mtime), how many, their bytes, bytes read."""

    crcs: dict[str, int] = dataclasses.field(default_factory=dict)
    entries: dict[str, Entry] = dataclasses.field(default_factory=dict)
    bytes_written: int = 0
    files: int = 0
    source_bytes_read: int = 0


def _commit_node(
    node_comm,
    dst_root: Path,
    todo: Sequence[Entry],
    owner: dict[str, int],
    outcome: Outcome,
) -> tuple[dict[str, int], set[str]]:
    """Collective over ``node_comm``: owners combine piece CRCs and commit their files.

    Only the results of pieces copied for another rank's file travel (the
    pieces of split large files): a whole file's copier is its owner.
    Returns the CRCs this rank committed and the paths whose source changed.
    """
    me = node_comm.Get_rank()
    parts = node_comm.allgather(
        {key: result for key, result in outcome.pieces.items() if owner.get(key[0]) != me}
    )
    parts[me] = outcome.pieces
    pieces_of: dict[str, list] = {}
    for part in parts:
        for (path, offset), result in part.items():
            pieces_of.setdefault(path, []).append((offset, result))
    crcs, changed, ready, sealed = {}, set(), [], []
    dst = os.fspath(dst_root)
    for entry in todo:
        if entry.kind != FILE or owner.get(entry.path) != me:
            continue
        pieces = sorted(pieces_of.get(entry.path, []), key=lambda item: item[0])
        crc, size, moved = 0, 0, False
        for _, result in pieces:
            crc = _native.crc32c_combine(crc, result.crc32c, result.nbytes)
            size += result.nbytes
            moved = moved or result.changed
        if moved or size != entry.size:
            changed.add(entry.path)
            continue
        if entry.path in outcome.sealed:
            sealed.append(f"{dst}/{entry.path}")
        else:
            ready.append(files.Commit(dst_root / entry.path, entry.mode, entry.mtime_ns))
        crcs[entry.path] = crc
    files.commit(ready, sealed)
    return crcs, changed


@dataclasses.dataclass
class _Transfer:
    """What every round of one copy shares: where from, where to, how, and what was skipped."""

    comm: Any
    topo: Topology
    config: Config
    label: str
    src_root: Path
    dst_root: Path
    broadcast: bool  # replicate across nodes (src_root is shared), else each node copies its own
    skip_unreadable: bool
    skipped: list[Skipped]


def _copy_loop(job: _Transfer, todo: list[Entry]) -> _Copied:
    """Collective over ``job.comm``: copy and commit this node's ``todo`` files, in rounds.

    Every node takes the same rounds (:func:`plan.commit_rounds` of all nodes'
    files), each copied and committed before the next starts, so a run killed
    midway keeps every round it finished.
    """
    comm, topo = job.comm, job.topo
    sizes = allgather_dict(comm, {e.path: e.size for e in todo} if topo.is_leader else {})
    mine = {e.path: e for e in todo}
    copied = _Copied()
    total, total_files = sum_over_ranks(
        comm, *((plan.bytes_needed(todo), len(todo)) if topo.is_leader else (0, 0))
    )
    progress = Progress(comm, job.label, total, total_files, job.config.progress)
    for paths in plan.commit_rounds(sizes, job.config.stage_round_bytes):
        part = _copy_round(job, [mine[p] for p in paths if p in mine], progress)
        copied.crcs.update(part.crcs)
        copied.entries.update(part.entries)
        copied.files += part.files
        copied.bytes_written += part.bytes_written
        copied.source_bytes_read += part.source_bytes_read
    progress.finish()
    return copied


def _copy_round(job: _Transfer, todo: list[Entry], progress: Progress) -> _Copied:
    """Collective over ``job.comm``: copy and commit this node's ``todo`` files, retrying
    changes."""
    comm, topo, config, label = job.comm, job.topo, job.config, job.label
    src_root, dst_root, broadcast = job.src_root, job.dst_root, job.broadcast
    copied = _Copied()
    entries = {e.path: e for e in todo}
    for attempt in range(1, MAX_ATTEMPTS + 1):
        node_files = [e for e in todo if e.kind == FILE]
        if broadcast:
            union = allgather_dict(comm, {e.path: e for e in node_files})
            everything = [union[p] for p in sorted(union)]
            entries.update(union)
            round_bytes = plan.replicate_round_bytes(topo.nodes, config.replicate_round_bytes)
            pieces = plan.split_pieces(everything, min(config.chunk_size, round_bytes))
            columns = make_columns(
                comm, topo.node, topo.node_comm.Get_rank(), topo.node_comm.Get_size()
            )
            parts = plan.partition(pieces, topo.nodes * columns.count)
            owner = {path: index % columns.count for path, index in plan.owners(parts).items()}
        else:
            pieces = plan.split_pieces(node_files, config.chunk_size)
            by_rank = plan.partition(pieces, topo.node_comm.Get_size())
            owner = plan.owners(by_rank)
        me = topo.node_comm.Get_rank()
        outcome = Outcome()
        crcs: dict[str, int] = {}
        changed: set[str] = set()
        try:
            with agreed(comm, f"{label}: preparing temporary files"), located(topo.node):
                for e in node_files:
                    if owner[e.path] == me and (broadcast or e.size > config.chunk_size):
                        files.prepare(dst_root / e.path, e.size)
            threads = config.stage_threads(topo.node_comm.Get_size())
            with agreed(comm, f"{label}: copying"):
                if broadcast:
                    outcome = copy_broadcast(
                        columns,
                        pieces,
                        topo.nodes,
                        {e.path for e in node_files},
                        entries,
                        src_root,
                        dst_root,
                        progress,
                        round_bytes,
                        threads,
                    )
                else:
                    with located(topo.node):
                        outcome = copy_direct(
                            topo.node_comm,
                            by_rank,
                            entries,
                            src_root,
                            dst_root,
                            progress,
                            config.copy_buffer_size,
                            threads,
                        )
            with agreed(comm, f"{label}: committing files"), located(topo.node):
                crcs, changed = _commit_node(topo.node_comm, dst_root, node_files, owner, outcome)
        except BBIOError:
            # every rank failed alike and none writes any more: drop this round's temporary
            # files, which would fill the device until the next run
            _remove_temps(dst_root, [e.path for e in node_files if owner[e.path] == me])
            raise
        finally:
            if broadcast and columns.comm is not None:
                columns.comm.Free()
        node_crcs = allgather_dict(topo.node_comm, crcs)
        changed = set().union(*topo.node_comm.allgather(changed))
        copied.crcs.update(node_crcs)
        copied.entries.update({p: entries[p] for p in node_crcs})
        copied.files += len(node_crcs)
        copied.bytes_written += sum(entries[p].size for p in node_crcs)
        copied.source_bytes_read += comm.allreduce(outcome.source_bytes_read)
        all_changed = sorted(set().union(*comm.allgather(changed)))
        if not all_changed:
            break
        if attempt == MAX_ATTEMPTS:
            message = f"{len(all_changed)} file(s) kept changing while being copied: " + ", ".join(
                all_changed[:20]
            )
            with agreed(comm, f"{label}: removing the copies of files that kept changing"):
                if topo.is_leader:  # no temporary copy left to fill the device until a rerun
                    _remove_changing_copies(dst_root, sorted(changed), topo.node)
            if not job.skip_unreadable:
                raise IntegrityError(
                    message,
                    hint="stop what writes to them, or pass --skip-unreadable to skip them",
                )
            job.skipped.extend(Skipped(p, "kept changing while being copied") for p in all_changed)
            break
        time.sleep(RETRY_BACKOFF_SECONDS * attempt)
        if topo.is_leader:  # sealed with the source's mode, maybe read-only: made anew
            _remove_temps(dst_root, all_changed)
        fresh = _refresh(job, sorted(changed))  # collective: after every node's removal
        removed = set().union(*comm.allgather(changed - set(fresh)))  # every node's
        job.skipped.extend(Skipped(p, "removed during the copy") for p in sorted(removed))
        if comm.Get_rank() == 0:
            log.info("%s: %d file(s) changed while copied; copying again", label, len(all_changed))
        todo = [fresh[p] for p in sorted(changed) if p in fresh]
        entries.update(fresh)
    return copied


def _commit_symlinks(dst_root: Path, links: Iterable[Entry]) -> int:
    count = 0
    for link in links:
        files.commit_symlink(dst_root / link.path, link.target or "", link.mtime_ns)
        count += 1
    return count


def _previous_manifest(comm, sharers, root: Path, what: str) -> Manifest | None:
    """Collective over ``comm``: the previous manifest of ``root``, read by the first rank
    of ``sharers`` (the ranks that share ``root``) and handed to the others."""
    old = None
    with agreed(comm, f"{what}: reading the previous manifest"):
        if sharers.Get_rank() == 0:
            old = files.read_manifest(root)
    return sharers.bcast(old, root=0)


def _withdraw_changing(
    comm, sharers, root: Path, old: Manifest | None, changing: Sequence[Entry], what: str
) -> None:
    """Collective over ``comm``: before any of ``changing`` is copied, the first rank of
    ``sharers`` commits the previous manifest ``old`` of ``root`` without their entries
    and no longer ``complete`` (:func:`files.withdraw_entries`)."""
    with agreed(comm, f"{what}: withdrawing what will change from the previous manifest"):
        if sharers.Get_rank() == 0 and old is not None and changing:
            files.withdraw_entries(root, old, [e.path for e in changing])


def _crcs_of_unchanged(
    comm, root: Path, unchanged: Sequence[Entry], old: Manifest | None, *, granularity_ns: int
) -> dict[str, int]:
    """Collective over ``comm``: CRC32C of this rank's ``unchanged`` files (skipped as up
    to date).

    From the previous manifest when it describes the same version; otherwise
    (files an interrupted run committed) the file under ``root`` is read, each
    once over ``comm``'s ranks, whichever nodes need it: stage-in reads the
    source, so that ``--verify`` then checks the copy against it, not against
    itself.  A file that no longer has the size and mtime it had when the walk
    saw it (at ``root``'s mtime ``granularity_ns``: a stage-out reads the copies),
    or is gone, gets no CRC32C (it is copied again by the next run).
    """
    known = old.by_path() if old else {}
    crcs, unknown = {}, set()
    for e in unchanged:
        previous = known.get(e.path)
        if e.kind != FILE:
            continue
        if previous and previous.same_version(e) and previous.crc32c is not None:
            crcs[e.path] = previous.crc32c
        else:
            unknown.add((e.path, e.size, e.mtime_ns))
    everyone = sorted(set().union(*comm.allgather(unknown)))

    def read() -> dict[str, int]:
        found = {}
        for path, size, mtime_ns in deal(everyone, comm):
            try:
                crc = files.checksum_file(root / path)[1]
                st = os.stat(root / path)
            except (FileNotFoundError, NotADirectoryError):  # bbio's errors of those too
                continue  # removed since the walk: no CRC32C
            if st.st_size == size and plan.same_mtime(st.st_mtime_ns, mtime_ns, granularity_ns):
                found[path] = crc
        return found

    wanted = {path for path, _, _ in unknown}
    for part in agreed_allgather(comm, f"reading the files already in {root}", read):
        crcs.update((path, crc) for path, crc in part.items() if path in wanted)
    return crcs


def _differing_copies(
    comm, topo, src_root: Path, trees: Sequence[Sequence[Entry]], to_copy: set[str]
) -> list[plan.Conflict]:
    """Collective over ``comm``: the files to copy that several nodes hold with one size
    and mtime but other bytes.  Each node's ranks share the reading of its copies."""
    alike = {p: n for p, n in plan.held_alike(trees).items() if p in to_copy}
    held_here = sorted(p for p, nodes in alike.items() if topo.node in nodes)
    sums: dict[str, int] = {}
    with agreed(comm, "stage-out: comparing the files several nodes hold alike"):
        sums = {p: files.checksum_file(src_root / p)[1] for p in deal(held_here, topo.node_comm)}
    by_node: list[dict[str, int]] = [{} for _ in trees]
    for node, part in comm.allgather((topo.node, sums)):
        by_node[node].update(part)
    return plan.differing_copies(alike, by_node)


def _verify_copies(
    comm,
    root: Path,
    crcs: dict[str, int],
    entries: dict[str, Entry],
    node: int | None,
    delete: bool,
) -> None:
    """Collective over ``comm``: re-read the files of ``crcs`` from the device and compare
    with ``entries`` (as committed).

    A copy that differs must be copied again, but a rerun skips a file of the
    source's size and mtime: with ``delete`` (burst-buffer copies, which the
    reader would otherwise still serve) it is deleted, and withdrawn from the
    manifest ``root`` has (by ``comm``'s first rank), else (a stage-out's
    destination, the user's results) its mtime is set to :func:`plan.damaged_mtime` (0, or
    4 s for a source within 2 s of 0) and its bytes kept.  The source is never touched.
    """

    def check() -> list[tuple[str, str]]:
        bad = []
        for path in deal(sorted(crcs), comm):
            size, crc = files.checksum_file(root / path, drop_cache=True)
            if size != entries[path].size or crc != crcs[path]:
                try:
                    if delete:
                        (root / path).unlink()
                    else:  # an mtime no source has now, so that the rerun sees it differ
                        stale = plan.damaged_mtime(entries[path].mtime_ns)
                        os.utime(root / path, ns=(stale, stale), follow_symlinks=False)
                except OSError as exc:
                    raise from_oserror(exc, "mark the damaged copy", root / path) from None
                bad.append(
                    (
                        path,
                        f"{root / path} (expected {entries[path].size} bytes, CRC32C "
                        f"{crcs[path]:08x}; read {size} bytes, {crc:08x})",
                    )
                )
        return bad

    found = sorted(b for part in agreed_allgather(comm, f"re-reading {root}", check) for b in part)
    if delete and found and comm.Get_rank() == 0:
        committed = files.read_manifest(root)
        if committed is not None:  # a previous run's, which lists the deleted copies
            files.withdraw_entries(root, committed, [path for path, _ in found])
    bad = [message for _, message in found]
    if bad:
        done = "were deleted" if delete else "were marked (mtime 0 or 4 s) to be copied again"
        raise IntegrityError(
            f"{len(bad)} file(s) differ from what was copied and {done}: " + "; ".join(bad[:10]),
            node=node,
            hint="the device may be failing; rerun the command to copy them again",
        )


def agree_on_arguments(
    comm,
    what: str,
    config: Config,
    arguments: dict[str, Any],
    paths: Sequence[tuple[str, str]] = (("src", "the source"), ("dst", "the destination")),
    settings: Sequence[str] = PLAN_SETTINGS,
) -> None:
    """Collective over ``comm``: the same :class:`UsageError` on every rank unless every
    rank passed the same ``arguments`` and ``config`` ``settings`` (those that shape the
    plan), the ``paths`` arguments (name, what it is) are paths, and ``include`` and
    ``exclude`` (in ``arguments``) are lists of globs."""
    same_arguments(
        comm,
        what,
        {**arguments, **{name: getattr(config, name) for name in settings}},
    )
    for name, description in paths:
        path_argument(f"{what}: {description}", arguments[name])
    for name in ("include", "exclude"):
        if isinstance(arguments.get(name), (str, bytes)):
            raise UsageError(
                f"{what}: {name} must be a list of globs, not the string {arguments[name]!r}",
                hint=f"pass {name}=[{arguments[name]!r}]",
            )


# -------------------------------------------------------------------- stage-in


def stage_in(
    comm,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    mode: str = "replicate",
    verify: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    skip_unreadable: bool = False,
    config: Config | None = None,
) -> StageSummary:
    """Collective over ``comm``: copy the tree ``src`` (on the PFS) into every node's ``dst``.

    ``dst`` may contain ``{node}`` (and ``{job}``, ``{user}``).  ``mode``
    "replicate" gives every node the whole tree, reading each byte from the
    source once; "shard" gives each node a subset balanced by bytes.  Reruns
    copy only what is missing or different.  Each node's ``dst/.bbio/manifest.json``
    (written last) lists every file, its CRC32C and the node that holds it.
    Returns the same summary on every rank.

    Every rank must pass the same arguments, and ``dst`` must not lie inside
    ``src``: else every rank raises the same :class:`UsageError`.  A copy that
    ``verify`` finds damaged is deleted, so that a rerun copies it again.
    """
    config = agreed_config(comm, "stage-in", config)
    agree_on_arguments(
        comm,
        "stage-in",
        config,
        {
            "src": src,
            "dst": dst,
            "mode": mode,
            "verify": verify,
            "include": include,
            "exclude": exclude,
            "skip_unreadable": skip_unreadable,
        },
    )
    if mode not in MODES:
        raise UsageError(f"unknown stage-in mode {mode!r}", hint=f"use one of {', '.join(MODES)}")
    check_no_node(src, "source", "stage-in")
    start = time.monotonic()
    topo = topology(comm, config.ranks_per_node)
    try:
        return _stage_in(
            comm,
            topo,
            config.expand(src),
            dst,
            mode,
            verify,
            include,
            exclude,
            skip_unreadable,
            config,
            start,
        )
    finally:
        topo.free()


def _stage_in(comm, topo, src, dst, mode, verify, include, exclude, skip_unreadable, config, start):
    dst_root = config.node_dir(dst, topo.node, topo.nodes_on_host)
    bb_dir = config.node_dir(config.bb_root, topo.node, topo.nodes_on_host)  # its registry
    granularity = 1
    with agreed(comm, "stage-in: checking the destination"):
        if topo.is_leader:
            check_outside(src, dst_root, topo.node)
            check_destination(dst_root, topo.node)
            granularity = probe_mtime_granularity(dst_root, topo.node)
    granularity = topo.node_comm.bcast(granularity, root=0)
    listers = config.stage_threads(topo.node_comm.Get_size())
    tree = walk(comm, src, include, exclude, listers)
    problems = check_readable(tree, skip_unreadable, str(src))
    entries = plan.without(tree.entries, {p.path for p in problems})
    granularity = max(granularity, plan.tree_mtime_granularity(entries))  # and the source's
    skipped = tree.skipped + problems
    holder = (
        plan.assign_nodes([e for e in entries if e.kind == FILE], topo.nodes)
        if mode == "shard"
        else {}
    )
    mine = [e for e in entries if e.kind != FILE or holder.get(e.path, topo.node) == topo.node]
    dirs = [e for e in mine if e.kind == DIR]
    current: dict[str, plan.DestState] = {}
    with agreed(comm, "stage-in: looking at the destination"):
        current = plan.not_through_symlinks(
            dest_state(topo.node_comm, dst_root, [e.path for e in mine])
        )
    old = _previous_manifest(comm, topo.node_comm, dst_root, "stage-in")
    same_source = plan.copy_of(old, str(src.resolve()))
    trusted = old if same_source else None  # another source's: its files may hold other bytes
    todo = plan.to_copy(mine, current if same_source else {}, granularity)
    if old is not None and not same_source:  # until a run finishes: no source's copy
        old = dataclasses.replace(old, attrs={**old.attrs, plan.MIXED_SOURCES: True})
    _withdraw_changing(comm, topo.node_comm, dst_root, old, todo, "stage-in")
    chmod = plan.to_chmod(mine, current, _recorded_modes(trusted), granularity)
    with agreed(comm, "stage-in: removing what an interrupted run left"):
        remove_leftovers(topo.node_comm, dst_root, [d.path for d in dirs], _parents([old]))
    with agreed(comm, "stage-in: making way where the source changed kind"):
        if topo.is_leader:
            _make_way(dst_root, plan.kind_changes(mine, current), old, topo.node, granularity)
    with agreed(comm, "stage-in: checking burst-buffer space"):
        if topo.is_leader:
            _check_capacity(
                dst_root,
                plan.bytes_needed(todo),
                topo.node,
                "free space there, stage fewer files (--include/--exclude), "
                "or use --mode shard to spread the files over the nodes",
            )
    with agreed(comm, "stage-in: creating directories"):
        if topo.is_leader:
            _make_dirs(dst_root, dirs, topo.node)
            _set_modes(dst_root, chmod)
    broadcast = mode == "replicate" and topo.nodes > 1
    job = _Transfer(
        comm, topo, config, "stage-in", src, dst_root, broadcast, skip_unreadable, skipped
    )
    copied = _copy_loop(job, [e for e in todo if e.kind == FILE])
    links = 0
    with agreed(comm, "stage-in: creating symlinks and setting directory times"):
        if topo.is_leader:
            links = _commit_symlinks(dst_root, [e for e in todo if e.kind == SYMLINK])
    topo.node_comm.Barrier()
    given_up = {s.path for s in skipped}
    todo_paths = {e.path for e in todo}
    unchanged = [e for e in mine if e.kind == FILE and e.path not in todo_paths]
    node_crcs = dict(copied.crcs)
    with agreed(comm, "stage-in: checksums of files already in place"):
        node_crcs.update(_crcs_of_unchanged(comm, src, unchanged, trusted, granularity_ns=1))
    as_copied = {**{e.path: e for e in mine}, **copied.entries}  # this node's files
    if verify:
        with agreed(comm, "stage-in: verifying"):
            _verify_copies(topo.node_comm, dst_root, node_crcs, as_copied, topo.node, delete=True)
    all_crcs = allgather_dict(topo.leader_comm, node_crcs) if topo.is_leader else {}
    all_copied = allgather_dict(topo.leader_comm, copied.entries) if topo.is_leader else {}
    with agreed(comm, "stage-in: finishing directories and writing the manifest"):
        if topo.is_leader:
            _finish_dirs(dst_root, dirs)
            manifest_entries = [
                (as_copied.get(e.path) or all_copied.get(e.path, e)).committed(
                    node_crcs.get(e.path, all_crcs.get(e.path)),
                    holder.get(e.path) if mode == "shard" else None,
                )
                for e in entries
                if e.path not in given_up
            ]
            files.write_manifest(
                dst_root,
                Manifest(
                    "stage-in",
                    manifest_entries,
                    {
                        "mode": mode,
                        "source": str(src.resolve()),
                        "nodes": topo.nodes,
                        "node": topo.node,
                        "verified": verify,
                        "skipped": [dataclasses.asdict(s) for s in skipped],
                        # special files and symlinks out of SRC are never copied, nor
                        # listed by a reader's walk: only what a filter, an unreadable
                        # file or the copy (a file that kept changing or was removed)
                        # left out makes the copy incomplete
                        "complete": not (include or exclude or len(skipped) > len(tree.skipped)),
                    },
                ),
            )
            _record_staged(bb_dir, src, dst_root, topo.node)
    seconds = comm.allreduce(time.monotonic() - start, op=_max())
    totals = sum_over_ranks(
        comm,
        *(
            (copied.files + links, len(unchanged), copied.bytes_written)
            if topo.is_leader
            else (0, 0, 0)
        ),
    )
    _warn(comm, skipped)
    return StageSummary(
        operation="stage-in",
        mode=mode,
        nodes=topo.nodes,
        files=totals[0],
        unchanged=totals[1],
        dataset_bytes=tree.total_bytes,
        bytes_written=totals[2],
        source_bytes_read=copied.source_bytes_read,
        seconds=seconds,
        verified=verify,
        skipped=skipped,
        warnings=_nothing_selected(entries, include, exclude),
    )


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _warn(comm, skipped: Sequence[Skipped]) -> None:
    if comm.Get_rank() == 0:
        for s in skipped:
            log.warning("skipped %s: %s", s.path, s.reason)


# ------------------------------------------------------------------- stage-out


def stage_out(
    comm,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    verify: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    skip_unreadable: bool = False,
    overwrite: bool = False,
    config: Config | None = None,
) -> StageSummary:
    """Collective over ``comm``: merge every node's ``src`` (may contain ``{node}``) into ``dst``.

    Each path of the merged tree is written by exactly one node; a path that
    several nodes hold in different versions is refused before anything is
    copied.  Identical versions (same size and mtime) are written once.  A path of
    ``dst`` changed since bbio last wrote or read it there (by a stage-out into
    ``dst``, or the stage-in from ``dst`` that ``src`` came from) is refused too,
    unless ``overwrite``.  Directories that exist in ``dst`` keep their mode and
    mtime; a symlink in ``dst`` to a directory outside it is written through.
    ``dst/.bbio/manifest.json`` is written last.

    Every rank must pass the same arguments, every node must hold ``src``, and
    ``dst`` (one directory for all nodes: no ``{node}``) must not lie inside a
    node's ``src``: else every rank raises the same error.  A copy that
    ``verify`` finds damaged is kept with its mtime set to 0 (4 s if the source's is
    within 2 s of 0), so that a rerun copies it again.
    """
    config = agreed_config(comm, "stage-out", config)
    agree_on_arguments(
        comm,
        "stage-out",
        config,
        {
            "src": src,
            "dst": dst,
            "verify": verify,
            "include": include,
            "exclude": exclude,
            "skip_unreadable": skip_unreadable,
            "overwrite": overwrite,
        },
    )
    check_no_node(dst, "destination", "stage-out")
    start = time.monotonic()
    topo = topology(comm, config.ranks_per_node)
    try:
        return _stage_out(
            comm,
            topo,
            src,
            Path(config.expand(dst)),
            verify,
            include,
            exclude,
            skip_unreadable,
            overwrite,
            config,
            start,
        )
    finally:
        topo.free()


def _read_destination_records(
    comm, root: Path
) -> tuple[Manifest | None, Manifest | None, list[Entry]]:
    """Collective over ``comm``: the manifest of the stage-out destination ``root``, its
    pending record (:data:`PENDING`, None once the manifest was written after it) and the
    earlier versions the manifest keeps (:func:`plan.earlier_versions`), read by rank 0.
    A damaged one is every rank's :class:`IntegrityError`."""
    found: tuple[Manifest | None, Manifest | None, list[Entry]] = (None, None, [])
    with agreed(comm, "stage-out: reading the previous manifest"):
        if comm.Get_rank() == 0:
            manifest = files.read_manifest(root)
            pending = plan.live_pending(manifest, files.read_manifest(root, PENDING))
            earlier = plan.earlier_versions(manifest, str(files.manifest_path(root)))
            found = (manifest, pending, earlier)
    return comm.bcast(found, root=0)


def _recorded_versions(
    comm,
    topo: Topology,
    src_root: Path,
    dst_root: Path,
    written: Iterable[Entry],
    paths: Sequence[str],
) -> tuple[dict[str, list[Entry]], dict[str, list[Entry]]]:
    """Collective over ``comm``: for ``paths``, the versions stage-out wrote in ``dst_root``
    (of ``written``: its manifest's entries and earlier versions, its pending record's)
    and those bbio read there (of the stage-in manifest each node's ``src_root`` holds
    when it was copied from ``dst_root``; one that cannot be read is no record, with a
    warning)."""
    wanted = set(paths)
    source = str(dst_root.resolve())

    def stage_in_record() -> list[Entry]:
        if not (topo.is_leader and wanted):
            return []
        try:
            found = _nearest_manifest(src_root)
        except BBIOError as exc:
            log.warning("stage-out: node %d: ignoring its stage-in manifest: %s", topo.node, exc)
            return []
        if found is None or found[0].kind != "stage-in":
            return []
        manifest, below = found  # SRC is the copy of source/below: DST itself, if equal
        if os.path.normpath(os.path.join(str(manifest.attrs.get("source")), below)) != source:
            return []
        prefix = "" if below == "." else below + "/"
        return [
            dataclasses.replace(e, path=e.path[len(prefix) :])
            for e in manifest.entries
            if e.path.startswith(prefix) and e.path[len(prefix) :] in wanted
        ]

    def by_path(versions: Iterable[Entry]) -> dict[str, list[Entry]]:
        found: dict[str, list[Entry]] = {}
        for e in versions:
            if e.path in wanted and e not in found.setdefault(e.path, []):
                found[e.path].append(e)
        return found

    what = "stage-out: reading the manifest of the stage-in each source came from"
    read = agreed_allgather(comm, what, stage_in_record)
    return by_path(written), by_path(itertools.chain(*read))


def _nearest_manifest(root: Path) -> tuple[Manifest, str] | None:
    """The manifest of ``root``, or else of its nearest directory above that has one (a
    subtree of a staged tree), with ``root``'s path below that directory (``"."`` for
    ``root`` itself); None if none has.  Not collective."""
    root = root.resolve()
    for top in (root, *root.parents):
        manifest = files.read_manifest(top)
        if manifest is not None:
            return manifest, root.relative_to(top).as_posix()
    return None


def _leading_out(comm, root: Path, links: Sequence[str]) -> set[str]:
    """Collective over ``comm``: the symlinks ``links`` under ``root`` that lead to a
    directory outside ``root`` (looked at by rank 0)."""
    found: set[str] = set()
    if comm.Get_rank() == 0:
        inside = os.path.realpath(root)
        for link in links:
            target = os.path.realpath(root / link)
            if os.path.isdir(target) and os.path.commonpath([inside, target]) != inside:
                found.add(link)
    return comm.bcast(found, root=0)


def _probe_destinations(comm, root: Path, outward: Iterable[str]) -> int:
    """Collective over ``comm``: the coarsest granularity (ns) at which the destination
    ``root`` and the directories its symlinks ``outward`` lead to (which may lie on other
    file systems) keep mtimes (:func:`probe_mtime_granularity`, by rank 0).  A probe that
    fails is every rank's error."""
    granularity = 1
    with agreed(comm, f"stage-out: probing the mtimes kept in {root} and where its symlinks lead"):
        if comm.Get_rank() == 0:
            targets = {root, *(Path(os.path.realpath(root / link)) for link in outward)}
            granularity = max(probe_mtime_granularity(target) for target in sorted(targets))
    return comm.bcast(granularity, root=0)


def _parents(documents: Iterable[Manifest | None]) -> set[str]:
    """The directories that held the entries of ``documents`` (where their temporary
    files were)."""
    return {posixpath.dirname(e.path) for d in documents if d is not None for e in d.entries}


def _record_pending(
    root: Path,
    old: Manifest | None,
    recorded: Sequence[Entry],
    pending: Manifest | None,
    changing: Sequence[Entry],
) -> str:
    """Not collective: before anything under ``root`` changes, add the versions about to be
    written there (``changing``) and those they replace (of ``recorded``: every version
    stage-out wrote or began to write there) to its pending record, so that the next run
    knows them for bbio's if this one is interrupted; then withdraw their entries from
    ``old``, its manifest.  Returns the record's token, for the manifest to name."""
    paths = {e.path for e in changing}
    begun = pending.entries if pending is not None else []
    replaced = [e for e in recorded if e.path in paths]
    token = os.urandom(8).hex()
    versions = list(dict.fromkeys([*begun, *replaced, *changing]))
    files.write_manifest(
        root, Manifest("stage-out", versions, {plan.PENDING_TOKEN: token}), PENDING
    )
    if old is not None:
        files.withdraw_entries(root, old, [e.path for e in changing if e.kind != DIR])
    return token


def _forget_pending(root: Path) -> None:
    """Not collective: remove the pending record of ``root`` (its manifest lists it all)."""
    record = files.manifest_path(root, PENDING)
    try:
        record.unlink(missing_ok=True)
    except OSError as exc:
        raise from_oserror(exc, "remove", record) from None


def _refuse_replacing(root: Path, destination: plan.Destination) -> None:
    """Raise the :class:`AlreadyExistsError` that lists what stage-out must not replace in
    ``root``, unless there is nothing.  Not collective (every rank has the same plan)."""
    blocking = []
    if destination.in_the_way:
        blocking.append(
            f"{len(destination.in_the_way)} directory(ies) of the source where a file is: "
            + "; ".join(destination.in_the_way[:20])
        )
    if destination.dirs_in_the_way:
        blocking.append(
            f"{len(destination.dirs_in_the_way)} file(s) or symlink(s) of the source where a "
            "directory is: " + "; ".join(destination.dirs_in_the_way[:20])
        )
    if blocking:
        raise AlreadyExistsError(
            f"stage-out cannot make, in {root}, " + ", and ".join(blocking),
            path=root,
            hint="move aside or remove what is in the way there (or leave those paths of "
            "the source out with --exclude); --overwrite replaces neither a file by a "
            "directory nor a directory by a file",
        )
    parts = []
    if destination.changed:
        parts.append(
            f"{len(destination.changed)} path(s) changed since bbio last wrote or read them "
            "there: " + "; ".join(destination.changed[:20])
        )
    if destination.foreign_links:
        parts.append(
            f"{len(destination.foreign_links)} symlink(s) of yours (bbio writes through one "
            "only where the source has a directory and it leads to a directory outside the "
            "destination): " + "; ".join(destination.foreign_links[:20])
        )
    if parts:
        raise AlreadyExistsError(
            f"stage-out would replace, in {root}, " + ", and ".join(parts),
            path=root,
            hint="move aside what you want to keep (or leave it out with --exclude), "
            "or pass --overwrite (overwrite=True) to replace it",
        )


def _stage_out(
    comm,
    topo,
    src,
    dst_root,
    verify,
    include,
    exclude,
    skip_unreadable,
    overwrite,
    config,
    start,
):
    src_root = config.node_dir(src, topo.node, topo.nodes_on_host)
    with agreed(comm, "stage-out: checking the sources and the destination"):
        if topo.is_leader:
            check_source(src_root, topo.node)
            check_outside(src_root, dst_root, topo.node)
        if comm.Get_rank() == 0:
            check_destination(dst_root)
    listers = config.stage_threads(topo.node_comm.Get_size())
    tree = None
    with agreed(comm, "stage-out: walking the source of every node"):
        tree = walk(topo.node_comm, src_root, include, exclude, listers)
    problems: list[Skipped] = []
    with agreed(comm, "stage-out: checking that every source file is readable"):
        problems = check_readable(tree, skip_unreadable, f"{src_root} (node {topo.node})")
    entries = plan.without(tree.entries, {p.path for p in problems})
    trees = comm.allgather(entries if topo.is_leader else None)
    trees = [t for t in trees if t is not None]
    chosen, conflicts = plan.merge_node_trees(trees)
    merged = {e.path: e for node_entries in reversed(trees) for e in node_entries}
    everything = [merged[p] for p in sorted(merged)]
    dirs = [e for e in everything if e.kind == DIR]
    seen = dest_state(comm, dst_root, [e.path for e in everything])
    links = [d.path for d in dirs if d.path in seen and seen[d.path].kind == SYMLINK]
    outward = _leading_out(comm, dst_root, links)
    granularity = max(  # the coarsest of the destination's, its outward targets', the sources'
        _probe_destinations(comm, dst_root, outward),
        *(plan.tree_mtime_granularity(node_entries) for node_entries in trees),
    )
    old, pending, earlier = _read_destination_records(comm, dst_root)
    recorded = [  # every version stage-out wrote, or began to write, in dst_root
        *(old.entries if old is not None else []),
        *earlier,
        *(pending.entries if pending is not None else []),
    ]
    written, read = _recorded_versions(
        comm, topo, src_root, dst_root, recorded, plan.to_check(everything, seen, granularity)
    )
    destination = plan.plan_destination(
        everything, seen, written, read, outward, overwrite, granularity
    )
    current = destination.current
    todo_all = plan.to_copy(everything, current, granularity)
    differing = _differing_copies(comm, topo, src_root, trees, {e.path for e in todo_all})
    conflicts = sorted([*conflicts, *differing], key=lambda c: c.path)
    if conflicts:
        listing = "; ".join(
            f"{c.path} (nodes {', '.join(map(str, c.nodes))})" for c in conflicts[:20]
        )
        raise AlreadyExistsError(
            f"{len(conflicts)} path(s) exist on several nodes in different versions: {listing}",
            path=dst_root,
            hint="give each node's outputs distinct names (for example include the node or rank)",
        )
    _refuse_replacing(dst_root, destination)
    skipped = sorted(
        [
            s
            for part in comm.allgather(tree.skipped + problems if topo.is_leader else [])
            for s in part
        ],
        key=lambda s: s.path,
    )
    made_before = {e.path for e in pending.entries if e.kind == DIR} if pending else set()
    created = plan.created_dirs(dirs, destination, made_before)
    chmod = plan.to_chmod(everything, current, _recorded_modes(old), granularity)
    remove_leftovers(comm, dst_root, [], {*(d.path for d in dirs), *_parents((old, pending))})
    mine = [e for e in todo_all if chosen[e.path] == topo.node]
    token = pending.attrs.get(plan.PENDING_TOKEN) if pending is not None else None
    with agreed(comm, "stage-out: checking space and creating directories"):
        if comm.Get_rank() == 0:
            _check_capacity(
                dst_root,
                plan.bytes_needed(todo_all),
                None,
                "free space there, or stage out fewer files (--include/--exclude)",
            )
            if todo_all or created:
                token = _record_pending(dst_root, old, recorded, pending, [*todo_all, *created])
            _make_dirs(dst_root, created, None)
            _set_modes(dst_root, chmod)
    comm.Barrier()
    job = _Transfer(
        comm, topo, config, "stage-out", src_root, dst_root, False, skip_unreadable, skipped
    )
    copied = _copy_loop(job, [e for e in mine if e.kind == FILE])
    links_made = 0
    with agreed(comm, "stage-out: creating symlinks"):
        if topo.is_leader:
            links_made = _commit_symlinks(dst_root, [e for e in mine if e.kind == SYMLINK])
    comm.Barrier()
    todo_paths = {e.path for e in todo_all}
    unchanged = [e for e in everything if e.kind == FILE and e.path not in todo_paths]
    crcs = allgather_dict(comm, copied.crcs if topo.is_leader else {})
    as_copied = {**merged, **allgather_dict(comm, copied.entries if topo.is_leader else {})}
    with agreed(comm, "stage-out: checksums of files already in place"):
        crcs.update(_crcs_of_unchanged(comm, dst_root, unchanged, old, granularity_ns=granularity))
    if verify:
        with agreed(comm, "stage-out: verifying"):
            _verify_copies(comm, dst_root, crcs, as_copied, None, delete=False)
    given_up = {s.path for s in skipped}
    with agreed(comm, "stage-out: finishing directories and writing the manifest"):
        if comm.Get_rank() == 0:
            _finish_dirs(dst_root, created)
            listed = [
                as_copied[e.path].committed(crcs.get(e.path), chosen[e.path])
                for e in everything
                if e.path not in given_up
            ]
            carried = plan.carried_versions(recorded, {e.path for e in listed})
            files.write_manifest(
                dst_root,
                Manifest(
                    "stage-out",
                    listed,
                    {
                        "source": str(src),
                        "nodes": topo.nodes,
                        "verified": verify,
                        "skipped": [dataclasses.asdict(s) for s in skipped],
                        "pending": token,  # the pending record it makes spent
                        plan.EARLIER: [e.to_json() for e in carried],
                    },
                ),
            )
            _forget_pending(dst_root)
    totals = sum_over_ranks(
        comm, *((copied.files + links_made, copied.bytes_written) if topo.is_leader else (0, 0))
    )
    _warn(comm, skipped)
    return StageSummary(
        operation="stage-out",
        mode="",
        nodes=topo.nodes,
        files=totals[0],
        unchanged=len(unchanged),
        dataset_bytes=plan.bytes_needed(everything),
        bytes_written=totals[1],
        source_bytes_read=copied.source_bytes_read,
        seconds=comm.allreduce(time.monotonic() - start, op=_max()),
        verified=verify,
        skipped=skipped,
        warnings=_nothing_selected(everything, include, exclude),
    )
