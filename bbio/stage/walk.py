"""Parallel walk of a source tree: every rank lists some directories and stats what it lists.

The walk goes level by level.  At each level the directories are dealt out to
the ranks; each rank lists several of its directories at once (``listers``,
on threads: a listing waits on the servers, not on the CPU) and ``lstat``s
every name right after reading it from its directory.  File systems answer
those stats from the attributes the listing brought along (FUSE and NFS
READDIRPLUS, Lustre's statahead), which they keep for about a second: a stat
made later, or by another client, is a round trip to the servers.  Symlinks
are never followed.  A listing that fails on one rank fails the walk on all.

Also here: the checks of a transfer's paths made before anything is copied
(the source exists, the destination can be written and is not inside the
source, ``{node}`` only where it applies).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bbio.errors import (
    NotDirectoryError,
    NotFoundError,
    PermissionDeniedError,
    UsageError,
    from_oserror,
)
from bbio.mpi import agreed, agreed_allgather
from bbio.transfer.files import is_temp_name
from bbio.transfer.manifest import DIR, FILE, META_DIR, SYMLINK, Entry, sorted_entries


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A path left out of a transfer, and why."""

    path: str
    reason: str


@dataclasses.dataclass
class Tree:
    """The result of a walk: what to transfer, what was skipped, what could not be read."""

    root: Path
    entries: list[Entry]
    skipped: list[Skipped]
    unreadable: list[Skipped]

    @property
    def files(self) -> list[Entry]:
        """The regular files, in path order."""
        return [e for e in self.entries if e.kind == FILE]

    @property
    def total_bytes(self) -> int:
        """Bytes of all regular files."""
        return sum(e.size for e in self.entries if e.kind == FILE)


def selected(path: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether ``path`` passes the filters: matches an include (if any) and no exclude.

    Patterns are shell globs on the path relative to the source; ``*`` also
    matches ``/``.  Applied to what is not a directory: a directory is left out by
    :func:`excluded_dir` alone (never by an include).
    """
    if include and not any(fnmatch.fnmatchcase(path, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(path, p) for p in exclude)


def excluded_dir(path: str, exclude: Sequence[str]) -> bool:
    """Whether the walk leaves directory ``path``, and everything under it, out without
    listing it.  Not collective.

    It does when an exclude glob matches ``path`` itself (``logs``, ``*/cache``), or
    matches ``path + "/"`` and ends in ``/`` (``logs/``: directories only) or in ``*``
    (``logs/*``, ``logs*``: such a glob matches every path under the directory), as
    rsync leaves out an excluded directory.  ``logs/*.txt`` does not.
    """
    return any(
        fnmatch.fnmatchcase(path, p)
        or (p.endswith(("/", "*")) and fnmatch.fnmatchcase(path + "/", p))
        for p in exclude
    )


def symlink_target(root: Path, rel: str) -> str | None:
    """The target to give the copy of symlink ``rel``; None if it points outside ``root``.

    An absolute target inside ``root``, or a relative one that climbs above
    ``root`` on its way (``../../src/f`` through the source's own name), becomes
    a relative one that stays inside, so that the copy points into the copied
    tree, not back into the source or beside the copy.
    """
    real_root = os.path.realpath(root)
    target = os.readlink(root / rel)
    resolved = os.path.realpath(root / rel)
    if os.path.commonpath([real_root, resolved]) != real_root:
        return None
    if os.path.isabs(target) or _climbs_above(rel, target):
        return os.path.relpath(resolved, os.path.dirname(os.path.join(real_root, rel)))
    return target


def _climbs_above(rel: str, target: str) -> bool:
    """Does relative ``target``, read from the directory of ``rel``, go above the root?"""
    depth = rel.count("/")  # the link's directory, below the root
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def _symlink_entry(root: Path, rel: str, st: os.stat_result) -> Entry | Skipped:
    target = symlink_target(root, rel)
    if target is None:
        raw = os.readlink(root / rel)
        return Skipped(rel, f"symlink to {raw} points outside the source; not followed")
    return Entry(rel, SYMLINK, mtime_ns=st.st_mtime_ns, mode=0o777, target=target)


def _stat_one(
    root: Path, rel: str, st: os.stat_result, include: Sequence[str], exclude: Sequence[str]
) -> Entry | Skipped | None:
    """The entry for ``rel`` (whose ``lstat`` is ``st``); Skipped for things never copied;
    None if filtered out (a directory only by :func:`excluded_dir`, with all it holds)."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISDIR(st.st_mode):
        if excluded_dir(rel, exclude):
            return None
        return Entry(rel, DIR, mtime_ns=st.st_mtime_ns, mode=mode)
    if not selected(rel, include, exclude):
        return None
    if stat.S_ISREG(st.st_mode):
        return Entry(rel, FILE, size=st.st_size, mtime_ns=st.st_mtime_ns, mode=mode)
    if stat.S_ISLNK(st.st_mode):
        return _symlink_entry(root, rel, st)
    return Skipped(rel, "special file (device, FIFO or socket); not copied")


def readable(path: str, st: os.stat_result) -> bool:
    """Whether this process may read the regular file ``path`` whose ``lstat`` is ``st``.

    Not collective.  The mode bits answer when they settle it: when the owner,
    the group and others may all read the file, or when this (non-root) user
    owns it and the owner may.  Else the kernel is asked (``access``), which
    applies group membership, ACLs, capabilities and squashed root.
    """
    if st.st_mode & 0o444 == 0o444:
        return True
    euid = os.geteuid()
    if euid != 0 and st.st_uid == euid and st.st_mode & stat.S_IRUSR:
        return True
    return os.access(path, os.R_OK, effective_ids=True)


@dataclasses.dataclass
class _Listed:
    """What listing one directory found: entries, subdirectories, skipped paths."""

    found: list[Entry] = dataclasses.field(default_factory=list)
    subdirs: list[str] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    unreadable: list[Skipped] = dataclasses.field(default_factory=list)
    empty: bool = False  # the directory held nothing


def _list_dir(root: Path, rel: str, unreadable: list[Skipped]) -> Iterator[os.DirEntry]:
    """The entries of directory ``rel``, as they are read (a listing refused goes to
    ``unreadable``; a directory gone since it was found lists nothing)."""
    try:
        with os.scandir(os.path.join(root, rel) if rel else os.fspath(root)) as it:
            for item in it:
                if not (is_temp_name(item.name) or (rel == "" and item.name == META_DIR)):
                    yield item
    except PermissionError as exc:
        unreadable.append(Skipped(rel or ".", f"cannot list directory: {exc.strerror}"))
    except FileNotFoundError:
        return


def _list_and_stat(root: Path, rel: str, include: Sequence[str], exclude: Sequence[str]) -> _Listed:
    """List directory ``rel`` and stat each name as soon as it is read."""
    listed = _Listed()
    names = 0
    for item in _list_dir(root, rel, listed.unreadable):
        names += 1
        name = f"{rel}/{item.name}" if rel else item.name
        try:
            st = os.lstat(item.path)
            found = _stat_one(root, name, st, include, exclude)
        except FileNotFoundError:
            continue  # removed since it was listed
        except PermissionError as exc:
            if item.is_dir(follow_symlinks=False):
                wanted = not excluded_dir(name, exclude)
            else:
                wanted = selected(name, include, exclude)
            if wanted:
                listed.unreadable.append(Skipped(name, f"cannot stat: {exc.strerror}"))
            continue
        if isinstance(found, Skipped):
            listed.skipped.append(found)
        elif found is not None:
            listed.found.append(found)
            if found.kind == DIR:
                listed.subdirs.append(name)
            elif found.kind == FILE and not readable(item.path, st):
                listed.unreadable.append(Skipped(name, "permission denied"))
    listed.empty = names == 0 and not listed.unreadable
    return listed


SKIP_UNREADABLE_HINT = "fix their permissions, or pass --skip-unreadable to list and skip them"


def check_readable(
    tree: Tree, skip_unreadable: bool, where: str, hint: str = SKIP_UNREADABLE_HINT
) -> list[Skipped]:
    """Unreadable paths: an error naming each (the same on every rank), with ``hint``,
    or skipped.

    Not collective (every rank holds the same ``tree``).
    """
    if tree.unreadable and not skip_unreadable:
        listing = "; ".join(f"{s.path}: {s.reason}" for s in tree.unreadable[:20])
        more = f" (and {len(tree.unreadable) - 20} more)" if len(tree.unreadable) > 20 else ""
        raise PermissionDeniedError(
            f"{len(tree.unreadable)} path(s) in {where} cannot be read: {listing}{more}",
            hint=hint,
        )
    return list(tree.unreadable)


def _flatten(lists: list[list]) -> list:
    return [item for sub in lists for item in sub]


def check_source(root: Path, node: int | None = None) -> None:
    """Raise a clear error unless ``root`` is an existing directory.  Not collective.

    ``node`` is named in the error (a per-node source).
    """
    if not root.exists():
        raise NotFoundError(
            "the source does not exist",
            path=root,
            node=node,
            hint=None if node is None else "check the path, or create it (empty) on every node",
        )
    if not root.is_dir():
        raise NotDirectoryError(
            "the source is not a directory",
            path=root,
            node=node,
            hint=f"staging copies directories: for this file alone, pass {root.parent} and "
            f"--include '{glob.escape(root.name)}' (include=['{glob.escape(root.name)}'])",
        )


def check_destination(root: Path, node: int | None = None) -> None:
    """Raise a clear error unless ``root`` is a directory this process may write in, or
    can be created.  Not collective.

    Looks at ``root``, or else at its nearest existing parent: it must be a
    directory that may be written (a read-only file system fails here too).
    """
    for candidate in (root, *root.parents):
        try:
            st = os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet (the parent that is a file is found next)
        except OSError as exc:
            raise from_oserror(
                exc,
                "look at the destination",
                candidate,
                node=node,
                hint="choose a destination you may write to, or fix its permissions",
            ) from None
        what = "the destination" if candidate == root else f"{candidate}, in the destination,"
        if not stat.S_ISDIR(st.st_mode):
            raise NotDirectoryError(
                f"{what} is not a directory",
                path=root,
                node=node,
                hint="choose another destination, or move that file away",
            )
        if not os.access(candidate, os.W_OK | os.X_OK):
            raise PermissionDeniedError(
                f"{what} may not be written (permission denied or a read-only file system)",
                path=root,
                node=node,
                hint="choose a destination you may write to, or fix its permissions",
            )
        return


def check_outside(src: Path, dst: Path, node: int | None = None) -> None:
    """Raise :class:`UsageError` if ``dst`` is ``src`` or inside it (symlinks resolved):
    every run would copy its own copies again.  Not collective."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if os.path.commonpath([real_src, real_dst]) == real_src:
        where = "is the source" if real_src == real_dst else f"is inside the source {src}"
        raise UsageError(
            f"the destination {dst} {where}",
            node=node,
            hint="each run would copy its own copies again; choose a destination outside "
            "the source",
        )


def check_no_node(path: str | os.PathLike, what: str, command: str) -> None:
    """Raise :class:`UsageError` if ``path`` contains ``{node}`` where ``command`` has one
    directory for all nodes.  Not collective."""
    if "{node}" in os.fspath(path):
        raise UsageError(
            f"{command}: {what} {os.fspath(path)} contains {{node}}, but {command} has one "
            f"{what} shared by every node",
            hint=f"remove {{node}} from the {what}",
        )


def walk(
    comm,
    root: Path,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    listers: int = 1,
) -> Tree:
    """Collective over ``comm``: walk ``root`` (seen alike by every rank of ``comm``).

    Every rank returns the same :class:`Tree`; each lists up to ``listers`` of
    its directories at once.  Files the process cannot read, directories it
    cannot list and names it cannot stat go to ``unreadable``; symlinks
    pointing outside ``root`` and special files go to ``skipped``.  Names
    the filters leave out are in neither, and directories :func:`excluded_dir`
    leaves out are not listed; nor are, with filters, the directories they leave
    empty (one empty in the source stays, unless an ``exclude`` glob matches it).
    bbio's own ``.bbio`` directory and temporary files are never listed.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    with agreed(comm, f"walking {root}"):
        check_source(root)
    entries: list[Entry] = []
    skipped: list[Skipped] = []
    unreadable: list[Skipped] = []
    empty: set[str] = set()  # directories that held nothing in the source
    level = [""]
    with ThreadPoolExecutor(max(1, listers), "bbio-walk") as pool:

        def list_my_share() -> tuple[list[Entry], list[str], list[str]]:
            found, subdirs, nothing_in = [], [], []
            share = level[rank::size]
            listings = pool.map(lambda rel: _list_and_stat(root, rel, include, exclude), share)
            for rel, listed in zip(share, listings, strict=True):
                found.extend(listed.found)
                subdirs.extend(listed.subdirs)
                skipped.extend(listed.skipped)
                unreadable.extend(listed.unreadable)
                if listed.empty:
                    nothing_in.append(rel)
            return found, subdirs, nothing_in

        while level:
            parts = agreed_allgather(comm, f"walking {root}", list_my_share, quiet=True)
            entries.extend(entry for found, _, _ in parts for entry in found)
            empty.update(rel for _, _, nothing_in in parts for rel in nothing_in)
            level = sorted(rel for _, subdirs, _ in parts for rel in subdirs)
    skipped = sorted(_flatten(comm.allgather(skipped)), key=lambda s: s.path)
    unreadable = sorted(_flatten(comm.allgather(unreadable)), key=lambda s: s.path)
    entries = sorted_entries(entries)
    if include or exclude:
        entries = _prune_empty_dirs(entries, {d for d in empty if selected(d, (), exclude)})
    return Tree(root, entries, skipped, unreadable)


def _prune_empty_dirs(entries: list[Entry], empty: set[str]) -> list[Entry]:
    """Drop the directories the filters left empty: those that hold no selected file or
    symlink, nor a directory of ``empty`` (directories empty in the source: kept)."""
    needed = set()
    for e in entries:
        if e.kind != DIR or e.path in empty:
            parent = os.path.dirname(e.path)
            while parent and parent not in needed:
                needed.add(parent)
                parent = os.path.dirname(parent)
    return [e for e in entries if e.kind != DIR or e.path in needed or e.path in empty]
