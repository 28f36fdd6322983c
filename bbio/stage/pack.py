"""``bbio pack``: turn a tree of many small files into a few large HDF5 shard files.

Layout of ``OUT``:

* ``shard-NNNNN.h5``: datasets ``data`` (uint8, contiguous: every sample's
  bytes back to back), ``names`` (UTF-8 paths relative to the source),
  ``offsets`` and ``sizes`` (int64, into ``data``) and ``crc32c`` (uint32).
  Attributes: ``format``, ``shard``, ``first_sample``.
* ``bbio-pack.json``: the pack index, written last (its commit point): every
  shard's file name, sample count, bytes, CRC32C of the file, and the byte
  offset of ``data`` inside it, so readers can fetch samples with plain
  ``pread``.  Samples are numbered in path order across shards.
* ``bbio-pack.pending``: while a pack is written (and after it failed), the
  shards it may have written or may still remove.  A pack replaces or removes
  only shards the index or this marker lists, and refuses an ``OUT`` holding
  other files named like shards.

Plain h5py reads a sample: ``f["data"][f["offsets"][i] : f["offsets"][i] + f["sizes"][i]]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np

from bbio import _native
from bbio._version import __version__
from bbio.arguments import integer_argument
from bbio.config import Config
from bbio.errors import (
    AlreadyExistsError,
    DependencyError,
    IntegrityError,
    NoSpaceError,
    NotFoundError,
    from_oserror,
)
from bbio.mpi import agreed, agreed_config, deal, topology
from bbio.report import format_bytes, format_table
from bbio.stage.plan import OPEN_FILES_AT_ONCE, group_by_size
from bbio.stage.run import agree_on_arguments
from bbio.stage.walk import check_destination, check_no_node, check_outside, check_readable, walk
from bbio.transfer import files
from bbio.transfer.manifest import SYMLINK, Entry

FORMAT = "bbio-pack/1"
INDEX_NAME = "bbio-pack.json"
# while a pack is written into a directory (and after it failed there): readers refuse it
PENDING_NAME = "bbio-pack.pending"
SHARD_GLOB = "shard-*.h5"
DEFAULT_SHARD_SIZE = 1 << 30
_SLAB = 64 << 20
# Room a shard needs beyond its samples' bytes: per sample (its name, offset, size
# and CRC32C, with HDF5's overhead), and per file (superblock, headers, attributes).
_SAMPLE_OVERHEAD_BYTES = 128
_SHARD_OVERHEAD_BYTES = 64 << 10
FULL_HINT = "free space there, or pack fewer files (--include/--exclude)"
FOREIGN_SHARDS_HINT = (
    "move those files elsewhere, or pack into another directory: bbio pack replaces and "
    "removes only the shards its own earlier packs there listed (shards an older bbio left "
    "from a pack that did not finish are not listed: delete them)"
)
CHANGED_HINT = "stop what writes to the source, then run bbio pack again"


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One shard of a pack, as listed in ``bbio-pack.json``."""

    file: str
    samples: int
    first_sample: int
    data_bytes: int
    data_offset: int
    file_bytes: int
    crc32c: int


@dataclasses.dataclass
class PackSummary:
    """What ``pack`` wrote; ``not_packed``: the source's paths it left out, which are not
    regular files."""

    samples: int
    shards: int
    bytes: int
    seconds: float
    warnings: list[str] = dataclasses.field(default_factory=list)
    not_packed: list[str] = dataclasses.field(default_factory=list)

    def report(self) -> str:
        """A readable summary."""
        rows = [
            ("samples", self.samples),
            ("not packed (not regular files)", len(self.not_packed)),
            ("shards", self.shards),
            ("bytes", format_bytes(self.bytes)),
            ("seconds", f"{self.seconds:.2f}"),
            ("GB/s", f"{self.bytes / self.seconds / 1e9:.2f}" if self.seconds else "-"),
        ]
        notes = "".join(f"\nwarning: {w}" for w in self.warnings)
        return "bbio pack\n" + format_table(["", ""], rows) + notes


def _h5py():
    try:
        import h5py
    except ImportError as exc:
        raise DependencyError("bbio pack needs h5py", hint="run 'make setup'") from exc
    return h5py


def _open_regular(path: Path) -> int:
    """Open ``path`` for reading (:func:`files.open_source`); raise
    :class:`IntegrityError` unless it is still the regular file the walk found."""
    fd = files.open_source(path)
    if fd is None:  # the error path only: say what is there now
        now = "is a symlink now" if path.is_symlink() else "is gone or no longer a regular file"
        raise IntegrityError(
            f"{path} {now}, not the regular file the walk of the source found",
            hint=CHANGED_HINT,
        )
    return fd


def _change(entry: Entry, got: int, st: os.stat_result) -> str | None:
    """How a file read as ``got`` bytes, and whose ``fstat`` after the read is ``st``,
    differs from ``entry`` (the walk's view of it); None if it does not."""
    if st.st_size != entry.size:
        return f"{entry.size} bytes when the source was walked, {st.st_size} now"
    if got != entry.size:
        return f"{got} of its {entry.size} bytes could be read"
    if st.st_mtime_ns != entry.mtime_ns:
        return "modified since the source was walked"
    return None


def _read_files(src: Path, group: Sequence[Entry], threads: int) -> tuple[np.ndarray, list[int]]:
    """The bytes of ``group`` back to back, and each file's CRC32C.

    Raises :class:`IntegrityError` naming the files that are not, after the read,
    the regular files of the size and mtime the walk saw: their bytes could be
    torn, or not be the ones that were walked.
    """
    sizes = [e.size for e in group]
    buffer = np.empty(sum(sizes), dtype=np.uint8)
    fds: list[int] = []
    try:
        for e in group:
            fds.append(_open_regular(src / e.path))
        got = _native.pread_batch(
            fds, [0] * len(fds), sizes, buffer, threads=threads, paths=[src / e.path for e in group]
        )
        after = [os.fstat(fd) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)
    _raise_if_changed(
        src,
        [
            f"{e.path} ({change})"
            for e, n, st in zip(group, got, after, strict=True)
            if (change := _change(e, int(n), st))
        ],
    )
    crcs, start = [], 0
    for size in sizes:
        crcs.append(_native.crc32c(buffer[start : start + size]))
        start += size
    return buffer, crcs


def _raise_if_changed(src: Path, changes: Sequence[str]) -> None:
    """Raise the :class:`IntegrityError` naming the files of ``src`` that ``changes``
    describes, if any."""
    if changes:
        raise IntegrityError(
            f"{len(changes)} file(s) changed while being packed: {'; '.join(changes[:10])}"
            + (f" (and {len(changes) - 10} more)" if len(changes) > 10 else ""),
            path=src,
            hint=CHANGED_HINT,
        )


def _stream_file(src: Path, entry: Entry, data, start: int) -> int:
    """Copy the file of ``entry``, larger than a slab, into the HDF5 dataset ``data`` from
    element ``start`` on, a slab at a time (a rank holds one slab of it, not the whole
    file); its CRC32C.  Raises :class:`IntegrityError` as :func:`_read_files` does."""
    path = src / entry.path
    slab = np.empty(min(_SLAB, entry.size), dtype=np.uint8)
    fd = _open_regular(path)
    crc = got = 0
    try:
        while got < entry.size:
            piece = slab[: min(slab.size, entry.size - got)]
            try:
                n = os.preadv(fd, [piece], got)
            except OSError as exc:
                raise from_oserror(exc, "read", path) from None
            if n == 0:
                break
            crc = _native.crc32c(piece[:n], crc)
            data[start + got : start + got + n] = piece[:n]
            got += n
        after = os.fstat(fd)
    finally:
        os.close(fd)
    change = _change(entry, got, after)
    _raise_if_changed(src, [f"{entry.path} ({change})"] if change else [])
    return crc


def _in_sample_order(shard: ShardInfo) -> tuple[int, int, str]:
    """The sort key of shards in sample order (by name, ``shard-100000.h5`` would come before
    ``shard-10001.h5``).  Not collective."""
    return shard.first_sample, len(shard.file), shard.file


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard-{index:05d}.h5"


def _write_shard(
    src: Path, out: Path, index: int, first_sample: int, group: Sequence[Entry], threads: int
) -> ShardInfo:
    """Write shard ``index`` under its temporary name, then commit it.  Not collective.

    The shard of that name an earlier pack left is deleted first (its index is gone, so
    it is read no more): it frees its space for the new one.  On failure the temporary
    file is removed and the error is a bbio error.
    """
    name = shard_name(index)
    final = out / name
    temp = files.temp_path(final)
    try:
        final.unlink(missing_ok=True)
        total, data_offset = _fill_shard(src, temp, index, first_sample, group, threads)
        file_bytes, file_crc = files.checksum_file(temp)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        error = from_oserror(exc, "write the shard", final)
        if isinstance(error, NoSpaceError) and not error.hint:
            error.hint = FULL_HINT
        raise error from None
    return ShardInfo(name, len(group), first_sample, total, data_offset, file_bytes, file_crc)


def _fill_shard(
    src: Path, temp: Path, index: int, first_sample: int, group: Sequence[Entry], threads: int
) -> tuple[int, int]:
    """Write the HDF5 file of a shard to ``temp``; return its data bytes and data offset."""
    h5py = _h5py()
    sizes = np.array([e.size for e in group], dtype=np.int64)
    offsets = np.zeros(len(group), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    crcs = np.zeros(len(group), dtype=np.uint32)
    total = int(sizes.sum())
    with h5py.File(temp, "w", libver="latest") as f:
        _reserve(f, shard_bytes(group))
        data = f.create_dataset("data", shape=(total,), dtype=np.uint8)
        slabs = group_by_size(
            list(range(len(group))), _SLAB, lambda i: group[i].size, max_items=OPEN_FILES_AT_ONCE
        )
        for slab in slabs:
            start = int(offsets[slab[0]])
            if group[slab[0]].size > _SLAB:  # a slab of its own
                crcs[slab[0]] = _stream_file(src, group[slab[0]], data, start)
                continue
            buffer, slab_crcs = _read_files(src, [group[i] for i in slab], threads)
            data[start : start + buffer.size] = buffer
            crcs[slab] = slab_crcs
        names = [os.fsencode(e.path).decode("utf-8", "backslashreplace") for e in group]
        f.create_dataset("names", data=names, dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("offsets", data=offsets)
        f.create_dataset("sizes", data=sizes)
        f.create_dataset("crc32c", data=crcs)
        f.attrs["format"] = FORMAT
        f.attrs["shard"] = index
        f.attrs["first_sample"] = first_sample
        f.attrs["bbio"] = __version__
        f.flush()
        data_offset = int(data.id.get_offset() or 0)
        # give back the reservation HDF5 did not use: its own idea of the file's end
        os.ftruncate(f.id.get_vfd_handle(), f.id.get_filesize())
    return total, data_offset


def shard_bytes(group: Sequence[Entry]) -> int:
    """About how many bytes the shard of ``group`` takes (a little more, not less)."""
    return _SHARD_OVERHEAD_BYTES + sum(
        e.size + 2 * len(e.path) + _SAMPLE_OVERHEAD_BYTES for e in group
    )


def _reserve(f, nbytes: int) -> None:
    """Reserve ``nbytes`` of the device for the HDF5 file ``f`` just created.

    HDF5 must never meet a full device: after a failed write it cannot close
    the file cleanly, and the process crashes when it exits.  A full device
    fails here instead, before any sample is written (where the file system
    cannot reserve space, nothing is reserved).
    """
    _native.preallocate(f.id.get_vfd_handle(), nbytes, at_least=0)


def _check_capacity(out: Path, shards: Sequence[Sequence[Entry]]) -> None:
    """Raise :class:`NoSpaceError` unless ``out`` has room for ``shards``, written in any
    order, each after the shard of its name that an earlier pack left was deleted
    (:func:`_write_shard`): what each needs beyond that one's bytes.  Every shard in
    ``out`` is an earlier pack's (:func:`_refuse_foreign_shards` refused others first).
    Not collective."""
    needed = 0
    for index, group in enumerate(shards):
        replaced = 0
        with contextlib.suppress(OSError):
            replaced = (out / shard_name(index)).stat().st_size
        needed += max(0, shard_bytes(group) - replaced)
    free = files.free_bytes(out)
    if needed > free:
        raise NoSpaceError(
            f"{out} needs about {format_bytes(needed)} ({needed} bytes) "
            f"for the shards, {format_bytes(free)} ({free} bytes) free",
            hint=FULL_HINT,
        )


def _listed_shards(document: dict | None, key: str) -> set[str]:
    """The file names of shards that ``document[key]`` lists (an index's shards, a marker's
    names); none when there is no document, or it has no such list."""
    listed = (document or {}).get(key)
    if not isinstance(listed, list):
        return set()
    names = (item.get("file") if isinstance(item, dict) else item for item in listed)
    return {name for name in names if isinstance(name, str)}


def recorded_shards(out: Path) -> set[str]:
    """The shard files an earlier bbio pack into ``out`` recorded: those its index lists,
    and those the marker of a pack that was writing there (or failed) lists.  Not
    collective.  A damaged index or marker records nothing."""
    return _listed_shards(files.read_json_if_sound(out / INDEX_NAME), "shards") | _listed_shards(
        files.read_json_if_sound(out / PENDING_NAME), "shards"
    )


def present_shards(out: Path) -> list[str]:
    """The names in ``out`` that look like shards (``shard-*.h5``), sorted.  Not
    collective."""
    try:
        with os.scandir(out) as entries:
            return sorted(e.name for e in entries if fnmatch.fnmatchcase(e.name, SHARD_GLOB))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _refuse_foreign_shards(out: Path, recorded: Collection[str]) -> None:
    """Raise :class:`AlreadyExistsError` naming the files of ``out`` named like shards that
    no earlier pack there recorded: they are not bbio's to replace.  Not collective."""
    foreign = [name for name in present_shards(out) if name not in recorded]
    if foreign:
        more = f" (and {len(foreign) - 20} more)" if len(foreign) > 20 else ""
        raise AlreadyExistsError(
            f"{out} holds {len(foreign)} file(s) named like shards that no bbio pack there "
            f"recorded (neither {INDEX_NAME} nor {PENDING_NAME} lists them): "
            f"{', '.join(foreign[:20])}{more}",
            path=out,
            hint=FOREIGN_SHARDS_HINT,
        )


def _withdraw_index(out: Path) -> None:
    """Remove the index of an earlier pack into ``out``, durably, before any of its shards
    is replaced: a pack that fails midway then leaves no index, never one that names
    shards holding other samples."""
    index = out / INDEX_NAME
    if index.exists():
        index.unlink()
        files.fsync_dirs([out])


def _remove_old_shards(out: Path, old: Collection[str]) -> bool:
    """Remove the shards ``old`` (recorded by an earlier pack, not listed by the index just
    written) that are still in ``out``; whether all went (best effort: no reader opens
    them)."""
    removed = True
    for name in set(old) & set(present_shards(out)):
        try:
            (out / name).unlink()
        except OSError:
            removed = False
    return removed


def pack(
    comm,
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    config: Config | None = None,
) -> PackSummary:
    """Collective over ``comm``: pack the files of ``src`` into HDF5 shards in ``out``.

    Shards hold files in path order, at most ``shard_size`` bytes each; the
    ranks write different shards.  ``out/bbio-pack.json`` is written last; an
    earlier pack's index in ``out`` is removed first (while this runs, and if it
    fails, ``out`` is no pack), and the shards it recorded that the new index does not
    list after.  Only shards an earlier pack recorded are replaced or removed
    (:func:`recorded_shards`): an ``out`` holding other ``shard-*.h5`` is refused, before
    the source is walked.
    Every rank must pass the same arguments (paths, lists of globs, a ``shard_size`` of
    at least 1 byte); ``out`` (one directory, no ``{node}``) must not lie inside ``src``
    and needs room for the shards, which is checked first: else every rank raises the
    same error, as it does when a file changed since the walk (:func:`_read_files`).
    Only regular files are packed: the summary names the paths that are not
    (``not_packed``, and a warning).
    """
    config = agreed_config(comm, "pack", config)
    agree_on_arguments(
        comm,
        "pack",
        config,
        {"src": src, "out": out, "shard_size": shard_size, "include": include, "exclude": exclude},
        paths=(("src", "the source"), ("out", "the output directory")),
        settings=("ranks_per_node",),
    )
    shard_size = integer_argument("shard_size", shard_size, 1)
    for path, what in ((src, "source"), (out, "output directory")):
        check_no_node(path, what, "pack")
    start = time.monotonic()
    src, out = config.expand(src), config.expand(out)
    recorded: set[str] = set()
    with agreed(comm, f"pack: checking {out}"):
        if comm.Get_rank() == 0:
            check_outside(src, out)
            check_destination(out)
            recorded = recorded_shards(out)
            _refuse_foreign_shards(out, recorded)
    topo = topology(comm, config.ranks_per_node)
    threads = config.stage_threads(topo.node_comm.Get_size())
    topo.free()
    tree = walk(comm, src, include, exclude, listers=threads)
    check_readable(tree, False, str(src))
    shards = group_by_size(tree.files, shard_size, lambda e: e.size)
    firsts = [0]
    for group in shards[:-1]:
        firsts.append(firsts[-1] + len(group))
    with agreed(comm, f"pack: creating {out} and checking its free space"):
        if comm.Get_rank() == 0:
            try:
                out.mkdir(parents=True, exist_ok=True)
                files.remove_temp_files(out)  # a failed or killed pack's shards
            except OSError as exc:
                raise from_oserror(exc, "prepare the output directory", out) from None
            _refuse_foreign_shards(out, recorded)  # again: files may have come during the walk
            _check_capacity(out, shards)  # before the old index goes: a refused pack keeps it
            # the marker lists every shard this pack may write or remove
            new_names = {shard_name(index) for index in range(len(shards))}
            marker = {"time": time.time(), "shards": sorted(recorded | new_names)}
            try:
                files.write_json_atomic(out / PENDING_NAME, marker)
                _withdraw_index(out)
            except OSError as exc:
                raise from_oserror(exc, "remove the earlier pack's index", out) from None
    infos: list[ShardInfo] = []
    with agreed(comm, "pack: writing shards"):
        for index in deal(list(range(len(shards))), comm):
            infos.append(_write_shard(src, out, index, firsts[index], shards[index], threads))
    gathered = [i for part in comm.allgather(infos) for i in part]
    infos = sorted(gathered, key=_in_sample_order)
    with agreed(comm, "pack: writing the index"):
        if comm.Get_rank() == 0:
            files.fsync_dirs([out])
            files.write_json_atomic(
                out / INDEX_NAME,
                {
                    "format": FORMAT,
                    "bbio": __version__,
                    "source": str(src.resolve()),
                    "samples": len(tree.files),
                    "shards": [dataclasses.asdict(i) for i in infos],
                },
            )
            # the marker goes after the index (never a moment without either), and only
            # once the old shards are gone: until then it records them for the next pack
            if _remove_old_shards(out, recorded - {i.file for i in infos}):
                (out / PENDING_NAME).unlink()
            files.fsync_dirs([out])
    unmatched = (include or exclude) and not tree.files
    warnings = ["--include/--exclude selected no file of the source"] if unmatched else []
    not_packed = sorted(
        [e.path for e in tree.entries if e.kind == SYMLINK] + [s.path for s in tree.skipped]
    )
    return PackSummary(
        len(tree.files),
        len(infos),
        tree.total_bytes,
        time.monotonic() - start,
        warnings + _not_packed_warning(not_packed),
        not_packed,
    )


def _not_packed_warning(paths: Sequence[str]) -> list[str]:
    """The warning naming (the first few of) ``paths``, the source's paths not packed."""
    if not paths:
        return []
    more = f" (and {len(paths) - 5} more)" if len(paths) > 5 else ""
    return [
        f"{len(paths)} path(s) of the source were not packed, since only regular files are "
        f"(symlinks, FIFOs, sockets and devices are not): {', '.join(paths[:5])}{more}"
    ]


def read_index(out: str | os.PathLike) -> list[ShardInfo]:
    """The shards listed in ``out/bbio-pack.json``.  Not collective."""
    try:
        document = files.read_json(Path(out) / INDEX_NAME)
    except IntegrityError as exc:
        raise IntegrityError(
            exc.message, path=Path(out) / INDEX_NAME, hint="recreate it with 'bbio pack SRC OUT'"
        ) from None
    if document is None:
        raise NotFoundError(
            "not a bbio pack (no index)",
            path=Path(out) / INDEX_NAME,
            hint="create it with 'bbio pack SRC OUT'",
        )
    if document.get("format") != FORMAT:
        raise IntegrityError(f"unknown pack format {document.get('format')!r}", path=out)
    return [ShardInfo(**s) for s in document["shards"]]
