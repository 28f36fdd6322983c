"""Datasets for collective reads, and the collective read itself.

:func:`open_dataset` recognises four layouts and turns each into extents
(sample -> file, offset, length): a table, or a formula for fixed-size samples:

* a pack made by ``bbio pack`` (a directory with ``bbio-pack.json``);
* an HDF5 file with one dataset of fixed-size samples along axis 0
  (contiguous layout, no filters: its bytes are read with plain ``pread``, from
  the file that holds it when a link leads into another file);
* a raw file of fixed-size records (``record_bytes`` or ``sample_shape`` + ``dtype``);
* a directory of files, one sample per file, in path order.

The dataset is always the PFS copy's full contents: a directory is listed
from a complete staged copy's manifest, else on the PFS; a pack by its
index.  Each file staged into this node's burst
buffer (the node's staging registry and manifest say so, with the size the
dataset expects) is read there; in shard mode the node holding a file serves
it.  Every other file, such as one a filtered stage-in left out, is read from
the PFS.

:meth:`Dataset.read` is collective: every rank passes its own sample ids, the
plan (:mod:`bbio.read.plan`) picks a few aggregator ranks that issue large
merged reads with many requests in flight (native batched reads), in rounds,
and one ``Ialltoallw`` per round hands every rank its bytes, in the order it
asked.  When merging would save little, every rank reads its own samples
directly instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import math
import os
import resource
import threading
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bbio import _native
from bbio.arguments import integer_argument, path_argument
from bbio.config import Config, load_config
from bbio.errors import (
    BBIOError,
    DependencyError,
    IntegrityError,
    NotFoundError,
    OutOfMemoryError,
    UsageError,
    from_oserror,
)
from bbio.mpi import (
    agreed,
    agreed_allgather,
    gather_in_call,
    same_arguments,
    topology,
    wait_quietly,
)
from bbio.read.plan import (
    MPI_BLOCK_BYTES,
    Extents,
    FixedExtents,
    Holders,
    ReadPlan,
    Rounds,
    SampleExtents,
    aggregation_pays,
    make_plan,
    reads_alone,
    split_blocks,
    split_rounds,
)
from bbio.stage import registry
from bbio.stage.pack import INDEX_NAME, PENDING_NAME, ShardInfo, read_index
from bbio.stage.walk import check_readable, walk
from bbio.transfer.files import read_manifest
from bbio.transfer.manifest import FILE

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
PACK_MARKS = (INDEX_NAME, PENDING_NAME)

#: settings every rank must share: they shape the topology and every rank's copy of each plan
SHARED_SETTINGS = (
    "ranks_per_node",
    "stripe_size",
    "read_max_hole",
    "read_max_bytes",
    "read_round_bytes",
    "read_min_saving",
    "read_direct_bytes",
)
DAMAGED_PACK = "the pack is damaged or incomplete; run 'bbio pack' again"
#: the most bytes one pickled MPI message carries (its byte count is a C int)
MAX_MESSAGE_BYTES = 2**31 - 1
#: a pack's extents travel as two int64 per sample, plus this much per shard
PACKED_BYTES_PER_SAMPLE, PACKED_BYTES_PER_SHARD = 16, 512
#: the datasets of a rank keep at most this many files open, whatever RLIMIT_NOFILE allows
MAX_OPEN_FILES = 1024
#: descriptors of RLIMIT_NOFILE left to the rest of the job (MPI, sockets, its own files)
RESERVED_FILES = 128
#: the datasets of a rank keep at least this many files open (at most half of RLIMIT_NOFILE)
MIN_OPEN_FILES = 16
INT64 = np.iinfo(np.int64)
#: the largest record (sample of a fixed-size layout) in bytes: offsets stay well within int64
MAX_RECORD_BYTES = 2**62


@dataclasses.dataclass
class ReadStats:
    """Counters of one rank's collective reads (requests and bytes are summed over all ranks)."""

    calls: int = 0
    direct_calls: int = 0  # calls where each rank read its own samples (aggregating did not pay)
    samples: int = 0
    requests: int = 0
    bytes_read: int = 0
    bytes_needed: int = 0


@dataclasses.dataclass(frozen=True)
class Layout:
    """What :func:`open_dataset` learned, the same on every rank."""

    kind: str
    files: list[str]  # PFS paths
    file_sizes: list[int]
    extents: SampleExtents  # FixedExtents for fixed-size samples: O(1) to share
    sample_shape: tuple[int, ...] | None  # None: variable-size samples (bytes)
    dtype: np.dtype | None  # kept whole: a structured dtype keeps its fields
    file_crcs: list[int] | None = None  # a pack's shards: a staged copy must have these


def _stripe_size(path: str) -> int:
    """Lustre's stripe size for ``path`` if it can be read, else the block size."""
    try:
        lov = os.getxattr(path, "lustre.lov")
        size = int.from_bytes(lov[24:28], "little")
        if size > 0:
            return size
    except OSError:
        pass
    try:
        return os.stat(path).st_blksize or 4096
    except OSError:
        return 4096


def _either(pfs: Path, staged: Path | None) -> Path:
    """The staged copy when this node has it, else the PFS path."""
    return staged if staged is not None and staged.exists() else pfs


def _read_pack_index(where: Path) -> list[ShardInfo]:
    """The shards of the pack index in ``where``; a damaged index is an IntegrityError naming
    it.  Not collective."""
    try:
        shards = read_index(where)
        fields = [(s.file, s.samples, s.data_offset, s.file_bytes) for s in shards]
    except BBIOError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(
            f"damaged pack index ({type(exc).__name__}: {exc})",
            path=where / INDEX_NAME,
            hint=DAMAGED_PACK,
        ) from None
    for file, *counts in fields:
        if not isinstance(file, str) or not all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
        ):
            raise IntegrityError(
                f"damaged pack index: a shard entry has file {file!r} and counts {counts}",
                path=where / INDEX_NAME,
                hint=DAMAGED_PACK,
            )
    return shards


def _shard_arrays(path: Path, shard: ShardInfo) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) of the samples of ``shard``, read from its file ``path``; an
    :class:`IntegrityError` unless every sample lies within the shard's bytes.  Not
    collective."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            offsets = np.asarray(f["offsets"][:], dtype=np.int64).reshape(-1)
            sizes = np.asarray(f["sizes"][:], dtype=np.int64).reshape(-1)
    except OSError as exc:
        raise from_oserror(exc, "open the pack shard", path, hint=DAMAGED_PACK) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise IntegrityError(
            f"damaged pack shard ({type(exc).__name__}: {exc})", path=path, hint=DAMAGED_PACK
        ) from None
    if offsets.size != shard.samples or sizes.size != shard.samples:
        raise IntegrityError(
            f"the pack shard lists {offsets.size} offsets and {sizes.size} sizes, "
            f"the index says {shard.samples} samples",
            path=path,
            hint=DAMAGED_PACK,
        )
    room = shard.file_bytes - shard.data_offset  # the shard's bytes after its data begins
    inside = (
        (offsets >= 0)
        & (sizes >= 0)
        & (offsets <= room)
        & (sizes <= room - np.clip(offsets, 0, max(room, 0)))  # not offset + size: it could wrap
    )
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise IntegrityError(
            f"the pack shard lists its sample {i} at offset {offsets[i]} with {sizes[i]} "
            f"bytes, outside its {room} bytes of data",
            path=path,
            hint=DAMAGED_PACK,
        )
    return offsets + shard.data_offset, sizes


def _packed_layout(
    comm, node: int, is_leader: bool, root: Path, staged: Path | None, bb_dir: Path
) -> tuple[Layout, dict[int, str]]:
    """Collective over ``comm``: a pack's extent table, and the shards this node holds
    (:func:`_local_copies`).

    Each shard's index is read by a node that holds the shard in its burst
    buffer when one does (so a staged pack needs no PFS access), else by rank 0
    from the PFS.  The pack index is a staged copy's when every node that staged
    one staged the same, else the PFS's; a staged shard is read only if its staged
    CRC32C is the index's.
    """
    staged_index = None
    with agreed(comm, f"reading the staged copies' pack index of {root}"):
        if is_leader and staged is not None and (staged / INDEX_NAME).exists():
            staged_index = (staged / INDEX_NAME).read_bytes()
    indexes = comm.allgather(
        None if staged_index is None else hashlib.sha256(staged_index).digest()
    )
    index_from = [r for r, digest in enumerate(indexes) if digest is not None]
    if len({indexes[r] for r in index_from}) > 1:  # nodes staged different packs: the PFS's
        index_from = []
    shards = None
    with agreed(comm, f"reading the pack index of {root}"):
        if comm.Get_rank() == (index_from[0] if index_from else 0):
            shards = _read_pack_index(staged if index_from else root)
    shards = comm.bcast(shards, root=index_from[0] if index_from else 0)
    _check_shareable(root, shards)
    files = [str(root / s.file) for s in shards]
    sizes, crcs = [s.file_bytes for s in shards], [s.crc32c for s in shards]
    local: dict[int, str] = {}
    with agreed(comm, f"opening the dataset {root}: reading the staging manifests"):
        local = _local_copies(bb_dir, node, files, sizes, crcs)
    holders = comm.allgather(sorted(local) if is_leader else [])
    reader = {}
    for r, held in enumerate(holders):
        for f in held:
            reader.setdefault(f, r)
    arrays = {}
    with agreed(comm, f"reading the shard indexes of {root}"):
        for i, shard in enumerate(shards):
            if reader.get(i, 0) == comm.Get_rank():
                arrays[i] = _shard_arrays(Path(local.get(i, files[i])), shard)
    merged: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for part in comm.allgather(arrays):
        merged.update(part)
    offsets = [merged[i][0] for i in range(len(shards))]
    lengths = [merged[i][1] for i in range(len(shards))]
    extents = Extents(
        np.concatenate([np.full(o.size, i, np.int32) for i, o in enumerate(offsets)])
        if shards
        else np.zeros(0, np.int32),
        np.concatenate(offsets) if shards else np.zeros(0, np.int64),
        np.concatenate(lengths) if shards else np.zeros(0, np.int64),
    )
    return Layout("packed", files, sizes, extents, None, None, crcs), local


def _check_shareable(root: Path, shards: Sequence[ShardInfo]) -> None:
    """Raise the same :class:`UsageError` on every rank (which all know ``shards``) if the
    extents of the pack ``root`` are too large for the one MPI message that shares them.
    Not collective."""
    samples = sum(s.samples for s in shards)
    payload = samples * PACKED_BYTES_PER_SAMPLE + len(shards) * PACKED_BYTES_PER_SHARD
    if payload > MAX_MESSAGE_BYTES:
        raise UsageError(
            f"the pack's {samples} samples are too many to share at open: their offsets and "
            f"sizes take {payload} bytes, over the {MAX_MESSAGE_BYTES} one MPI message carries",
            path=root,
            hint="pack the data into several packs of fewer samples (or larger samples), "
            "and open each as its own dataset",
        )


def _fixed_layout(
    kind: str, path: Path, size: int, base: int, count: int, shape, dtype: np.dtype
) -> Layout:
    record = math.prod(int(n) for n in shape) * dtype.itemsize  # Python ints: no wrap
    too_large = "store each sample as several smaller ones (split it along its first axis)"
    _check_record_bytes(record, path, RECORD_HINT if kind == "raw" else too_large)
    return Layout(kind, [str(path)], [size], FixedExtents(count, base, record), tuple(shape), dtype)


#: what to do about a raw file's record that is too large
RECORD_HINT = (
    "check record_bytes= (or sample_shape= and dtype=): a sample is one record of the "
    "file, not the whole file"
)


def _check_record_bytes(record: int, path: Path, hint: str = RECORD_HINT) -> None:
    """Raise a :class:`UsageError` naming ``path`` (with ``hint``) if a record of ``record``
    bytes is larger than :data:`MAX_RECORD_BYTES`: its offsets would not stay within
    int64.  Not collective."""
    if record > MAX_RECORD_BYTES:
        raise UsageError(
            f"a sample of {record} bytes is too large: records may be at most "
            f"{MAX_RECORD_BYTES} bytes (2**62)",
            path=path,
            hint=hint,
        )


def _hdf5_layout(
    path: Path, read_path: Path, dataset: str | None, staged_tree: StagedTree | None
) -> Layout:
    """The layout of ``dataset`` of the HDF5 file ``path``, opened at ``read_path`` (the file
    or its copy in the staged tree ``staged_tree``).  A dataset reached through an external
    link into another file is read from that file, named by its PFS path: the link is
    resolved against ``path``'s directory on the PFS, not the staged copy's (HDF5 falls
    back to the copy's directory only when the PFS lacks the target; that copy is named
    by its source's path too).  Each node then maps the target to its own staged copy, as
    any file.  Not collective."""
    try:
        import h5py
    except ImportError as exc:
        raise DependencyError("reading HDF5 datasets needs h5py", hint="run 'make setup'") from exc
    try:
        f = h5py.File(read_path, "r")
    except OSError as exc:
        raise from_oserror(
            exc,
            "open the HDF5 file",
            path,
            hint="the file is not a readable HDF5 file (damaged or truncated?); "
            "check it with h5dump",
        ) from None
    with f:
        names = []
        f.visititems(
            lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None
        )
        listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        if dataset is None:
            if len(names) != 1:
                raise UsageError(
                    f"the HDF5 file has {len(names)} datasets ({listed})",
                    path=path,
                    hint="pass dataset='NAME' to choose one",
                )
            dataset = names[0]
        dset = _hdf5_object(f, dataset, path)
        if not isinstance(dset, h5py.Dataset):
            found = "no such path" if dset is None else f"a {type(dset).__name__.lower()}"
            error = NotFoundError if dset is None else UsageError
            raise error(
                f"{dataset!r} is not a dataset of the HDF5 file ({found})",
                path=path,
                hint=f"pass dataset= one of: {listed}" if names else "the file holds no dataset",
            )
        if dset.dtype.hasobject:
            raise UsageError(
                f"dataset {dataset!r} holds variable-length elements ({dset.dtype})",
                path=path,
                hint="collective reads need fixed-size elements; store strings with a "
                "fixed length (h5py.string_dtype(length=N)) or as a pack ('bbio pack')",
            )
        if not dset.shape:
            raise UsageError(
                f"dataset {dataset!r} has no axis 0 (a scalar, or a null dataspace); "
                "samples go along axis 0",
                path=path,
            )
        plist = dset.id.get_create_plist()
        if plist.get_external_count():
            raise UsageError(
                f"dataset {dataset!r} keeps its data in raw files outside the HDF5 file "
                f"(external storage, such as {plist.get_external(0)[0].decode()!r})",
                path=path,
                hint="open that raw file itself (record_bytes=, or sample_shape= and dtype=), "
                "or copy the data into the HDF5 file: f.create_dataset(name, data=...)",
            )
        layout = plist.get_layout()
        if layout != h5py.h5d.CONTIGUOUS:
            names = {h5py.h5d.CHUNKED: "chunked", h5py.h5d.COMPACT: "compact"}
            stored = "chunked and compressed" if dset.compression else names.get(layout, "virtual")
            raise UsageError(
                f"dataset {dataset!r} is {stored}, not contiguous",
                path=path,
                hint="collective reads need a contiguous dataset; copy it with "
                "f.create_dataset(name, data=..., chunks=None)",
            )
        offset = dset.id.get_offset()
        if offset is None and dset.size:
            raise UsageError(
                f"dataset {dataset!r} has no data in the file yet (it was never written)",
                path=path,
                hint="write its data first, or create it with f.create_dataset(name, data=...)",
            )
        holder = Path(os.path.realpath(dset.file.filename))
        elsewhere = not os.path.samefile(holder, read_path)  # reached through an external link
        return _fixed_layout(
            "hdf5",
            _pfs_path(holder, staged_tree) if elsewhere else path,
            os.path.getsize(holder),
            int(offset or 0),  # None: the dataset holds no byte (such as shape (0, 4))
            dset.shape[0],
            dset.shape[1:],
            dset.dtype,
        )


def _hdf5_object(f, name: str, path: Path):
    """The object ``name`` of the open HDF5 file ``f`` (``path`` on the PFS), or None when
    there is none (or an external link's target cannot be opened).  External links are
    resolved against ``path``'s directory (``H5Pset_elink_prefix``), wherever ``f`` was
    opened.  Not collective."""
    import h5py

    links = h5py.h5p.create(h5py.h5p.LINK_ACCESS)
    links.set_elink_prefix(os.fsencode(os.path.join(os.path.dirname(os.path.abspath(path)), "")))
    try:
        oid = h5py.h5o.open(f.id, name.encode(), lapl=links)
    except KeyError:
        return None
    kinds = {h5py.h5d.DatasetID: h5py.Dataset, h5py.h5g.GroupID: h5py.Group}
    return kinds.get(type(oid), h5py.Datatype)(oid)


def _raw_layout(
    path: Path, read_path: Path, record_bytes, sample_shape, dtype, header_bytes: int
) -> Layout:
    """The layout of a raw file; the arguments were checked by :func:`_open_arguments`."""
    if sample_shape is None:
        sample_shape = (record_bytes,)
    dt = np.dtype(dtype or "u1")
    record = math.prod(sample_shape) * dt.itemsize  # Python ints: never wraps
    try:
        size = os.path.getsize(read_path)
    except OSError as exc:
        raise from_oserror(exc, "stat the dataset file", read_path) from None
    if header_bytes > size:
        raise UsageError(
            f"header_bytes={header_bytes} is beyond the end of the file ({size} bytes)",
            path=path,
            hint="pass the size of the header that precedes the records",
        )
    records, left = divmod(size - header_bytes, record)
    if left:
        raise UsageError(
            f"the file's {size - header_bytes} bytes after a header of {header_bytes} are "
            f"not a whole number of {record}-byte records ({records} records and {left} "
            "bytes over)",
            path=path,
            hint="check record_bytes= (or sample_shape= and dtype=) and header_bytes=, "
            "and that the file is not still being written",
        )
    return _fixed_layout("raw", path, size, header_bytes, records, sample_shape, dt)


def _directory_layout(comm, root: Path, staged: Path | None) -> Layout:
    """Collective over ``comm``: one sample per file of ``root``.  The files are those of a
    complete staged copy's manifest (``staged``: a stage-in of the whole of ``root``,
    neither filtered nor with files skipped), else those listed on the PFS (a staged
    copy may hold only some of them)."""
    manifest = None
    with agreed(comm, f"opening the dataset {root}: reading its staged copy's manifest"):
        manifest = read_manifest(staged) if staged is not None else None
    complete = manifest is not None and manifest.attrs.get("complete") is True
    entries = [e for e in manifest.entries if e.kind == FILE] if complete else []
    listing = hashlib.sha256(repr([(e.path, e.size) for e in entries]).encode()).hexdigest()
    listings = set(comm.allgather(listing if complete else None))
    if len(listings) != 1 or None in listings:  # not one list on every node: the PFS's
        tree = walk(comm, root)
        check_readable(
            tree,
            skip_unreadable=False,
            where=str(root),
            hint="every file of a dataset is a sample: fix their permissions, or move "
            "them out of the directory",
        )
        entries = tree.files
    return Layout(
        "directory",
        [str(root / e.path) for e in entries],
        [e.size for e in entries],
        Extents(
            np.arange(len(entries), dtype=np.int32),
            np.zeros(len(entries), dtype=np.int64),
            np.array([e.size for e in entries], dtype=np.int64),
        ),
        None,
        None,
    )


def _local_copies(
    bb_dir: Path,
    node: int,
    files: Sequence[str],
    sizes: Sequence[int],
    crcs: Sequence[int] | None = None,
) -> dict[int, str]:
    """The files node ``node``'s burst buffer ``bb_dir`` holds with the sizes ``sizes`` (and
    the CRC32Cs ``crcs``, a pack's shards) the dataset expects: {file index: local path}.
    The others are read from the PFS.  Not collective."""
    found: dict[int, str] = {}
    manifests: dict[Path, dict] = {}
    for i, name in enumerate(files):
        hit = registry.lookup(bb_dir, Path(name))
        if hit is None:
            continue
        source, destination = hit
        if destination not in manifests:
            manifest = read_manifest(destination)
            manifests[destination] = manifest.by_path() if manifest else {}
        rel = os.path.relpath(os.path.realpath(name), source)
        entry = manifests[destination].get(rel)
        local = destination / rel
        held = entry is not None and entry.kind == FILE and entry.node in (None, node)
        same = crcs is None or entry is None or entry.crc32c in (None, crcs[i])
        if held and same and entry.size == sizes[i] and local.exists():
            found[i] = str(local)
    return found


#: a staged tree: (its source on the PFS, its copy in a burst buffer)
StagedTree = tuple[Path, Path]


def _staged_copy(staged_tree: StagedTree | None, path: Path) -> Path | None:
    """Where ``staged_tree`` holds the PFS path ``path`` (which it contains), if anywhere.
    Not collective."""
    if staged_tree is None:
        return None
    source, destination = staged_tree
    return destination / os.path.relpath(os.path.realpath(path), source)


def _pfs_path(file: Path, staged_tree: StagedTree | None) -> Path:
    """``file`` as a PFS path: a file inside the copy of ``staged_tree`` is its source's
    file; any other file is itself.  Not collective."""
    if staged_tree is not None:
        source, destination = staged_tree
        inside = os.path.relpath(os.path.realpath(file), destination)
        if inside != os.pardir and not inside.startswith(os.pardir + os.sep):
            return Path(os.path.normpath(source / inside))
    return file


def _open_files_budget() -> int:
    """How many files the datasets open in this process keep open together: the soft
    ``RLIMIT_NOFILE`` less :data:`RESERVED_FILES` (the job's own descriptors), at least
    :data:`MIN_OPEN_FILES` (half the limit below that), at most :data:`MAX_OPEN_FILES`.
    First raises the soft limit toward the hard one, to at most ``MAX_OPEN_FILES +
    RESERVED_FILES``, where that is allowed.  Not collective."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    wanted = MAX_OPEN_FILES + RESERVED_FILES
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if raised > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):  # refused (a container's policy): the limit stays
            pass
    return min(MAX_OPEN_FILES, max(soft - RESERVED_FILES, min(MIN_OPEN_FILES, soft // 2)))


#: a descriptor of a dataset's file: (file index, opened for O_DIRECT reads)
DescriptorKey = tuple[int, bool]


class _Descriptors:
    """This rank's open descriptors of dataset files, shared by every dataset open in the
    process, at most ``limit`` of them in all.

    Each dataset reaches them through its :class:`_DatasetDescriptors`, whose
    ``open_file(file, direct)`` opens one: (descriptor, opened with ``O_DIRECT``).
    Past ``limit`` the least recently used are closed, whichever dataset's they
    are, never one a read in flight has pinned (:meth:`pinned`): the background
    threads (an aggregator's next round, a loader's prefetch, another dataset's
    reads) read while another thread may open more.  A read that would pin more
    than ``limit`` together with the reads in flight waits for them.  Files are
    opened outside the lock: a slow open delays no other read.  Thread-safe, and
    a forked child starts with a new lock.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: OrderedDict[tuple[Any, int, bool], tuple[int, bool]] = OrderedDict()
        self._pins: Counter[tuple[Any, int, bool]] = Counter()
        self._changed = threading.Condition(threading.Lock())
        # datasets collected without close(): their descriptors are closed under the lock
        # next time it is taken (a collection may run in a thread that holds it)
        self.collected: list[_DatasetDescriptors] = []

    @contextmanager
    def pinned(
        self, owner: _DatasetDescriptors, keys: Iterable[DescriptorKey]
    ) -> Iterator[dict[DescriptorKey, tuple[int, bool]]]:
        """Open ``owner``'s descriptors ``keys`` (or find them open) and keep them open until
        the block ends: {key: (descriptor, opened with O_DIRECT)}.  Waits while other
        reads pin so many that these would take the pinned ones beyond ``limit`` (alone,
        a read is never held back).  Not collective."""
        keys = list(keys)
        owned = [(owner, *key) for key in keys]
        with self._changed:
            self._close_collected()
            self._changed.wait_for(
                lambda: not self._pins or len(self._pins.keys() | owned) <= self.limit
            )
            self._pins.update(owned)
        try:
            yield {key: self._get(owner, key) for key in keys}
        finally:
            with self._changed:
                self._pins.subtract(owned)
                self._pins += Counter()  # drops the keys no longer pinned
                self._close_unpinned_beyond(self.limit)
                self._changed.notify_all()

    def _get(self, owner: _DatasetDescriptors, key: DescriptorKey) -> tuple[int, bool]:
        """``owner``'s descriptor ``key``, which the caller has pinned."""
        owned = (owner, *key)
        with self._changed:
            if owned in self.held:
                self.held.move_to_end(owned)
                return self.held[owned]
        opened = owner.open_file(*key)
        with self._changed:
            if owned in self.held:  # another read opened it meanwhile
                os.close(opened[0])
                self.held.move_to_end(owned)
                return self.held[owned]
            self._close_unpinned_beyond(self.limit - 1)  # room for this one
            self.held[owned] = opened
            return opened

    def _close_unpinned_beyond(self, count: int) -> None:
        """Close the least recently used unpinned descriptors until at most ``count`` are
        open (or only pinned ones are left).  Holds the lock."""
        excess = len(self.held) - count
        if excess <= 0:
            return
        unpinned = (key for key in self.held if not self._pins[key])  # least recent first
        for key in list(itertools.islice(unpinned, excess)):
            os.close(self.held.pop(key)[0])

    def _close_collected(self) -> None:
        """Close the descriptors of the datasets collected without ``close()``.  Holds the
        lock."""
        while self.collected:
            self._close_owned(self.collected.pop())

    def _close_owned(self, owner: _DatasetDescriptors) -> None:
        for key in [key for key in self.held if key[0] is owner]:
            os.close(self.held.pop(key)[0])

    def held_by(self, owner: _DatasetDescriptors) -> dict[DescriptorKey, tuple[int, bool]]:
        """``owner``'s open descriptors.  Not collective."""
        with self._changed:
            self._close_collected()
            return {(f, direct): v for (o, f, direct), v in self.held.items() if o is owner}

    def close_all(self, owner: _DatasetDescriptors) -> None:
        """Close ``owner``'s descriptors (none of its reads may be in flight).  Not
        collective."""
        with self._changed:
            self._close_collected()
            self._close_owned(owner)

    def after_fork_in_child(self) -> None:
        """A forked child has only the thread that forked: a new lock, no read in flight
        (the descriptors stay, inherited)."""
        self._changed = threading.Condition(threading.Lock())
        self._pins.clear()


_SHARED_DESCRIPTORS = _Descriptors(MIN_OPEN_FILES)
os.register_at_fork(after_in_child=_SHARED_DESCRIPTORS.after_fork_in_child)


class _DatasetDescriptors:
    """A dataset's share of the process's open descriptors (:class:`_Descriptors`):
    :meth:`open_file` opens one of its files.  Making it sets the shared limit anew from
    ``RLIMIT_NOFILE`` (:func:`_open_files_budget`).  It refers to the dataset weakly,
    and a dataset collected without ``close()`` has its descriptors closed: the shared
    descriptors do not keep it, nor its memory, alive."""

    def __init__(self, dataset: Dataset, shared: _Descriptors) -> None:
        self._open_file = weakref.WeakMethod(dataset._open_file)
        self.shared = shared
        shared.limit = _open_files_budget()
        weakref.finalize(dataset, shared.collected.append, self)  # takes no lock

    def open_file(self, f: int, direct: bool) -> tuple[int, bool]:
        """The dataset's :meth:`Dataset._open_file`.  Not collective."""
        open_file = self._open_file()
        assert open_file is not None, "a dataset's reads keep it alive"
        return open_file(f, direct)

    @property
    def limit(self) -> int:
        """The most descriptors every dataset of the process keeps open together."""
        return self.shared.limit

    @property
    def held(self) -> dict[DescriptorKey, tuple[int, bool]]:
        """This dataset's open descriptors."""
        return self.shared.held_by(self)

    def pinned(self, keys: Iterable[DescriptorKey]):
        """:meth:`_Descriptors.pinned` for this dataset.  Not collective."""
        return self.shared.pinned(self, keys)

    def close_all(self) -> None:
        """Close this dataset's descriptors.  Not collective."""
        self.shared.close_all(self)


class Dataset:
    """A dataset opened collectively with :func:`open_dataset`.

    ``read`` and ``close`` are collective over the communicator it was opened
    with (bbio uses a private duplicate of it).  ``len(ds)`` is the number of
    samples; ``path`` the path it was opened with; ``opening`` names this
    opening, the same on every rank (a Loader checks that the ranks passed one
    dataset).
    """

    def __init__(
        self, comm, path: Path, layout: Layout, local: dict[int, str], config: Config
    ) -> None:
        self.comm = comm
        self.path = path
        self.layout = layout
        self.config = config
        self.closed = False
        self.loaders: weakref.WeakSet = weakref.WeakSet()  # closed before the dataset is
        self.stats = ReadStats()
        self.opening = comm.bcast(
            f"{path} opened as {uuid.uuid4().hex[:12]}" if comm.Get_rank() == 0 else None
        )
        topo = topology(comm, config.ranks_per_node)
        try:
            self.rank_node = topo.node_of_rank()
            node_rank = topo.node_comm.Get_rank()
            self.node = topo.node
            is_aggregator = node_rank < config.aggregators_per_node
            self.aggregators = [r for r, flag in enumerate(comm.allgather(is_aggregator)) if flag]
            holds = comm.allgather((topo.node, sorted(local)) if topo.is_leader else None)
        finally:
            topo.free()
        held = [[] for _ in range(max(self.rank_node) + 1)]
        for item in holds:
            if item is not None:
                held[item[0]] = item[1]
        self.holders = Holders.from_sets(len(held), len(layout.files), held)
        self.local = local
        self.stripe = config.stripe_size or comm.bcast(
            _stripe_size(self._path(0)) if comm.Get_rank() == 0 and layout.files else 4096
        )
        self.reads_alone = reads_alone(layout.extents, self.holders, config.read_direct_bytes)
        self._descriptors = _DatasetDescriptors(self, _SHARED_DESCRIPTORS)
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.layout.extents)

    @property
    def fixed_size(self) -> bool:
        """True when every sample has the same shape (reads return one array)."""
        return self.layout.sample_shape is not None

    def check_open(self) -> None:
        """Raise a :class:`UsageError` if the dataset was closed.  Not collective."""
        if self.closed:
            raise UsageError(
                "the dataset is closed", path=self.path, hint="open it again with open_dataset"
            )

    def _check_no_prefetching_loader(self, call: str) -> None:
        """Raise a :class:`UsageError` if a prefetching loader of this dataset is
        mid-iteration (:attr:`Loader.iterating`): its background thread runs collectives on
        this dataset's communicator, which a direct read would interleave with (raw MPI
        errors or a hang).  That state is the same on every rank, which all iterate alike,
        so every rank raises alike.  Not collective.  (The loaders' own reads call
        :meth:`_read_planned`, which does not check.)"""
        if any(loader.prefetch and loader.iterating for loader in list(self.loaders)):
            raise UsageError(
                f"{call} of the dataset {self.path} while a prefetching Loader of it is "
                "mid-iteration (started, neither closed nor at its end): its background "
                "thread reads over the dataset's communicator, and the reads would mix",
                path=self.path,
                hint="close the loader (or iterate it to its end) before reading the "
                "dataset directly",
            )

    def read(self, indices: Sequence[int] | np.ndarray) -> np.ndarray | list[np.ndarray]:
        """Collective over the dataset's communicator: each rank passes its own sample ids
        and gets its samples in that order.

        Returns an array of shape ``(len(indices), *sample_shape)`` for
        fixed-size samples, else a list of uint8 arrays.  A rank may pass no
        ids; ids may repeat; they must be integers (a boolean mask is refused:
        pass ``np.flatnonzero(mask)``).  Ids that are out of range or not
        integers raise the same :class:`UsageError` on every rank.  When every
        sample is large (``read_direct_bytes``), each rank reads its own and the
        ranks only agree on the outcome; otherwise the requests are exchanged first.
        While a prefetching :class:`Loader` of the dataset is mid-iteration, every rank
        raises the same :class:`UsageError` (before any collective).
        """
        self.check_open()
        self._check_no_prefetching_loader("read")
        if self.reads_alone:
            totals = np.zeros(4, dtype=np.int64)  # samples, requests, bytes read, bytes needed
            out = self._read_direct(indices, totals)
            self._add_counts(*totals.tolist(), direct=True)
            return out
        try:
            mine: np.ndarray | UsageError = _sample_ids(
                indices, self.comm.Get_rank(), self.path, len(self)
            )
        except UsageError as exc:  # handed to every rank, which raises it
            mine = exc
        everyone = gather_in_call(self.comm, f"read of {self.path}", mine)  # one collective
        for item in everyone:
            if isinstance(item, UsageError):
                raise item
        return self._read_planned(self._valid_requests(everyone))

    def read_planned(self, requests: Sequence[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        """Collective over the dataset's communicator: like :meth:`read`, with every
        rank's ids already known.

        ``requests[r]`` holds rank r's ids, and every rank passes the same list:
        one small allgather of a digest checks it (another length, bad ids or
        lists that differ between ranks raise the same :class:`UsageError` on
        every rank).  Each round is one ``Ialltoallw`` next to an
        ``Iallgather`` of every aggregator's status, so a failed read raises the
        same error on every rank; on the direct path one agreement does the same.
        ``requests`` must be a list (or another sequence) or a NumPy array: anything
        else (None, a generator, a dict, a set) is a :class:`UsageError` on every rank,
        as is a call while a prefetching :class:`Loader` of the dataset is mid-iteration.
        """
        self.check_open()
        self._check_no_prefetching_loader("read_planned")
        checked: list[np.ndarray] = []

        def check() -> str:
            checked.extend(self._valid_requests(requests))
            digest = hashlib.sha256(np.array([ids.size for ids in checked], np.int64).tobytes())
            for ids in checked:
                digest.update(ids.tobytes())
            return digest.hexdigest()

        digests = agreed_allgather(self.comm, f"read_planned of {self.path}", check)
        if len(set(digests)) != 1:
            differing = next(r for r, d in enumerate(digests) if d != digests[0])
            raise UsageError(
                f"read_planned: ranks 0 and {differing} passed different lists of ids",
                path=self.path,
                hint="pass every rank's ids, in rank order, the same on every rank",
            )
        return self._read_planned(checked)

    def _valid_requests(self, requests: Sequence) -> list[np.ndarray]:
        """``requests`` (one sequence of ids per rank) as int64 arrays; a UsageError
        unless there is one per rank and every id is in range.  Not collective."""
        size = self.comm.Get_size()
        listed = isinstance(requests, Sequence) and not isinstance(requests, (str, bytes))
        if not listed and not (isinstance(requests, np.ndarray) and requests.ndim >= 1):
            given = "a 0-d array" if isinstance(requests, np.ndarray) else type(requests).__name__
            raise UsageError(
                f"read_planned needs every rank's ids as one sequence per rank ({size}), "
                f"in rank order, not {given}",
                path=self.path,
                hint="pass a list or numpy array of requests, such as [ids_of_rank_0, "
                "ids_of_rank_1, ...], the same on every rank",
            )
        if len(requests) != size:
            raise UsageError(
                f"read_planned needs one list of ids per rank ({size}), got {len(requests)}",
                path=self.path,
            )
        valid = [_sample_ids(ids, r, self.path, len(self)) for r, ids in enumerate(requests)]
        for r, ids in enumerate(valid):
            self._check_ids(ids, r)
        return valid

    def _read_planned(self, requests: list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
        """Collective: :meth:`read_planned` of valid ``requests``, known to be every rank's."""
        rank = self.comm.Get_rank()
        counts = [ids.size for ids in requests]
        req_rank = np.repeat(np.arange(len(requests)), counts)
        everything = np.concatenate(requests)
        if not self.reads_alone:
            plan = make_plan(
                req_rank,
                np.concatenate([np.arange(c) for c in counts]),
                everything,
                self.layout.extents,
                self.rank_node,
                self.aggregators,
                self.holders,
                self.layout.file_sizes,
                self.stripe,
                self.config.read_max_hole,
                self.config.read_max_bytes,
            )
            if aggregation_pays(
                plan,
                req_rank,
                everything,
                self.layout.extents,
                self.rank_node,
                self.holders,
                self.config.read_min_saving / 100,
            ):
                out = self._read_aggregated(plan, counts[rank])
                self._count(requests, plan.requests_issued, plan.bytes_read)
                return out
        out = self._read_direct(requests[rank])
        lengths = self.layout.extents.take(everything)[2]
        self._count(requests, int(everything.size), int(lengths.sum()), direct=True)
        return out

    def _check_ids(self, ids: np.ndarray, rank: int) -> None:
        wrong = ids[(ids < 0) | (ids >= len(self))]
        if wrong.size:
            raise _out_of_range(int(wrong[0]), rank, self.path, len(self))

    def _read_aggregated(self, plan: ReadPlan, count: int) -> np.ndarray | list[np.ndarray]:
        """Collective: this rank's ``count`` samples, read by the aggregators in rounds.

        Every rank first allocates what it needs (an aggregator its buffer, every
        rank its samples) and the ranks agree on that: a rank that cannot makes every
        rank raise the same error before any exchange needs its memory."""
        rank = self.comm.Get_rank()
        agg = plan.aggregators.index(rank) if rank in plan.aggregators else -1
        rounds = split_rounds(plan, self.config.read_round_bytes)
        asked = plan.req_rank == rank
        lengths = np.zeros(count, dtype=np.int64)
        lengths[plan.req_pos[asked]] = plan.req_length[asked]
        places = np.cumsum(lengths) - lengths  # where each sample lands in ``target``
        buffer_bytes = plan.buffer_bytes(agg) if agg >= 0 else 0
        buffer = target = np.zeros(0, dtype=np.uint8)
        out: np.ndarray | list[np.ndarray] = []
        with agreed(self.comm, "collective read"):
            with self._allocating(buffer_bytes, "the aggregator's read buffer"):
                buffer = np.empty(buffer_bytes, dtype=np.uint8)
            out, target = self._landing(lengths, places)
        failure: Exception | None = None
        reading = self._read_round(plan, agg, buffer, rounds, 0)
        for k in range(rounds.count):
            try:
                if reading is not None:
                    reading.result()
            except Exception as exc:
                failure = exc
            reading = None
            if failure is None and k + 1 < rounds.count:
                reading = self._read_round(plan, agg, buffer, rounds, k + 1)
            chosen = rounds.req_round == k
            failed = failure is not None
            statuses = self._exchange(plan, buffer, agg, failed, chosen, target, places)
            if statuses.any():  # every rank received every aggregator's status
                if reading is not None:
                    concurrent.futures.wait([reading])
                with agreed(self.comm, "collective read"):
                    if failure is not None:
                        raise failure
        return out

    def _read_direct(self, ids, totals: np.ndarray | None = None) -> np.ndarray | list[np.ndarray]:
        """This rank's samples ``ids``, read by itself (``io_threads`` in flight).

        Collective only in its agreement: a failure on any rank raises the
        same error on every rank.  Given ``totals``, the ids are checked here
        (no other rank has seen them) and their counters (samples, requests,
        bytes read, bytes needed) are summed over the ranks by the agreement.
        """
        out: np.ndarray | list[np.ndarray] = []
        with agreed(self.comm, "collective read", totals):
            if totals is not None:
                ids = _sample_ids(ids, self.comm.Get_rank(), self.path, len(self))
                self._check_ids(ids, self.comm.Get_rank())
            files, offsets, lengths = self.layout.extents.take(ids)
            if totals is not None:
                unique = self.layout.extents.take(np.unique(ids))[2]
                totals[:] = ids.size, ids.size, lengths.sum(), unique.sum()
            places = np.cumsum(lengths) - lengths
            out, target = self._landing(lengths, places)
            if ids.size:
                self._pread(files, offsets, lengths, target, places)
        return out

    def _landing(
        self, lengths: np.ndarray, places: np.ndarray
    ) -> tuple[np.ndarray | list[np.ndarray], np.ndarray]:
        """(out, target): what a read of samples of ``lengths`` returns, and the bytes it is
        made of, sample i's at ``places[i]`` (back to back, in order).  Not collective; a
        :class:`OutOfMemoryError` if the memory cannot be had."""
        with self._allocating(
            int(lengths.sum()), f"the {lengths.size} samples this rank asked for"
        ):
            if self.fixed_size:
                out = np.empty((lengths.size, *self.layout.sample_shape), dtype=self.layout.dtype)
                return out, out.reshape(-1).view(np.uint8)
            target = np.empty(int(lengths.sum()), dtype=np.uint8)
        at = zip(places.tolist(), lengths.tolist(), strict=True)
        return [target[start : start + n] for start, n in at], target

    @contextmanager
    def _allocating(self, nbytes: int, what: str) -> Iterator[None]:
        """Turn a failure to allocate ``nbytes`` for ``what`` into an :class:`OutOfMemoryError`
        naming them and this rank.  Not collective."""
        try:
            yield
        except MemoryError:
            raise OutOfMemoryError(
                f"cannot allocate {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for {what}: "
                "out of memory",
                path=self.path,
                rank=self.comm.Get_rank(),
                node=self.node,
                hint="read fewer samples per call (a smaller batch_size); an aggregator "
                "holds every byte it reads for a call, so more aggregators "
                "(aggregators_per_node) each hold less",
            ) from None

    def _read_round(
        self, plan: ReadPlan, agg: int, buffer: np.ndarray, rounds: Rounds, k: int
    ) -> concurrent.futures.Future | None:
        """Start reading this aggregator's round ``k`` (in the background when it is not the
        only round); None if this rank reads nothing."""
        if agg < 0:
            return None
        mine = np.flatnonzero((plan.read_agg == agg) & (rounds.read_round == k))
        if rounds.count == 1:
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                self._aggregate(plan, mine, buffer)
                done.set_result(None)
            except Exception as exc:
                done.set_exception(exc)
            return done
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, "bbio-read")
        return self._reader.submit(self._aggregate, plan, mine, buffer)

    def _path(self, f: int) -> str:
        return self.local.get(f, self.layout.files[f])

    def _open_file(self, f: int, direct: bool) -> tuple[int, bool]:
        """(descriptor, opened with ``O_DIRECT``) of file ``f``, opened with ``O_DIRECT`` if
        ``direct`` and its file system allows it (tmpfs does not).  Not collective."""
        path = self._path(f)
        try:
            fd = _native.open_direct(path, os.O_RDONLY) if direct else None
            return (fd, True) if fd is not None else (os.open(path, os.O_RDONLY), False)
        except OSError as exc:
            raise from_oserror(exc, "open the dataset file", path, node=self.node) from None

    def _aggregate(self, plan: ReadPlan, mine: np.ndarray, buffer: np.ndarray) -> None:
        """Read the plan's reads ``mine`` into their places in ``buffer``."""
        if mine.size == 0:
            return
        self._pread(
            plan.read_file[mine],
            plan.read_offset[mine],
            plan.read_length[mine],
            buffer,
            plan.read_buf[mine],
        )

    def _pread(
        self,
        files: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        out: np.ndarray,
        places: np.ndarray,
    ) -> None:
        """Read ``lengths`` bytes of ``files`` at ``offsets`` into ``out`` at ``places``,
        ``io_threads`` in flight; a short read means the dataset changed.  Reads of at
        least ``read_odirect_bytes`` bypass the page cache (``O_DIRECT``) where the file
        system allows it.  The files are read a batch at a time, each batch no more files
        than the open descriptors kept (:class:`_Descriptors`) allow."""
        threshold = self.config.read_odirect_bytes
        direct = lengths >= threshold if threshold > 0 else np.zeros(lengths.size, dtype=bool)
        per_batch = self._descriptors.limit // 2  # a file may take two: buffered and O_DIRECT
        if len(self.layout.files) <= per_batch:  # the usual case: one batch, in the order given
            self._pread_batch(files, offsets, lengths, direct, out, places)
            return
        by_file = np.argsort(files, kind="stable")
        ordered = files[by_file]
        first_of_file = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        bounds = [*first_of_file[::per_batch].tolist(), files.size]
        for start, end in itertools.pairwise(bounds):
            batch = by_file[start:end]
            self._pread_batch(
                files[batch], offsets[batch], lengths[batch], direct[batch], out, places[batch]
            )

    def _pread_batch(
        self,
        files: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        direct: np.ndarray,
        out: np.ndarray,
        places: np.ndarray,
    ) -> None:
        """:meth:`_pread` of requests in at most ``limit // 2`` files, their descriptors held
        open until the reads are done."""
        keys = list(zip(files.tolist(), direct.tolist(), strict=True))
        with self._descriptors.pinned(set(keys)) as opened:
            got = _native.pread_batch(
                [opened[key][0] for key in keys],
                offsets,
                lengths,
                out,
                places,
                threads=self.config.io_threads,
                paths=[self._path(int(f)) for f in files],
                aligned=[opened[key][1] for key in keys],
            )
        short = np.flatnonzero(got != lengths)
        if short.size:
            raise IntegrityError(
                f"the file is shorter than the dataset says ({short.size} short reads)",
                path=self._path(int(files[short[0]])),
                node=self.node,
                hint="the dataset changed after it was opened; open it again",
            )

    def _exchange(
        self,
        plan: ReadPlan,
        buffer: np.ndarray,
        agg: int,
        failed: bool,
        chosen: np.ndarray,
        target: np.ndarray,
        places: np.ndarray,
    ) -> np.ndarray:
        """Hand out the ``chosen`` requests (one round); returns every aggregator's status.

        One ``Alltoallw`` whose datatypes index the aggregator's buffer on the
        sending side and this rank's ``target`` (sample at position p at
        ``places[p]``) on the receiving side, so the bytes move once; next to it an
        ``Allgather`` of each rank's failure flag.
        """
        from mpi4py import MPI

        size, rank = self.comm.Get_size(), self.comm.Get_rank()
        aggs = np.asarray(plan.aggregators, dtype=np.int64)
        created: list = []

        def indexed(lengths: np.ndarray, displacements: np.ndarray):
            lengths, displacements = split_blocks(lengths, displacements, MPI_BLOCK_BYTES)
            kind = MPI.BYTE.Create_hindexed(lengths.tolist(), displacements.tolist()).Commit()
            created.append(kind)
            return kind

        send_types, send_counts = [MPI.BYTE] * size, [0] * size
        if agg >= 0:
            mine = np.flatnonzero((plan.req_agg == agg) & chosen)
            mine = mine[np.lexsort((plan.req_pos[mine], plan.req_rank[mine]))]
            bounds = np.searchsorted(plan.req_rank[mine], np.arange(size + 1))
            for r in np.flatnonzero(np.diff(bounds)).tolist():
                part = mine[bounds[r] : bounds[r + 1]]
                send_types[r] = indexed(plan.req_length[part], plan.req_buf[part])
                send_counts[r] = 1
        asked = np.flatnonzero((plan.req_rank == rank) & chosen)
        asked = asked[np.lexsort((plan.req_pos[asked], plan.req_agg[asked]))]
        lengths = plan.req_length[asked]
        at = places[plan.req_pos[asked]]
        recv_types, recv_counts = [MPI.BYTE] * size, [0] * size
        bounds = np.searchsorted(plan.req_agg[asked], np.arange(aggs.size + 1))
        for a in np.flatnonzero(np.diff(bounds)).tolist():
            part = slice(bounds[a], bounds[a + 1])
            recv_types[aggs[a]] = indexed(lengths[part], at[part])
            recv_counts[aggs[a]] = 1
        statuses = np.zeros(size, dtype=np.uint8)
        zeros = [0] * size
        try:
            wait_quietly(
                self.comm.Iallgather(np.array([failed], dtype=np.uint8), statuses),
                self.comm.Ialltoallw(
                    [buffer, (send_counts, zeros), send_types],
                    [target, (recv_counts, zeros), recv_types],
                ),
            )
        finally:
            for kind in created:
                kind.Free()
        return statuses[aggs]

    def _count(
        self, requests: Sequence[np.ndarray], issued: int, bytes_read: int, direct: bool = False
    ) -> None:
        ids = np.unique(np.concatenate([np.asarray(r, dtype=np.int64) for r in requests]))
        samples = int(sum(np.asarray(r).size for r in requests))
        needed = int(self.layout.extents.take(ids)[2].sum())
        self._add_counts(samples, issued, bytes_read, needed, direct)

    def _add_counts(
        self, samples: int, requests: int, bytes_read: int, bytes_needed: int, direct: bool
    ) -> None:
        self.stats.calls += 1
        self.stats.direct_calls += int(direct)
        self.stats.samples += samples
        self.stats.requests += requests
        self.stats.bytes_read += bytes_read
        self.stats.bytes_needed += bytes_needed

    def close(self) -> None:
        """Collective over the dataset's communicator: close its loaders (see
        :meth:`Loader.close`), then the files, and free the communicator.  Closing again
        does nothing (and is not collective).  While other ranks are in another call of
        this dataset (closed on some ranks only), every rank raises the same
        :class:`UsageError` and the files stay open.  Leaving a ``with`` block closes
        without that check, as the ranks may leave it differently (one on an exception)."""
        if self.closed:
            return
        self._close_loaders()
        same_arguments(self.comm, f"close of {self.path}", {})
        self._close_here()

    def _close_loaders(self) -> None:
        """Collective: close the loaders of this dataset, whose background reads use its
        communicator."""
        for loader in list(self.loaders):
            loader.close()

    def _close_here(self) -> None:
        """Close this rank's files and free the communicator, once (after the loaders).
        Not collective."""
        if self.closed:
            return
        self._close_loaders()
        self.closed = True
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
        self._descriptors.close_all()
        self.comm.Free()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc) -> None:
        self._close_here()


def open_dataset(
    comm,
    path: str | os.PathLike,
    *,
    dataset: str | None = None,
    record_bytes: int | None = None,
    sample_shape: Sequence[int] | None = None,
    dtype: str | np.dtype | None = None,
    header_bytes: int = 0,
    config: Config | None = None,
) -> Dataset:
    """Collective over ``comm``: open ``path`` for collective reads.

    ``path`` (on the PFS) is a pack made by ``bbio pack``, an HDF5 file
    (``dataset=`` names the dataset when there are several), a raw file of
    fixed-size records (``record_bytes=``, or ``sample_shape=`` and
    ``dtype=``, after ``header_bytes``), or a directory of files (one sample
    per file).  Files staged into this node's burst buffer are read there.
    Every rank must pass the same arguments and the same read settings of
    ``config`` (without ``config``, each rank loads its own with
    :func:`~bbio.config.load_config`, after the first collective).  Errors
    (different or invalid arguments or settings, a missing path, an unsupported
    layout) are raised alike on every rank.
    """
    private = comm.Dup()  # the first collective: nothing before it may fail on one rank only
    try:
        arguments: dict[str, Any] = {}
        with agreed(private, "open_dataset"):
            # a bad setting in one node's environment or site file: an error on every rank
            config = config or load_config()
            arguments = _open_arguments(
                path, dataset, record_bytes, sample_shape, dtype, header_bytes
            )
        settings = {f"config.{name}": getattr(config, name) for name in SHARED_SETTINGS}
        same_arguments(private, "open_dataset", {**arguments, **settings})
        return _open(private, config=config, **arguments)
    except BaseException:
        private.Free()
        raise


def _open_arguments(path, dataset, record_bytes, sample_shape, dtype, header_bytes) -> dict:
    """:func:`open_dataset`'s arguments checked and normalised (the same values give the same
    result on every rank).  Not collective."""
    path = Path(os.path.abspath(path_argument("the path", path)))
    if dataset is not None and (not isinstance(dataset, str) or not dataset):
        raise UsageError(f"dataset= must name an HDF5 dataset, not {dataset!r}", path=path)
    if record_bytes is not None:
        record_bytes = integer_argument("record_bytes", record_bytes, 1, path)
    if sample_shape is not None:
        if isinstance(sample_shape, (str, bytes)) or not isinstance(
            sample_shape, (Sequence, np.ndarray)
        ):
            raise UsageError(
                f"sample_shape must be a tuple of positive integers, not {sample_shape!r}",
                path=path,
            )
        sample_shape = tuple(integer_argument("sample_shape", n, 1, path) for n in sample_shape)
        if record_bytes is not None:
            raise UsageError(
                "pass record_bytes= or sample_shape= (with dtype=), not both", path=path
            )
    if dtype is not None:
        try:
            dt = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"dtype={dtype!r} is not a NumPy dtype ({exc})", path=path) from None
        if dt.hasobject or dt.itemsize == 0:
            raise UsageError(f"dtype={dtype!r} has no fixed size in bytes", path=path)
        if sample_shape is None:
            raise UsageError("dtype= goes with sample_shape=", path=path)
        dtype = dt
    if record_bytes is not None:
        _check_record_bytes(record_bytes, path)
    elif sample_shape is not None:
        itemsize = 1 if dtype is None else dtype.itemsize  # without dtype=: bytes
        _check_record_bytes(math.prod(sample_shape) * itemsize, path)
    return {
        "path": path,
        "dataset": dataset,
        "record_bytes": record_bytes,
        "sample_shape": sample_shape,
        "dtype": dtype,
        "header_bytes": integer_argument("header_bytes", header_bytes, 0, path),
    }


def _sample_ids(ids, rank: int, path: Path, samples: int) -> np.ndarray:
    """Rank ``rank``'s sample ``ids`` of the dataset ``path`` (of ``samples`` samples) as a
    flat int64 array; a :class:`UsageError` unless they are integers (booleans and floats
    are refused), naming any id beyond int64 as it was passed.  Not collective."""
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"the sample ids of rank {rank} are not an array of integers ({exc})", path=path
        ) from None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind == "f" and not isinstance(ids, np.ndarray):  # ints NumPy made floats
        exact = np.asarray(ids, dtype=object)
        if all(_is_integer(i) for i in exact.flat):
            array = exact
    if array.dtype == object and all(_is_integer(i) for i in array.flat):  # beyond 64 bits
        wide = [int(i) for i in array.flat]
        beyond = next((i for i in wide if not INT64.min <= i <= INT64.max), None)
        if beyond is not None:
            raise _out_of_range(beyond, rank, path, samples)
        array = np.array(wide, dtype=np.int64)
    if array.dtype.kind == "u" and array.max() > INT64.max:  # astype(int64) would wrap
        flat = array.reshape(-1)
        raise _out_of_range(int(flat[flat > INT64.max][0]), rank, path, samples)
    if array.dtype.kind not in "iu":
        hint = "for a boolean mask pass np.flatnonzero(mask)" if array.dtype == bool else None
        raise UsageError(
            f"the sample ids of rank {rank} must be integers, not {array.dtype}",
            path=path,
            hint=hint,
        )
    return array.astype(np.int64, copy=False).reshape(-1)


def _is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _out_of_range(sample: int, rank: int, path: Path, samples: int) -> UsageError:
    return UsageError(
        f"sample id {sample} (asked by rank {rank}) is out of range: "
        f"the dataset has {samples} samples",
        path=path,
        hint="ids go from 0 to len(dataset) - 1",
    )


def _open(comm, path, dataset, record_bytes, sample_shape, dtype, header_bytes, config) -> Dataset:
    topo = topology(comm, config.ranks_per_node)
    node, is_leader, nodes_on_host = topo.node, topo.is_leader, topo.nodes_on_host
    topo.free()
    bb_dir = config.node_dir(config.bb_root, node, nodes_on_host)
    staged_tree: StagedTree | None = None
    with agreed(comm, f"opening the dataset {path}: reading the staging registry"):
        staged_tree = registry.lookup(bb_dir, path)
    staged = _staged_copy(staged_tree, path)
    source = _either(path, staged)
    with agreed(comm, f"opening the dataset {path}"):
        if not source.exists():
            raise NotFoundError("the dataset does not exist", path=path, node=node)
    kind = None
    seen = (False, False)  # a pack's index, a pack being written (or failed)
    with agreed(comm, f"opening the dataset {path}"):
        if comm.Get_rank() == 0 and not source.is_dir():
            kind = "hdf5" if _is_hdf5(source) else "raw"
        elif comm.Get_rank() == 0 or is_leader:  # the PFS's, and every node's copy
            places = {source, path} if comm.Get_rank() == 0 else {source}
            seen = tuple(any((p / name).exists() for p in places) for name in PACK_MARKS)
    kind = comm.bcast(kind, root=0)
    if kind is None:
        index, pending = (any(flags) for flags in zip(*comm.allgather(seen), strict=True))
        if pending and not index:  # its shards would be served as a directory's samples
            raise NotFoundError(
                "not a bbio pack yet: a pack into it is being written, or failed",
                path=path / PENDING_NAME,
                hint="wait for 'bbio pack' to finish, or run it again",
            )
        kind = "packed" if index else "directory"
    raw_options = record_bytes, sample_shape, dtype
    if kind != "raw" and (any(o is not None for o in raw_options) or header_bytes):
        raise UsageError(
            f"record_bytes=, sample_shape=, dtype= and header_bytes= are for raw files; "
            f"this is {_KINDS[kind]}",
            path=path,
        )
    if kind != "hdf5" and dataset is not None:
        raise UsageError(f"dataset= is for HDF5 files; this is {_KINDS[kind]}", path=path)
    if kind == "raw" and record_bytes is None and sample_shape is None:
        raise UsageError("a raw file needs record_bytes=, or sample_shape= and dtype=", path=path)
    local: dict[int, str] | None = None
    if kind == "directory":
        layout = _directory_layout(comm, path, staged)
    elif kind == "packed":
        layout, local = _packed_layout(comm, node, is_leader, path, staged, bb_dir)
    else:
        layout = None
        with agreed(comm, f"opening the dataset {path}"):
            if comm.Get_rank() == 0:
                if kind == "hdf5":
                    layout = _hdf5_layout(path, source, dataset, staged_tree)
                else:
                    layout = _raw_layout(
                        path, source, record_bytes, sample_shape, dtype, header_bytes
                    )
        layout = comm.bcast(layout, root=0)  # a few bytes: fixed-size extents are computed
    if local is None:
        with agreed(comm, f"opening the dataset {path}: reading the staging manifests"):
            local = _local_copies(bb_dir, node, layout.files, layout.file_sizes, layout.file_crcs)
    return Dataset(comm, path, layout, local, config)


_KINDS = {
    "hdf5": "an HDF5 file",
    "raw": "a raw file",
    "packed": "a pack",
    "directory": "a directory of files",
}


def _is_hdf5(path: Path) -> bool:
    """Whether ``path`` holds HDF5's signature where HDF5 looks for it: at byte 0, or after
    a user block, at 512, 1024, 2048 and every power of two above, within the file.  Not
    collective."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset + len(HDF5_SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE:
                    return True
                offset = max(512, offset * 2)
            return False
    except OSError as exc:
        raise from_oserror(exc, "open", path) from None
