"""Writing one checkpoint file per node, collectively, with parallel HDF5.

The ranks of a node open the node's file together (h5py, driver ``mpio``, on
the node communicator) and create every rank's datasets collectively (HDF5
metadata changes must be collective): contiguous, their space allocated at
creation and never filled.  Each rank then writes its arrays' bytes itself, one
``pwrite`` per array at the offset HDF5 allocated for it, with the CRC32C
computed in the same pass (native code) while the bytes are in cache; the
ranks share their CRCs and set them collectively as one root attribute (one
HDF5 metadata change per file, whatever the number of arrays), and HDF5
writes its metadata when the file closes.  HDF5 never touches a contiguous
dataset's bytes it did not write, so the file is a plain HDF5 file.  The file
is written under a temporary name, fsynced, then renamed; its record is written
last.

A save may instead rewrite a recycled file in place: a drained node file of the
very same layout (datasets, shapes, dtypes, placement), moved to the temporary
name by the node leader before the save.  No dataset is created and no HDF5
metadata but the root attributes changes, so no collective HDF5 call is
needed: the node's rank 0 opens the file alone, finds every dataset in place
and tells the node's ranks their offsets; each rank overwrites its arrays'
bytes with their CRC32C, on tmpfs through a mapping of its part of the file that
it keeps for the next time the file comes back (:mod:`bbio.checkpoint.mapped`);
rank 0 gathers the CRCs, sets the root attributes anew and closes.  Overwriting
pages the file already has saves the file system their allocation: on tmpfs,
writing into a new file costs about twice as much as overwriting one.  A spare
not as its layout key says (damage in the burst buffer) is deleted, and the file
laid out anew.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bbio import _native
from bbio._version import __version__
from bbio.checkpoint.layout import (
    CRC_ATTR,
    GLOBAL,
    MAX_DIMENSIONS,
    Box,
    Shard,
    as_array,
    check_key,
    first_overlap,
    rank_dataset,
    shard_parts,
    uncovered,
)
from bbio.checkpoint.mapped import NodeFileMappings, release_deleted
from bbio.errors import DependencyError, IntegrityError, UsageError, error_class_for_errno
from bbio.mpi import agreed_error, describe_error
from bbio.transfer import files

log = logging.getLogger("bbio")

NO_OFFSET = -1  # a dataset with no bytes, in the offsets a node's ranks share
HEAP_COLLECTION_BYTES = 4 << 10  # the smallest global heap collection HDF5 adds to a file


def _h5py():
    try:
        import h5py
    except ImportError as exc:
        raise DependencyError("checkpoints need h5py", hint="run 'make setup'") from exc
    if not h5py.get_config().mpi:
        raise DependencyError(
            "h5py was built without MPI: checkpoints need parallel HDF5 (driver 'mpio')",
            hint="rebuild h5py with HDF5_MPI=ON against a parallel HDF5 ('make setup' does)",
        )
    return h5py


def describe(arrays: Mapping[str, Any]) -> dict[str, dict]:
    """Shape, dtype, size and (for Shards) placement of each of this rank's arrays."""
    if not isinstance(arrays, Mapping):
        raise UsageError(
            f"the state to save is a {type(arrays).__name__}, not a dict of state keys to arrays",
            hint="pass {'model/w': array, ...}, or {'w': bbio.Shard(...), ...} for slices of "
            "global arrays",
        )
    spec = {}
    for key, value in arrays.items():
        check_key(key)
        if isinstance(value, Shard):  # checked again: it may have changed since it was built
            try:
                data, start, global_shape = shard_parts(value.data, value.start, value.global_shape)
            except UsageError as exc:
                exc.message = f"state {key!r}: {exc.message}"
                raise
        else:
            data = as_array(f"state {key!r}", value)
        check_storable(f"state {key!r}", data)
        entry: dict[str, Any] = {
            "shape": list(data.shape),
            "dtype": data.dtype.str,
            "bytes": int(data.nbytes),
        }
        if isinstance(value, Shard):
            entry["start"] = list(start)
            entry["global_shape"] = list(global_shape)
        spec[key] = entry
    return spec


def check_storable(what: str, data: np.ndarray) -> None:
    """Raise the :class:`UsageError` saying why ``data`` cannot be stored as it is and
    restored with the same dtype and shape, if it cannot.  Not collective."""
    dtype = data.dtype
    refused = dtype.kind in "UMm"  # unicode, datetime64, timedelta64: no HDF5 type
    if dtype.hasobject or refused or dtype.names is not None or dtype.itemsize == 0:
        raise UsageError(
            f"{what} has dtype {dtype}, which bbio cannot store",
            hint="store numbers, bytes ('S') or raw bytes (np.frombuffer(b, np.uint8)); "
            "store each field of a structured array as an array of its own",
        )
    if np.dtype(dtype.str) != dtype:  # bfloat16, float8, int4 (ml_dtypes): raw bytes in HDF5
        raise UsageError(
            f"{what} has dtype {dtype}, which NumPy does not define: it would be restored "
            f"as raw bytes ({np.dtype(dtype.str)})",
            hint=f"save its bits, a.view(np.uint{8 * dtype.itemsize}), and view them back "
            f"(.view({dtype.name})) after restore",
        )
    if data.ndim > MAX_DIMENSIONS:
        raise UsageError(
            f"{what} has {data.ndim} dimensions; HDF5 stores at most {MAX_DIMENSIONS}",
            hint="reshape it to fewer dimensions, and back after restore",
        )


def write_node_file(
    node_comm,
    path: Path,
    rank: int,
    arrays: Mapping[str, Any],
    node_specs: Sequence[tuple[int, Mapping[str, dict]]],
    attrs: Mapping[str, Any],
    recycled: bool = False,
    temp: Path | None = None,
    reserve: int = 0,
    mappings: NodeFileMappings | None = None,
) -> tuple[int, int] | None:
    """Collective over ``node_comm``: write the node's checkpoint file at ``path``.

    ``rank`` is this rank's rank in the job; ``node_specs`` the (job rank,
    :func:`describe`) of every rank of the node, the same on each; ``attrs``
    the file's root attributes (the same on every rank).  ``recycled``, read on
    the node's rank 0: the temporary file is already there, a node file of
    this very layout, to be rewritten in place if rank 0 finds every dataset
    in it as expected (else the file is laid out anew).  ``temp``: the name the
    file is written under before its rename (the same on every rank; default
    :func:`files.temp_path`).  ``reserve``, read on the node's rank 0: the bytes the
    file is given on the device before HDF5 writes any (:func:`_reserve_new_file`; a
    spare's too, :func:`_open_spare`): a device too full for them is a
    :class:`NoSpaceError` before any collective HDF5 call, which HDF5 could not
    survive.  ``mappings`` (given on every rank of the node, or on none): this rank's
    mappings of files it rewrote (:mod:`bbio.checkpoint.mapped`), through which it
    rewrites a spare on tmpfs.  Returns the file's size and CRC32C on the
    node's rank 0, once the file is durable under its final name there (the
    CRC32C from the arrays' own, combined with those of the bytes HDF5 wrote
    around them, read back: a few pages); other ranks return None before
    that.  A rank whose write fails raises its error, and the file is never
    renamed (rank 0 returns None): the caller
    makes every rank agree on the outcome (one agreement over all nodes, not
    one per node before it: a save's critical path is its collectives).
    """
    h5py = _h5py()
    temp = files.temp_path(path) if temp is None else temp
    leader = node_comm.Get_rank() == 0
    spare = None
    if leader and recycled:
        spare = _open_spare(h5py, temp, node_specs, reserve, rewrite_growth(attrs, node_specs))
    datasets = _node_datasets(node_specs)
    try:
        offsets = _share_offsets(node_comm, datasets, None if spare is None else spare[1])
        if offsets is None:
            if mappings is not None:  # a spare the leader deleted gives its room back first
                release_deleted()
                node_comm.Barrier()
            _reserve_new_file(node_comm, temp, reserve)
            extents = _write_new_file(
                h5py, node_comm, temp, rank, arrays, node_specs, datasets, attrs
            )
        else:  # rank 0 has every rank's CRCs only once every write is done
            extents = _gather_extents(
                node_comm,
                datasets,
                lambda: _write_raw(temp, rank, arrays, offsets.__getitem__, mappings),
            )
            if spare is not None and extents is not None:
                _set_root_attrs(h5py, spare[0], attrs, extents)
        if spare is not None:
            spare_file, spare = spare[0], None  # closed once: HDF5 crashes on a second try
            spare_file.close()  # HDF5 writes the attributes now, into the room reserved
    except Exception as exc:  # named after the file: the caller's agreement names the rank
        if spare is not None:
            with contextlib.suppress(Exception):  # failing anyway
                spare[0].close()
        raise agreed_error([(rank, *describe_error(exc))], f"writing {path}", 1) from exc
    if not leader or extents is None:
        return None
    sizes = {
        rank_dataset(key, owner): entry["bytes"]
        for owner, spec in node_specs
        for key, entry in spec.items()
    }
    fd = os.open(temp, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        os.ftruncate(fd, size)  # frees what the reservation held beyond the file's end
        os.fsync(fd)
        known = [(at, sizes[name], crc) for name, (crc, at) in extents.items() if at != NO_OFFSET]
        crc = files.checksum_around(fd, temp, size, known)
    finally:
        os.close(fd)
    os.replace(temp, path)
    files.fsync_dirs([path.parent])
    return size, crc


def _write_new_file(
    h5py,
    node_comm,
    temp: Path,
    rank: int,
    arrays: Mapping[str, Any],
    node_specs: Sequence[tuple[int, Mapping[str, dict]]],
    datasets: list[list[str]],
    attrs: Mapping[str, Any],
) -> dict[str, tuple[int, int]] | None:
    """Collective over ``node_comm``: lay the file out with parallel HDF5, write every
    rank's arrays into it, set the root attributes; the (CRC32C, offset) of every
    dataset (:func:`_gather_extents`), or None if another rank's write failed (this
    rank's failure is raised once the file is closed).  ``datasets``:
    :func:`_node_datasets` of ``node_specs``."""
    with h5py.File(temp, "r+", driver="mpio", comm=node_comm) as f:
        _create_datasets(h5py, f, node_specs)
        extents = _gather_extents(
            node_comm,
            datasets,
            lambda: _write_raw(temp, rank, arrays, lambda name: f[name].id.get_offset()),
            everywhere=True,
        )
        if extents is not None:  # else a rank failed: it raises, after the collective close
            _set_root_attrs(h5py, f, attrs, extents)
    return extents


def _reserve_new_file(node_comm, temp: Path, reserve: int) -> None:
    """Collective over ``node_comm``: rank 0 writes an empty HDF5 file at ``temp``
    (:func:`_empty_hdf5_image`, which the node's ranks then open together) and reserves
    ``reserve`` bytes of the device for it, its size unchanged (the leader truncates
    what was not used once the file is written).  HDF5 that meets a full device while
    it writes or closes a file cannot close it: the save hung, or the ranks crashed.
    A device without room is one :class:`NoSpaceError` on every rank of the node
    instead, before HDF5 opens the file, and ``temp`` is removed."""
    failure = np.zeros(1, dtype=np.int64)  # the errno of rank 0's failure, else 0
    if node_comm.Get_rank() == 0:
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, _empty_hdf5_image())
                _reserve_up_to(fd, reserve)
            finally:
                os.close(fd)
        except OSError as exc:
            failure[0] = exc.errno or errno.EIO
            with contextlib.suppress(OSError):
                temp.unlink()
    node_comm.Bcast(failure, root=0)
    if failure[0]:
        code = int(failure[0])
        what = f"reserve {reserve} bytes for the node's file" if reserve else "create the file"
        raise error_class_for_errno(code)(
            f"cannot {what}: {os.strerror(code)}",
            path=temp,
            errno=code,
            hint="free space on its file system (or raise its quota), then save again",
        )


def _reserve_up_to(fd: int, nbytes: int) -> None:
    """Reserve the device's blocks for the file ``fd`` up to ``nbytes``, its size unchanged:
    from its end only (a look at each page it has costs a millisecond per 32 MiB on
    tmpfs).  Raises OSError (ENOSPC) when the device cannot hold them."""
    size = os.fstat(fd).st_size
    _native.preallocate(fd, nbytes - size, at_least=0, keep_size=True, offset=size)


@functools.cache
def _empty_hdf5_image() -> bytes:
    """The bytes of an HDF5 file with nothing in it, as h5py creates one by default."""
    h5py = _h5py()
    image = io.BytesIO()
    with h5py.File(image, "w"):
        pass
    return image.getvalue()


def _node_datasets(node_specs: Sequence[tuple[int, Mapping[str, dict]]]) -> list[list[str]]:
    """The names of each node rank's datasets, in node rank order, as every rank knows
    them: what the node's collectives exchange values of, in fixed-size buffers."""
    return [[rank_dataset(key, owner) for key in spec] for owner, spec in node_specs]


def _share_offsets(
    node_comm, datasets: list[list[str]], offsets: Mapping[str, int | None] | None
) -> dict[str, int | None] | None:
    """Collective over ``node_comm``: rank 0's ``offsets`` of the spare's ``datasets``
    (:func:`_node_datasets`; None: no spare to rewrite), on every rank.  One broadcast
    of a buffer whose size every rank knows (a pickled object takes two: its size,
    then its bytes)."""
    names = [name for owned in datasets for name in owned]
    shared = np.full(1 + len(names), NO_OFFSET, dtype=np.int64)  # [0]: a spare is rewritten
    if offsets is not None:
        shared[0] = 1
        shared[1:] = [NO_OFFSET if offsets[name] is None else offsets[name] for name in names]
    node_comm.Bcast(shared, root=0)
    if shared[0] != 1:
        return None
    placed = zip(names, shared[1:], strict=True)
    return {name: None if at == NO_OFFSET else int(at) for name, at in placed}


def _gather_extents(
    node_comm,
    datasets: list[list[str]],
    write: Callable[[], dict[str, tuple[int, int]]],
    everywhere: bool = False,
) -> dict[str, tuple[int, int]] | None:
    """Collective over ``node_comm``: run this rank's ``write`` and share the (CRC32C,
    offset) of every rank's ``datasets`` (:func:`_node_datasets`; offset
    ``NO_OFFSET`` for a dataset without bytes) with the node's rank 0
    (``everywhere``: with every rank), in one gather of buffers whose sizes every
    rank knows.  Raises this rank's failure once shared (the caller's close may be
    collective); None where another rank failed, and on ranks they are not shared
    with."""
    counts = [1 + 2 * len(owned) for owned in datasets]  # [0] of each: the rank failed
    mine = np.zeros(counts[node_comm.Get_rank()], dtype=np.int64)
    failure = None
    try:
        written = write()
        mine[1:] = [value for name in datasets[node_comm.Get_rank()] for value in written[name]]
    except Exception as exc:
        failure = exc
        mine[0] = 1
    receiving = everywhere or node_comm.Get_rank() == 0
    shared = np.empty(sum(counts), dtype=np.int64) if receiving else None
    if everywhere:
        node_comm.Allgatherv(mine, [shared, counts])
    else:
        node_comm.Gatherv(mine, [shared, counts] if receiving else None, root=0)
    if failure is not None:
        raise failure
    if shared is None:
        return None
    everyone = np.split(shared, np.cumsum(counts)[:-1])
    if any(theirs[0] for theirs in everyone):
        return None
    return {
        name: (int(theirs[1 + 2 * i]), int(theirs[2 + 2 * i]))
        for owned, theirs in zip(datasets, everyone, strict=True)
        for i, name in enumerate(owned)
    }


def _set_root_attrs(
    h5py, f, attrs: Mapping[str, Any], extents: Mapping[str, tuple[int, int]]
) -> None:
    """Set ``attrs`` and the datasets' CRC32Cs (of their ``extents``: :func:`_gather_extents`)
    as ``f``'s root attributes (collective
    where ``f`` is open collectively).  An attribute already there with the value's
    type and shape (a recycled file's) is overwritten in place through h5py's
    low-level API, in half the time ``attrs.modify`` takes; any other is created, or
    replaced."""
    crcs = {name: crc for name, (crc, _) in extents.items()}
    for name, value in {**attrs, CRC_ATTR: json.dumps(crcs, sort_keys=True)}.items():
        if not _overwrite_attr(h5py, f.id, name, value):
            f.attrs[name] = value


def _overwrite_attr(h5py, owner, name: str, value: Any) -> bool:
    """Write ``value`` into the attribute ``name`` of the HDF5 object ``owner`` (a
    low-level id) if it is there as h5py would store ``value``: a scalar UTF-8 string
    of variable length for a ``str``, else numbers of the very dtype and shape NumPy
    gives ``value``; False (nothing written) if not."""
    key = name.encode()
    if not h5py.h5a.exists(owner, key):
        return False
    attr = h5py.h5a.open(owner, key)
    if isinstance(value, str):
        stored = h5py.check_string_dtype(attr.dtype)
        if stored is None or stored.length is not None or stored.encoding != "utf-8":
            return False
        data = np.array(value, dtype=attr.dtype)
    else:
        data = np.asarray(value)
        if data.dtype.kind not in "iuf" or data.dtype != attr.dtype:
            return False
    if data.shape != attr.shape:
        return False
    attr.write(data)
    return True


def rewrite_growth(
    attrs: Mapping[str, Any], node_specs: Sequence[tuple[int, Mapping[str, dict]]]
) -> int:
    """At most the bytes a rewrite of a spare's root attributes to ``attrs`` (and to the
    CRC32Cs of the datasets of ``node_specs``) adds to it: HDF5 writes each string anew
    into a global heap collection it adds to the file, and does not reuse the room of
    the strings it replaced (4 KiB a rewrite with small attributes; 104 KiB with 100 KiB
    of them)."""
    crcs = {rank_dataset(key, owner): 2**32 - 1 for owner, spec in node_specs for key in spec}
    strings = [value for value in attrs.values() if isinstance(value, str)]
    strings.append(json.dumps(crcs, sort_keys=True))
    return sum(len(text.encode()) + HEAP_COLLECTION_BYTES for text in strings)


def _open_spare(
    h5py,
    temp: Path,
    node_specs: Sequence[tuple[int, Mapping[str, dict]]],
    reserve: int,
    growth: int,
):
    """The node's rank 0: reserve ``reserve`` bytes of the device for the recycled file
    ``temp``, open it (alone: only its root attributes will change) and check that it
    holds the datasets of ``node_specs`` and nothing else (:func:`_spare_offsets`).
    Its rewritten attributes grow it by up to ``growth`` bytes (:func:`rewrite_growth`),
    which must fit in ``reserve``: HDF5 must not meet a full device when it closes the
    file (it could not close it).  Returns the open file and the datasets' offsets; or
    None, once ``temp`` is deleted, for the file to be laid out anew (a reader of the
    old file keeps it): a spare too large for the rewrite, or one that cannot be
    rewritten (said in the log).  Never raises: the node's other ranks wait for its
    answer."""
    f = None
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            fits = size + growth <= reserve
            if fits:
                _reserve_up_to(fd, reserve)
        finally:
            os.close(fd)
        if not fits:
            log.info(
                "checkpoint file %s: the spare (%d bytes) could grow past the %d bytes its "
                "save may take: laid out anew",
                temp,
                size,
                reserve,
            )
            temp.unlink()
            return None
        f = h5py.File(temp, "r+", locking="best-effort")
        return f, _spare_offsets(h5py, f, node_specs)
    except Exception as exc:
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()
        log.warning(
            "checkpoint file %s: the spare cannot be rewritten (%s): laid out anew", temp, exc
        )
        with contextlib.suppress(OSError):
            temp.unlink()
        return None


def _spare_offsets(
    h5py, f, node_specs: Sequence[tuple[int, Mapping[str, dict]]]
) -> dict[str, int | None]:
    """Where each dataset of the spare ``f`` keeps its bytes (None: it has none),
    checked to hold the arrays ``node_specs`` describe, each in an extent of its
    own, and no other dataset."""
    expected = {
        rank_dataset(key, owner): entry
        for owner, owner_spec in node_specs
        for key, entry in owner_spec.items()
    }
    groups = {name.rsplit("/", i)[0] for name in expected for i in range(1, name.count("/") + 1)}
    found: list[str] = []
    f.visit(found.append)  # names only: cheaper than making an object of each
    if set(found) != set(expected) | groups:
        raise IntegrityError(
            f"the spare holds {sorted(set(found) - set(expected) - groups)} beside the saved "
            f"datasets and lacks {sorted(set(expected) - set(found))}"
        )
    offsets: dict[str, int | None] = {}
    for name, entry in expected.items():
        offsets[name] = _offset_in_spare(h5py, h5py.h5d.open(f.id, name.encode()), name, entry)
    extents = sorted(
        (offset, expected[name]["bytes"]) for name, offset in offsets.items() if offset is not None
    )
    for (first, size), (second, _) in itertools.pairwise(extents):
        if first + size > second:
            raise IntegrityError(f"the spare's datasets overlap at byte {second}")
    return offsets


def _offset_in_spare(h5py, dataset, name: str, entry: dict) -> int | None:
    """Where ``dataset``, named ``name``, keeps its bytes (None: it has none), checked to
    hold an array as ``entry`` (:func:`describe`) describes it.  ``dataset`` is a
    low-level id: h5py's high-level objects take twice the time."""
    placement = {
        k: [int(v) for v in _read_attr(h5py, dataset, k)]
        for k in ("start", "global_shape")
        if h5py.h5a.exists(dataset, k.encode())
    }
    saved = {k: entry[k] for k in ("start", "global_shape") if k in entry}
    if (
        list(dataset.shape) != entry["shape"]
        or dataset.dtype.str != entry["dtype"]
        or placement != saved
    ):
        raise IntegrityError(
            f"the spare's {name} is {dataset.shape} {dataset.dtype.str} {placement}, "
            f"not as saved: {entry}"
        )
    if not entry["bytes"]:
        return None
    offset = dataset.get_offset()
    if offset is None or dataset.get_storage_size() != entry["bytes"]:
        raise IntegrityError(f"the spare's {name} does not hold its bytes in one extent")
    return offset


def _read_attr(h5py, owner, name: str) -> np.ndarray:
    """The attribute ``name`` of the HDF5 object ``owner`` (a low-level id)."""
    attr = h5py.h5a.open(owner, name.encode())
    data = np.empty(attr.shape, dtype=attr.dtype)
    attr.read(data)
    return data


def _create_datasets(h5py, f, node_specs: Sequence[tuple[int, Mapping[str, dict]]]) -> None:
    """Collective: every rank's datasets, contiguous, space allocated at creation and
    never filled."""
    placement = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    placement.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    placement.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    for owner, owner_spec in node_specs:
        for key, entry in owner_spec.items():
            dataset = f.create_dataset(
                rank_dataset(key, owner),
                shape=tuple(entry["shape"]),
                dtype=entry["dtype"],
                dcpl=placement,
            )
            if "start" in entry:
                dataset.attrs["start"] = entry["start"]
                dataset.attrs["global_shape"] = entry["global_shape"]


def _write_raw(
    temp: Path,
    rank: int,
    arrays: Mapping[str, Any],
    offset_of: Callable[[str], int | None],
    mappings: NodeFileMappings | None = None,
) -> dict[str, tuple[int, int]]:
    """Write this rank's arrays into their datasets' allocated space (``offset_of`` a
    dataset's name), through a mapping of ``mappings`` where it gives one; their (CRC32C,
    offset) by dataset name (``NO_OFFSET`` for an array without bytes)."""
    written: dict[str, tuple[int, int]] = {}
    placed: list[tuple[str, np.ndarray, int]] = []
    for key, value in arrays.items():
        name = rank_dataset(key, rank)
        data = np.asarray(value.data if isinstance(value, Shard) else value)
        if data.size:
            placed.append((name, data, offset_of(name)))
        else:
            written[name] = (0, NO_OFFSET)
    if not placed:
        return written
    fd = os.open(temp, os.O_RDWR if mappings is not None else os.O_WRONLY)
    try:
        mapping = None
        if mappings is not None:
            start = min(offset for _, _, offset in placed)
            end = max(offset + data.nbytes for _, data, offset in placed)
            mapping = mappings.mapping(fd, temp, start, end)
        for name, data, offset in placed:  # a contiguous copy of one array at a time, if any
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if mapping is not None:
                written[name] = (mapping.write_crc(raw, offset), offset)
            else:
                written[name] = (_native.pwrite_crc(fd, raw, offset, temp), offset)
    finally:
        os.close(fd)
    return written


def file_attrs(
    step: int,
    when: float,
    ranks: int,
    nodes: int,
    node: int,
    node_ranks: list[int],
    layout: str,
    global_shapes: Mapping[str, list[int]],
    user_attrs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The root attributes of a node file (JSON-encoded where HDF5 has no type for them)."""
    return {
        "step": step,
        "time": when,
        "ranks": ranks,
        "nodes": nodes,
        "node": node,
        "node_ranks": node_ranks,
        "layout": layout,
        "global_shapes": json.dumps(dict(global_shapes) if layout == GLOBAL else {}),
        "user_attrs": json.dumps(dict(user_attrs or {})),
        "bbio": __version__,
    }


def global_shapes(all_specs: list[dict[str, dict]], arrays_layout: str) -> dict[str, list[int]]:
    """The global shape of every key (global layout), checked to agree across ranks, and
    the ranks' shards of each key checked not to overlap (identical ones are replicas)
    and to cover the whole global array."""
    shapes: dict[str, list[int]] = {}
    if arrays_layout != GLOBAL:
        return shapes
    boxes: dict[str, list[tuple[int, Box]]] = {}
    dtypes: dict[str, str] = {}
    for rank, spec in enumerate(all_specs):
        for key, entry in spec.items():
            if shapes.setdefault(key, entry["global_shape"]) != entry["global_shape"]:
                raise UsageError(
                    f"ranks disagree on the global shape of {key!r}: "
                    f"{shapes[key]} and {entry['global_shape']}"
                )
            if dtypes.setdefault(key, entry["dtype"]) != entry["dtype"]:
                raise UsageError(
                    f"ranks disagree on the dtype of {key!r}: {dtypes[key]} and "
                    f"{entry['dtype']} (rank {rank})",
                    hint="give every Shard of a global array the array's dtype",
                )
            boxes.setdefault(key, []).append((rank, (tuple(entry["start"]), tuple(entry["shape"]))))
    for key in shapes:
        parent = next((p for p in _parents(key) if p in shapes), None)
        if parent is not None:
            raise UsageError(
                f"global arrays {parent!r} and {key!r}: the view on the PFS would need "
                f"{parent!r} to be both an array and the group of {key!r}",
                hint="rename one of them (e.g. 'layer/weight' beside 'layer/bias')",
            )
    for key, held in boxes.items():
        pair = first_overlap([box for _, box in held])
        if pair is not None:
            (rank_a, box_a), (rank_b, box_b) = held[pair[0]], held[pair[1]]
            raise UsageError(
                f"the Shards of {key!r} of ranks {rank_a} and {rank_b} overlap: "
                f"{_extent(box_a)} and {_extent(box_b)}",
                hint="give each rank its own part of a global array; a part several ranks "
                "hold must be the same box on each (a replica, restored from one of them)",
            )
        shape = tuple(shapes[key])
        missing = uncovered(((0,) * len(shape), shape), [box for _, box in held])
        if missing:
            raise UsageError(
                f"the Shards of {key!r} leave {missing} of the {math.prod(shape)} elements of "
                f"its global shape {shape} in no rank's Shard (read as zeros from global.h5)",
                hint="give the ranks' Shards the whole global array between them, or save "
                "this state as per-rank arrays (plain arrays, not Shards)",
            )
    return shapes


def _parents(key: str) -> list[str]:
    """``a``, ``a/b`` for ``a/b/c``: the groups ``key`` lies in."""
    parts = key.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _extent(box: Box) -> str:
    """``[0:4, 2:3]``: a box as the slices it covers."""
    return "[" + ", ".join(f"{s}:{s + n}" for s, n in zip(*box, strict=True)) + "]"
