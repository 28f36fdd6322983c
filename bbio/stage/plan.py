"""Planning for staging: who copies which bytes, as pure functions of plain data.

Nothing here touches MPI or the file system; the executors in
:mod:`bbio.stage.run` carry the plans out.  Every rank computes the same plan
from the same inputs.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

from bbio.errors import IntegrityError
from bbio.transfer.manifest import DIR, FILE, SYMLINK, Entry, Manifest, sorted_entries

# What opening, creating and committing one file costs, in bytes of transfer
# time: it makes many small files count for more than their bytes alone.
FILE_COST_BYTES = 256 << 10

# Files a reader holds open at once (pack's slabs, replicate's rounds): well below the usual
# limit of 1024 descriptors a process may hold, whatever the files' sizes.
OPEN_FILES_AT_ONCE = 256

# The most bytes one MPI call may count or displace without MPI-4's large-count calls (a C
# int): Open MPI 4.1 has none, and mpi4py then passes counts and displacements as ints.
MPI_INT_MAX = 2**31 - 1

# The mtime granularities a destination may keep (ns): exact, µs, ms, s (Lustre, BeeGFS,
# ext4 with 128-byte inodes), 2 s (FAT); and the mtimes that probe it, with sub-second
# digits at every scale, an odd and an even second (1 s and 2 s then round each apart).
MTIME_GRANULARITIES_NS = (1, 1_000, 1_000_000, 1_000_000_000, 2_000_000_000)
MTIME_PROBES_NS = (1_500_000_001_987_654_321, 1_500_000_002_987_654_321)

# The fewest files whose mtimes tell a source's granularity (:func:`tree_mtime_granularity`):
# fewer are compared as they are.
MTIME_INFERENCE_MIN_FILES = 4

# The attribute of a stage-out's pending record that the manifest written after it names
# (as its "pending"): a record the manifest names is spent.
PENDING_TOKEN = "token"

# The attribute of a stage-out's manifest that lists the versions earlier stage-outs wrote (or
# began to write) at paths this one did not write: left out by its filters, skipped, gone from
# the burst buffers, written by another job.  Still bbio's for the change check; never checked
# by ``bbio verify``, which compares the source with the manifest's entries.
EARLIER = "earlier"

# The attribute of the manifest a stage-in of another source leaves while it copies (and if
# it fails): the destination then holds files of both sources, and vouches for neither.
MIXED_SOURCES = "mixed_sources"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Piece:
    """A byte range of one file: the unit of copying."""

    path: str
    offset: int
    length: int


PERMISSION_BITS = 0o777  # compared and set again; set-ID bits a chmod may refuse are not


@dataclasses.dataclass(frozen=True)
class DestState:
    """What a destination path holds now (from ``lstat``)."""

    kind: str
    size: int
    mtime_ns: int
    target: str | None = None
    mode: int | None = None  # permission bits of a file


def mtime_granularity(probes: Iterable[tuple[int, int]]) -> int:
    """The granularity (ns) at which a file system keeps mtimes, from ``probes``: pairs of
    an mtime set on a file (:data:`MTIME_PROBES_NS`) and the one read back.  The smallest
    of :data:`MTIME_GRANULARITIES_NS` whose truncation or rounding up explains every
    pair; 1 (compare exactly) if none does."""
    probes = list(probes)
    for granularity in MTIME_GRANULARITIES_NS:
        if all(
            read in (wrote - wrote % granularity, -(-wrote // granularity) * granularity)
            for wrote, read in probes
        ):
            return granularity
    return 1


def tree_mtime_granularity(entries: Iterable[Entry]) -> int:
    """The granularity (ns) at which the file system of a walked tree seems to keep mtimes,
    from its ``entries``: the largest of :data:`MTIME_GRANULARITIES_NS` that divides every
    file's mtime, given at least :data:`MTIME_INFERENCE_MIN_FILES` files; 1 (compare
    exactly) with fewer.  Inferred, never probed: a source may be read-only.  A tree whose
    mtimes are all whole seconds on a finer file system (unpacked from tar) is compared at
    1 s, which is harmless: its copies carry those mtimes, and a file rewritten there since
    gets sub-second digits, which make the tree compared exactly again."""
    mtimes = [e.mtime_ns for e in entries if e.kind == FILE]
    if len(mtimes) < MTIME_INFERENCE_MIN_FILES:
        return 1
    return next(
        granularity
        for granularity in sorted(MTIME_GRANULARITIES_NS, reverse=True)
        if all(mtime % granularity == 0 for mtime in mtimes)
    )


def same_mtime(a_ns: int, b_ns: int, granularity_ns: int) -> bool:
    """Whether the mtimes ``a_ns`` and ``b_ns`` are one at ``granularity_ns``, the coarser of
    the source's and the destination's: equal, or (granularity above 1 ns) less than one
    granularity apart, as truncating or rounding up leaves them (rsync's
    ``--modify-window``).  Symmetric: either may be the one kept coarsely."""
    return a_ns == b_ns or (granularity_ns > 1 and abs(a_ns - b_ns) < granularity_ns)


def up_to_date(src: Entry, dst: DestState | None, granularity_ns: int = 1) -> bool:
    """True if ``dst`` already is this version of ``src`` (same kind, size, mtime at
    ``granularity_ns`` (:func:`same_mtime`), target).

    A committed copy carries its source's mtime, and never appears under its
    final name before it is complete, so this is enough to skip it on a rerun.
    """
    if dst is None or dst.kind != src.kind:
        return False
    if src.kind == SYMLINK:
        return dst.target == src.target
    return src.kind == DIR or (
        dst.size == src.size and same_mtime(dst.mtime_ns, src.mtime_ns, granularity_ns)
    )


def _ancestors(path: str) -> Iterator[str]:
    """The directories above ``path`` ("a/b/c": "a/b", then "a")."""
    cut = path.rfind("/")
    while cut > 0:
        path = path[:cut]
        yield path
        cut = path.rfind("/")


def without(entries: Iterable[Entry], paths: Collection[str]) -> list[Entry]:
    """``entries`` but those of ``paths`` and those below them."""
    if not paths:
        return list(entries)
    return [
        e
        for e in entries
        if e.path not in paths and not any(p in paths for p in _ancestors(e.path))
    ]


def not_through_symlinks(
    dest: Mapping[str, DestState], followed: Collection[str] = ()
) -> dict[str, DestState]:
    """``dest`` without the paths below one of its symlinks, but for those ``followed``:
    what was seen through a symlink (a copy of an earlier source symlink, replaced by a
    directory before the copy) is not in the destination."""
    links = {path for path, state in dest.items() if state.kind == SYMLINK} - set(followed)
    if not links:
        return dict(dest)
    return {
        path: state for path, state in dest.items() if not any(p in links for p in _ancestors(path))
    }


def kind_changes(entries: Iterable[Entry], dest: Mapping[str, DestState]) -> list[str]:
    """Stage-in: the paths of ``entries`` where the destination holds a directory and the
    source now has not, or the other way round (a symlink where the source has a
    directory is not one: it is replaced as it is, never followed).  What is there must
    go before the copy."""
    return [
        e.path
        for e in entries
        if e.path in dest
        and dest[e.path].kind != SYMLINK
        and (dest[e.path].kind == DIR) != (e.kind == DIR)
    ]


def to_copy(
    entries: Iterable[Entry], dest: Mapping[str, DestState], granularity_ns: int = 1
) -> list[Entry]:
    """The files and symlinks of ``entries`` whose destination is missing or different
    (mtimes compared at ``granularity_ns``)."""
    return [
        e for e in entries if e.kind != DIR and not up_to_date(e, dest.get(e.path), granularity_ns)
    ]


def to_chmod(
    entries: Iterable[Entry],
    dest: Mapping[str, DestState],
    recorded: Mapping[str, int],
    granularity_ns: int = 1,
) -> list[Entry]:
    """The files of ``entries`` up to date in ``dest`` (at ``granularity_ns``) but for their
    permission bits, whose source was chmod-ed since the copy (its mode differs from the
    one ``recorded`` in the copy's manifest): given the source's mode, not copied again.
    A copy whose mode only the destination's owner changed keeps it."""

    def source_changed(e: Entry, now: DestState | None) -> bool:
        mode = e.mode & PERMISSION_BITS
        if now is None or now.mode is None or now.mode == mode or e.path not in recorded:
            return False
        return recorded[e.path] & PERMISSION_BITS != mode

    return [
        e
        for e in entries
        if e.kind == FILE
        and up_to_date(e, dest.get(e.path), granularity_ns)
        and source_changed(e, dest.get(e.path))
    ]


def split_pieces(files: Iterable[Entry], chunk_size: int) -> list[Piece]:
    """Cut files into pieces of at most ``chunk_size`` bytes (an empty file is one empty piece)."""
    pieces = []
    for f in files:
        if f.kind != FILE:
            continue
        if f.size <= chunk_size:  # one piece, an empty file too
            pieces.append(Piece(f.path, 0, f.size))
            continue
        for offset in range(0, f.size, chunk_size):
            pieces.append(Piece(f.path, offset, min(chunk_size, f.size - offset)))
    return pieces


def _cost(piece: Piece) -> int:
    return piece.length + (FILE_COST_BYTES if piece.offset == 0 else 0)


def partition(pieces: Sequence[Piece], parts: int) -> list[list[Piece]]:
    """Split ``pieces`` (in order) into ``parts`` contiguous runs of about equal cost.

    Contiguous runs keep files of one directory together; the cost of a piece
    is its bytes plus a fixed cost for starting a file.
    """
    total = sum(_cost(p) for p in pieces)
    result: list[list[Piece]] = [[] for _ in range(parts)]
    done = 0
    for piece in pieces:
        # the part whose share of the total cost this piece's midpoint falls in
        midpoint = done + _cost(piece) / 2
        index = min(parts - 1, int(midpoint * parts / total)) if total else 0
        result[index].append(piece)
        done += _cost(piece)
    return result


def group_by_size(
    items: Sequence[T], limit: int, size: Callable[[T], int], max_items: int | None = None
) -> list[list[T]]:
    """Group ``items``, in order, into runs of at most ``limit`` total size (and at most
    ``max_items`` items, if given).

    An item larger than ``limit`` forms a group of its own; no group is empty.
    Used for replicate rounds (pieces), pack shards and pack slabs (files).
    """
    groups: list[list[T]] = []
    current: list[T] = []
    used = 0
    for item in items:
        full = max_items is not None and len(current) >= max_items
        if current and (full or used + size(item) > limit):
            groups.append(current)
            current, used = [], 0
        current.append(item)
        used += size(item)
    if current:
        groups.append(current)
    return groups


def replicate_round_bytes(nodes: int, round_bytes: int) -> int:
    """The bytes a column member reads per replicate round, and the size of the pieces
    it reads: ``round_bytes``, or less when ``nodes`` times that would exceed
    :data:`MPI_INT_MAX`, so that every count and displacement of the round's
    ``Allgatherv`` (one member per node) fits in a C int."""
    return max(1, min(round_bytes, MPI_INT_MAX // nodes))


def replicate_rounds(
    pieces: Sequence[Piece], nodes: int, columns: int, column: int, round_bytes: int
) -> list[list[list[Piece]]]:
    """Replicate mode: what each member (node) of ``column`` reads in each round, as
    ``rounds[k][node]`` (maybe empty).  ``pieces`` (at most ``round_bytes`` each, of
    :func:`replicate_round_bytes`) are split over ``nodes`` x ``columns`` readers; a
    member's round holds at most ``round_bytes`` and :data:`OPEN_FILES_AT_ONCE` pieces."""
    parts = partition(pieces, nodes * columns)
    schedules = [
        group_by_size(
            parts[node * columns + column],
            round_bytes,
            lambda p: p.length,
            max_items=OPEN_FILES_AT_ONCE,
        )
        for node in range(nodes)
    ]
    count = max((len(s) for s in schedules), default=0)
    return [[s[k] if k < len(s) else [] for s in schedules] for k in range(count)]


def commit_rounds(sizes: Mapping[str, int], round_bytes: int) -> list[list[str]]:
    """The paths of ``sizes`` ({path: bytes}) in rounds of about ``round_bytes``, in path order.

    A file counts for its bytes plus :data:`FILE_COST_BYTES`; a file larger than
    a round is a round of its own.  Every node computes the same rounds from
    the union of all nodes' files, so the rounds' collectives match.
    """
    return group_by_size(sorted(sizes), round_bytes, lambda path: sizes[path] + FILE_COST_BYTES)


def assign_nodes(files: Iterable[Entry], nodes: int) -> dict[str, int]:
    """Shard mode: give each file to one node, balancing bytes (largest files first)."""
    heap = [(0, node) for node in range(nodes)]
    owner = {}
    for f in sorted(files, key=lambda e: (-(e.size + FILE_COST_BYTES), e.path)):
        load, node = heapq.heappop(heap)
        owner[f.path] = node
        heapq.heappush(heap, (load + f.size + FILE_COST_BYTES, node))
    return owner


def owners(pieces_by_rank: Sequence[Sequence[Piece]]) -> dict[str, int]:
    """Which rank commits each file: the one that copies its first piece."""
    result = {}
    for rank, pieces in enumerate(pieces_by_rank):
        for piece in pieces:
            if piece.offset == 0:
                result[piece.path] = rank
    return result


@dataclasses.dataclass(frozen=True)
class Conflict:
    """A path that several nodes hold in different versions (stage-out refuses it)."""

    path: str
    nodes: tuple[int, ...]


def merge_node_trees(trees: Sequence[Sequence[Entry]]) -> tuple[dict[str, int], list[Conflict]]:
    """Stage-out: choose the one node that writes each path of the merged tree.

    Identical versions (same kind, size, mtime, target) are written once, by
    the lowest node that has them; different versions are conflicts.
    """
    chosen: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    first: dict[str, Entry] = {}
    conflicting: set[str] = set()
    for node, entries in enumerate(trees):
        for e in entries:
            if e.path not in first:
                first[e.path] = e
                chosen[e.path] = node
                holders[e.path] = [node]
                continue
            holders[e.path].append(node)
            kinds = {first[e.path].kind, e.kind}
            if kinds != {DIR} and not first[e.path].same_version(e):  # a file and a dir too
                conflicting.add(e.path)
    conflicts = [Conflict(p, tuple(holders[p])) for p in sorted(conflicting)]
    return chosen, conflicts


def held_alike(trees: Sequence[Sequence[Entry]]) -> dict[str, tuple[int, ...]]:
    """Stage-out: the files several nodes hold with the same size and mtime, and those
    nodes.  Their bytes may still differ (two nodes writing a file of one size within
    one clock tick): the caller compares their checksums."""
    holders: dict[str, list[int]] = {}
    first: dict[str, Entry] = {}
    for node, entries in enumerate(trees):
        for e in entries:
            if e.kind != FILE:
                continue
            if e.path not in first:
                first[e.path], holders[e.path] = e, [node]
            elif first[e.path].same_version(e):
                holders[e.path].append(node)
    return {p: tuple(nodes) for p, nodes in holders.items() if len(nodes) > 1}


def differing_copies(
    alike: Mapping[str, Sequence[int]], crcs: Sequence[Mapping[str, int]]
) -> list[Conflict]:
    """The paths of ``alike`` whose holders' CRC32C (``crcs[node][path]``) differ."""
    return [
        Conflict(path, tuple(nodes))
        for path, nodes in sorted(alike.items())
        if len({crcs[n][path] for n in nodes}) > 1
    ]


def damaged_mtime(mtime_ns: int) -> int:
    """The mtime stage-out's verify gives a damaged copy of a file of mtime ``mtime_ns``, so
    that a rerun copies it again: 0, or 4 s when ``mtime_ns`` is less than 2 s from 0.  A
    multiple of 2 s, which every granularity of :data:`MTIME_GRANULARITIES_NS` keeps as it
    is, at least 2 s from ``mtime_ns``, so never :func:`same_mtime` as it at any of them,
    whichever granularity the run that marks it or the run that reads it found."""
    coarsest = MTIME_GRANULARITIES_NS[-1]
    return 0 if abs(mtime_ns) >= coarsest else 2 * coarsest


def is_recorded(
    now: DestState, read: Iterable[Entry], written: Iterable[Entry], granularity_ns: int = 1
) -> bool:
    """True if the destination's ``now`` is one of the versions bbio ``read`` or ``written``
    at its path (kind, size and mtime at ``granularity_ns``, or target), or the copy of a
    file stage-out ``written`` that its verify marked damaged (same size, exactly
    :func:`damaged_mtime`)."""
    written = list(written)
    for v in (*read, *written):
        if v.kind != now.kind:
            continue
        if v.kind == SYMLINK and v.target == now.target:
            return True
        if (
            v.kind == FILE
            and now.size == v.size
            and same_mtime(now.mtime_ns, v.mtime_ns, granularity_ns)
        ):
            return True
    return now.kind == FILE and any(
        v.kind == FILE and (now.size, now.mtime_ns) == (v.size, damaged_mtime(v.mtime_ns))
        for v in written
    )


def to_check(
    entries: Iterable[Entry], seen: Mapping[str, DestState], granularity_ns: int = 1
) -> list[str]:
    """Stage-out: the paths of ``entries`` whose destination (``seen``, also through
    symlinks; mtimes compared at ``granularity_ns``) :func:`plan_destination` compares with
    what bbio recorded: files and symlinks it holds in another version, and symlinks
    where the source has a directory."""
    return [
        e.path
        for e in entries
        if e.path in seen
        and (
            seen[e.path].kind == SYMLINK
            if e.kind == DIR
            else not up_to_date(e, seen[e.path], granularity_ns)
        )
    ]


@dataclasses.dataclass(frozen=True)
class Destination:
    """Stage-out: the destination as the copy sees it, and what it must not replace."""

    current: dict[str, DestState]  # what each path holds, through the followed symlinks
    followed: frozenset[str]  # the user's symlinks to directories outside it: written through
    replaced: frozenset[str]  # symlinks replaced by directories
    changed: list[str]  # files and symlinks changed since bbio wrote or read them: refused
    foreign_links: list[str]  # the user's other symlinks copying would replace: refused
    in_the_way: list[str]  # directories to make where a file is: refused, even with overwrite
    dirs_in_the_way: list[str]  # files and symlinks to write where a directory is: refused too


def plan_destination(
    entries: Sequence[Entry],
    seen: Mapping[str, DestState],
    written: Mapping[str, Sequence[Entry]],
    read: Mapping[str, Sequence[Entry]],
    outward: Collection[str],
    overwrite: bool,
    granularity_ns: int = 1,
) -> Destination:
    """Stage-out: what copying ``entries`` may do to the destination ``seen`` (its lstat,
    also through symlinks), comparing mtimes at ``granularity_ns``.

    ``written`` holds the versions stage-out last wrote at each path (the destination's
    manifest and pending record), ``read`` those the stage-in of the copy read there;
    ``outward``, the symlinks of ``seen`` that lead to a directory outside the
    destination.  A symlink where the source has a directory is replaced by a directory
    when it is a version bbio recorded, followed (written through) when it leads
    outward, else refused (``foreign_links``).  A file or symlink to copy whose
    destination holds a version other than those recorded for it is refused
    (``changed``); one with no record is replaced, as ``cp`` does, unless it is a
    symlink (``foreign_links``).  With ``overwrite`` none of them is refused: all are
    replaced.  A file where the source has a directory is refused (``in_the_way``), and
    so is a directory where it has a file or a symlink (``dirs_in_the_way``): neither
    is replaced, even with ``overwrite``.
    """

    def recorded(path: str, now: DestState) -> bool:
        return is_recorded(now, read.get(path, ()), written.get(path, ()), granularity_ns)

    followed: set[str] = set()
    replaced: set[str] = set()
    foreign: list[str] = []
    links = sorted(
        (e.path for e in entries if e.kind == DIR and e.path in seen),
        key=lambda path: path.count("/"),
    )
    for path in links:
        now = seen[path]
        if now.kind != SYMLINK or any(
            p in seen and seen[p].kind == SYMLINK and p not in followed for p in _ancestors(path)
        ):
            continue  # a directory, or seen through a symlink that is not followed
        if recorded(path, now):
            replaced.add(path)
        elif path in outward:
            followed.add(path)
        elif overwrite:
            replaced.add(path)
        else:
            foreign.append(f"{path} -> {now.target}")
    current = not_through_symlinks(seen, followed)
    changed: list[str] = []
    dirs_in_the_way: list[str] = []
    for e in to_copy(entries, current, granularity_ns):
        now = current.get(e.path)
        if now is not None and now.kind == DIR:
            dirs_in_the_way.append(e.path)
            continue
        if overwrite or now is None:
            continue
        if e.path in written or e.path in read:
            if not recorded(e.path, now):
                changed.append(e.path)
        elif now.kind == SYMLINK:
            foreign.append(f"{e.path} -> {now.target}")
    in_the_way = [
        e.path
        for e in entries
        if e.kind == DIR and e.path in current and current[e.path].kind == FILE
    ]
    return Destination(
        current,
        frozenset(followed),
        frozenset(replaced),
        changed,
        sorted(foreign),
        in_the_way,
        dirs_in_the_way,
    )


def live_pending(manifest: Manifest | None, pending: Manifest | None) -> Manifest | None:
    """Stage-out: the destination's ``pending`` record, or None if the destination's
    ``manifest`` was written after it (by the run that wrote it, stopped before removing
    it): the manifest names the record's ``token`` (:data:`PENDING_TOKEN`)."""
    token = pending.attrs.get(PENDING_TOKEN) if pending is not None else None
    if token is not None and manifest is not None and manifest.attrs.get("pending") == token:
        return None
    return pending


def earlier_versions(manifest: Manifest | None, source: str = "the manifest") -> list[Entry]:
    """The versions a stage-out's ``manifest`` keeps under :data:`EARLIER` (none without a
    manifest, or from a bbio that kept none).  Raises :class:`IntegrityError` naming
    ``source`` when they are not a list of entries."""
    if manifest is None:
        return []
    found = manifest.attrs.get(EARLIER, [])
    try:
        if not isinstance(found, list):
            raise TypeError(f"a {type(found).__name__}, not a list")
        return [Entry.from_json(e) for e in found]
    except (TypeError, ValueError, AttributeError) as exc:
        raise IntegrityError(
            f"damaged manifest: its {EARLIER!r} versions are not a list of entries ({exc})",
            path=source,
            hint="rerun the stage-out that wrote it, or delete it (bbio then takes the "
            "files it finds there for yours)",
        ) from None


def carried_versions(recorded: Iterable[Entry], listed: Collection[str]) -> list[Entry]:
    """Stage-out: the versions of files and symlinks that the destination's records
    (``recorded``: its manifest's entries and :func:`earlier_versions`, its live pending
    record's entries) hold at paths the new manifest does not list (``listed``), each
    once, in path order: the new manifest keeps them under :data:`EARLIER`, so that a
    later stage-out still knows them for bbio's."""
    kept = (e for e in recorded if e.kind != DIR and e.path not in listed)
    return sorted_entries(dict.fromkeys(kept))


def created_dirs(
    dirs: Iterable[Entry], destination: Destination, pending: Collection[str]
) -> list[Entry]:
    """Stage-out: the directories of ``dirs`` this run makes (absent, or a symlink it
    replaces) or that an interrupted run made (``pending``, still directories): the only
    ones it gives their source's mode and mtime.  Every other directory is left as it is."""
    current = destination.current
    return [
        d
        for d in dirs
        if d.path not in current
        or d.path in destination.replaced
        or (d.path in pending and current[d.path].kind == DIR)
    ]


def copy_of(manifest: Manifest | None, source: str) -> bool:
    """Stage-in: whether the destination's previous ``manifest`` vouches for what the
    destination holds as copies of ``source`` (resolved), so that a file of its source's
    size and mtime there is up to date and keeps its recorded CRC32C: a stage-in's of
    ``source``, or none at all (a first run, or one killed before its manifest, whose
    committed copies are whole).  A manifest of another source, or of a stage-out, does
    not: files of the same names, sizes and mtimes may hold other bytes; nor one left by
    a stage-in of another source that did not finish (:data:`MIXED_SOURCES`), whatever
    source it names."""
    if manifest is None:
        return True
    if manifest.attrs.get(MIXED_SOURCES):
        return False
    return manifest.kind == "stage-in" and manifest.attrs.get("source") == source


def bytes_needed(files: Iterable[Entry]) -> int:
    """Bytes the destination must hold for ``files``."""
    return sum(f.size for f in files if f.kind == FILE)
