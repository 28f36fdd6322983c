"""Executors: carry out a copy plan with MPI and the native core.

Two ways to move pieces into the temporary files that :mod:`bbio.transfer.files`
prepared:

* :func:`copy_direct`: each rank of a team copies its pieces from the source
  file to the destination file itself (native copy, CRC32C in the same pass).
* :func:`copy_broadcast`: replicate mode across nodes.  The ranks with the same
  node-local rank on every node form a *column*; the members of a column read
  disjoint pieces from the source (native batched reads), exchange them with
  one ``Allgatherv`` per round, and each writes all of them to its own node.
  Every byte is read from the source once, whatever the node count.

Both return the per-piece results this rank holds for its node, keyed by
(path, offset), and count bytes read from the source.  An error names the
node it happened on (:func:`located`); in :func:`copy_broadcast`, the members
of a column agree on it round by round, so none is left in an exchange.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bbio import _native
from bbio.errors import (
    CLASSES_BY_NAME,
    BBIOError,
    CollectiveError,
    IntegrityError,
    NoSpaceError,
    from_oserror,
)
from bbio.mpi import describe_error
from bbio.stage.plan import Piece, group_by_size, replicate_rounds
from bbio.stage.progress import Progress
from bbio.transfer.files import PieceResult, copy_piece, open_source, temp_name, temp_path
from bbio.transfer.manifest import Entry

PieceKey = tuple[str, int]
# A batch of whole files handed to the native batched copy: about this many
# bytes, each file counting for BATCH_FILE_BYTES more (so batches of tiny files
# stay short enough for progress reports).
BATCH_BYTES = 64 << 20
BATCH_FILE_BYTES = 256 << 10
FULL_HINT = (
    "the destination filled up during the copy: free space there, or transfer fewer files "
    "(--include/--exclude); this round's temporary files were removed, and a rerun copies "
    "only what is missing"
)


@contextmanager
def located(node: int) -> Iterator[None]:
    """Not collective: a bbio error raised in the block names ``node`` (unless it names
    one already), and a full device gets advice."""
    try:
        yield
    except BBIOError as exc:
        if exc.node is None:
            exc.node = node
        if isinstance(exc, NoSpaceError) and not exc.hint:
            exc.hint = FULL_HINT
        raise


@dataclasses.dataclass
class Outcome:
    """What one rank did: results of the pieces it wrote, bytes read from the source."""

    pieces: dict[PieceKey, PieceResult] = dataclasses.field(default_factory=dict)
    source_bytes_read: int = 0
    sealed: set[str] = dataclasses.field(default_factory=set)  # mode, mtime set and fsynced


def whole_file(piece: Piece, entry: Entry) -> bool:
    """True if ``piece`` is all of its file (copied by one rank, in a batch)."""
    return piece.offset == 0 and piece.length == entry.size


def _copy_whole_files(
    batches: Sequence[Sequence[Piece]],
    entries: Mapping[str, Entry],
    src_root: Path,
    dst_root: Path,
    outcome: Outcome,
    progress: Progress,
    threads: int,
    buffer_size: int,
) -> None:
    """Copy whole files batch by batch with the native batched copy, on a worker thread:
    the names of the next batch are made, and the results of the last one recorded,
    while a batch is copied."""

    src, dst = os.fspath(src_root), os.fspath(dst_root)

    def start(batch: Sequence[Piece]) -> Future:
        return copier.submit(
            _native.copy_files,
            [f"{src}/{p.path}" for p in batch],
            [temp_name(f"{dst}/{p.path}") for p in batch],
            threads=threads,
            buffer_size=buffer_size,
            modes=[entries[p.path].mode for p in batch],
            mtimes_ns=[entries[p.path].mtime_ns for p in batch],
        )

    with ThreadPoolExecutor(1, "bbio-copy") as copier:
        running: tuple[Sequence[Piece], Future] | None = None
        for batch in [*batches, None]:
            following = None if batch is None else (batch, start(batch))
            if running is not None:
                _record_copies(running[0], running[1].result(), entries, outcome)
                progress.add(sum(p.length for p in running[0]), len(running[0]))
                progress.update()
            running = following


def _record_copies(
    pieces: Sequence[Piece],
    results: Sequence[_native.FileCopy],
    entries: Mapping[str, Entry],
    outcome: Outcome,
) -> None:
    for piece, result in zip(pieces, results, strict=True):
        if result.error is not None:
            raise result.error
        if result.source_not_regular:  # changed since the walk: looked at again
            outcome.pieces[(piece.path, 0)] = PieceResult(0, 0, True)
            continue
        entry = entries[piece.path]
        changed = (
            result.nbytes != entry.size
            or result.size_after != entry.size
            or result.mtime_ns_after != entry.mtime_ns
        )
        outcome.pieces[(piece.path, 0)] = PieceResult(result.nbytes, result.crc32c, changed)
        outcome.source_bytes_read += result.nbytes
        outcome.sealed.add(piece.path)


def copy_direct(
    team_comm,
    pieces_by_rank: Sequence[Sequence[Piece]],
    entries: Mapping[str, Entry],
    src_root: Path,
    dst_root: Path,
    progress: Progress,
    buffer_size: int,
    threads: int,
) -> Outcome:
    """Collective over ``team_comm``: every rank copies ``pieces_by_rank[its rank]``.

    Whole small files go in batches to the native batched copy (``threads``
    files in flight); pieces of large files are copied one by one into the
    temporary files their owners prepared.
    """
    outcome = Outcome()
    mine = pieces_by_rank[team_comm.Get_rank()]
    whole = [p for p in mine if whole_file(p, entries[p.path])]
    partial = [p for p in mine if not whole_file(p, entries[p.path])]
    batches = group_by_size(whole, BATCH_BYTES, lambda p: p.length + BATCH_FILE_BYTES)
    _copy_whole_files(batches, entries, src_root, dst_root, outcome, progress, threads, buffer_size)
    for piece in partial:
        entry = entries[piece.path]
        result = copy_piece(
            src_root / piece.path,
            temp_path(dst_root / piece.path),
            piece.offset,
            piece.length,
            entry.size,
            entry.mtime_ns,
            buffer_size,
        )
        outcome.pieces[(piece.path, piece.offset)] = result
        outcome.source_bytes_read += result.nbytes
        progress.add(result.nbytes, int(piece.offset == 0))
        progress.update()
    return outcome


@dataclasses.dataclass(frozen=True)
class Columns:
    """The column layout of replicate mode."""

    comm: object | None  # this rank's column communicator (None: not in any column)
    count: int  # columns: the smallest node's rank count
    index: int  # this rank's column (its node-local rank)
    member: int  # this rank's index in its column (its node index)


def make_columns(comm, node: int, node_rank: int, node_size: int) -> Columns:
    """Collective over ``comm``: one column per node-local rank present on every node."""
    from mpi4py import MPI

    count = comm.allreduce(node_size, op=MPI.MIN)
    color = node_rank if node_rank < count else MPI.UNDEFINED
    column = comm.Split(color=color, key=node)
    return Columns(None if column == MPI.COMM_NULL else column, count, node_rank, node)


def _open_all(root: Path, paths: Iterable[str], threads: int) -> dict[str, int]:
    """Open ``paths`` for reading, ``threads`` at a time (opens are slow on a PFS); a path
    gone or no longer a regular file (:func:`open_source`) is left out."""
    paths = list(paths)
    fds: dict[str, int] = {}

    def open_one(path: str) -> tuple[str, int | BaseException | None]:
        try:
            return path, open_source(root / path)
        except BBIOError as exc:
            return path, exc

    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        opened = list(pool.map(open_one, paths))
    problem = None
    for path, result in opened:
        if isinstance(result, int):
            fds[path] = result
        elif result is not None and problem is None:
            problem = result
    if problem is not None:
        for fd in fds.values():
            os.close(fd)
        raise problem
    return fds


def _read_round(
    pieces: Sequence[Piece], entries: Mapping[str, Entry], src_root: Path, threads: int
) -> tuple[np.ndarray, list[int], list[bool]]:
    """Read ``pieces`` into one buffer; return it, each piece's CRC32C and 'changed' flag."""
    lengths = [p.length for p in pieces]
    starts = np.zeros(len(pieces), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    buffer = np.zeros(sum(lengths), dtype=np.uint8)
    fds: dict[str, int] = {}
    got = [0] * len(pieces)  # a piece of a file gone or no longer regular: none read, changed
    try:
        fds.update(_open_all(src_root, dict.fromkeys(p.path for p in pieces), threads))
        readable = [i for i, p in enumerate(pieces) if p.path in fds]
        read = _native.pread_batch(
            [fds[pieces[i].path] for i in readable],
            [pieces[i].offset for i in readable],
            [lengths[i] for i in readable],
            buffer,
            [starts[i] for i in readable],
            threads=threads,
            paths=[src_root / pieces[i].path for i in readable],
        )
        for i, n in zip(readable, read, strict=True):
            got[i] = int(n)
        after = {path: os.fstat(fd) for path, fd in fds.items()}
    finally:
        for fd in fds.values():
            os.close(fd)
    crcs, changed = [], []
    for p, n, start in zip(pieces, got, starts, strict=True):
        crcs.append(_native.crc32c(buffer[start : start + p.length]))
        entry, st = entries[p.path], after.get(p.path)
        changed.append(
            st is None
            or bool(n != p.length or st.st_size != entry.size or st.st_mtime_ns != entry.mtime_ns)
        )
    return buffer, crcs, changed


def _write_pieces(
    pieces: Sequence[Piece],
    data: np.ndarray,
    crcs: Sequence[int],
    changed: Sequence[bool],
    wanted: set[str],
    dst_root: Path,
    outcome: Outcome,
    progress: Progress,
    sender: int,
) -> None:
    start = 0
    for p, crc, moved in zip(pieces, crcs, changed, strict=True):
        chunk = data[start : start + p.length]
        start += p.length
        if p.path not in wanted:
            continue
        if _native.crc32c(chunk) != crc:
            raise IntegrityError(
                f"bytes of {p.path} at offset {p.offset} changed in transit from node {sender}",
                hint="check the interconnect; rerun the command",
            )
        target = temp_path(dst_root / p.path)
        try:
            fd = os.open(target, os.O_WRONLY)
            try:
                view = memoryview(chunk)
                offset = p.offset
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
            finally:
                os.close(fd)
        except OSError as exc:
            raise from_oserror(exc, "write", target) from None
        outcome.pieces[(p.path, p.offset)] = PieceResult(p.length, crc, moved)
        progress.add(p.length, int(p.offset == 0))
        progress.update()


def copy_broadcast(
    columns: Columns,
    pieces: Sequence[Piece],
    nodes: int,
    wanted: set[str],
    entries: Mapping[str, Entry],
    src_root: Path,
    dst_root: Path,
    progress: Progress,
    round_bytes: int,
    threads: int,
) -> Outcome:
    """Collective over the whole communicator: replicate ``pieces`` to every node.

    ``pieces`` is the whole plan (pieces of at most ``round_bytes``); it is split over
    ``nodes`` x ``columns.count`` readers, in rounds (:func:`replicate_rounds`).
    ``wanted`` holds the paths this rank's node still needs.
    """
    from mpi4py import MPI

    outcome = Outcome()
    if columns.comm is None:
        return outcome
    failed: Exception | None = None  # this rank's error, told to its column at the next exchange
    for round_pieces in replicate_rounds(pieces, nodes, columns.count, columns.index, round_bytes):
        counts = [sum(p.length for p in rp) for rp in round_pieces]
        displs = [sum(counts[:i]) for i in range(len(counts))]
        crcs: list[int] = []
        changed: list[bool] = []
        if failed is None:
            with _held(columns.member) as held:
                buffer, crcs, changed = _read_round(
                    round_pieces[columns.member], entries, src_root, threads
                )
                outcome.source_bytes_read += int(buffer.size)
                received = np.empty(sum(counts), dtype=np.uint8)
            failed = held.error
        # Every member's read and buffer are agreed on before the bytes move: a member
        # that failed (even to allocate) never leaves the others in the Allgatherv.
        meta = columns.comm.allgather((crcs, changed, _described(failed)))
        _raise_first(meta, failed)
        columns.comm.Allgatherv(buffer, [received, counts, displs, MPI.BYTE])
        with _held(columns.member) as held:
            for sender, (sender_pieces, (sender_crcs, sender_changed, _)) in enumerate(
                zip(round_pieces, meta, strict=True)
            ):
                data = received[displs[sender] : displs[sender] + counts[sender]]
                _write_pieces(
                    sender_pieces,
                    data,
                    sender_crcs,
                    sender_changed,
                    wanted,
                    dst_root,
                    outcome,
                    progress,
                    sender,
                )
        failed = held.error
        progress.update()
    _raise_first(columns.comm.allgather((None, None, _described(failed))), failed)
    return outcome


@dataclasses.dataclass
class _Held:
    """The error a :func:`_held` block raised (None if none)."""

    error: Exception | None = None


@contextmanager
def _held(node: int) -> Iterator[_Held]:
    """Not collective: keep the error the block raises (located on ``node``) instead of
    raising it, so that the rank still takes part in its column's exchanges."""
    held = _Held()
    try:
        with located(node):
            yield held
    except Exception as exc:
        held.error = exc


def _described(error: Exception | None) -> tuple[str, str, int | None] | None:
    return None if error is None else describe_error(error)


def _raise_first(meta: Sequence[tuple], mine: Exception | None) -> None:
    """Raise, on every member of a column, the error of its first member that failed
    (the same class, message and errno everywhere); return if none did."""
    failures = [(member, m[2]) for member, m in enumerate(meta) if m[2] is not None]
    if not failures:
        return
    member, (name, message, errno) = failures[0]  # a member is a node: bbio errors say it
    cls = CLASSES_BY_NAME.get(name)
    if cls is None:
        raise CollectiveError(f"node {member}: {name}: {message}") from mine
    raise cls(message, errno=errno) from mine
