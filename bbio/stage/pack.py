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

Plain h5py reads a sample: ``f["data"][f["offsets"][i] : f["offsets"][i] + f["sizes"][i]]``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bbio import _native
from bbio._version import __version__
from bbio.config import Config, load_config
from bbio.errors import DependencyError, IntegrityError, NotFoundError, from_oserror
from bbio.mpi import agreed, deal, topology
from bbio.report import format_bytes, format_table
from bbio.stage.plan import group_by_size
from bbio.stage.walk import check_readable, walk
from bbio.transfer import files
from bbio.transfer.manifest import Entry

FORMAT = "bbio-pack/1"
INDEX_NAME = "bbio-pack.json"
DEFAULT_SHARD_SIZE = 1 << 30
_SLAB = 64 << 20


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
    """What ``pack`` wrote."""

    samples: int
    shards: int
    bytes: int
    seconds: float

    def report(self) -> str:
        """A readable summary."""
        rows = [
            ("samples", self.samples),
            ("shards", self.shards),
            ("bytes", format_bytes(self.bytes)),
            ("seconds", f"{self.seconds:.2f}"),
            ("GB/s", f"{self.bytes / self.seconds / 1e9:.2f}" if self.seconds else "-"),
        ]
        return "bbio pack\n" + format_table(["", ""], rows)


def _h5py():
    try:
        import h5py
    except ImportError as exc:
        raise DependencyError("bbio pack needs h5py", hint="run 'make setup'") from exc
    return h5py


def _read_files(src: Path, group: Sequence[Entry], threads: int) -> tuple[np.ndarray, list[int]]:
    """The bytes of ``group`` back to back, and each file's CRC32C."""
    sizes = [e.size for e in group]
    buffer = np.empty(sum(sizes), dtype=np.uint8)
    fds = []
    try:
        for e in group:
            try:
                fds.append(os.open(src / e.path, os.O_RDONLY))
            except OSError as exc:
                raise from_oserror(exc, "open for reading", src / e.path) from None
        got = _native.pread_batch(
            fds, [0] * len(fds), sizes, buffer, threads=threads, paths=[src / e.path for e in group]
        )
    finally:
        for fd in fds:
            os.close(fd)
    short = [e.path for e, n in zip(group, got, strict=True) if n != e.size]
    if short:
        raise IntegrityError(
            f"{len(short)} file(s) changed size while being packed: {', '.join(short[:10])}",
            path=src,
            hint="stop what writes to the source and run bbio pack again",
        )
    crcs, start = [], 0
    for size in sizes:
        crcs.append(_native.crc32c(buffer[start : start + size]))
        start += size
    return buffer, crcs


def _write_shard(
    src: Path, out: Path, index: int, first_sample: int, group: Sequence[Entry], threads: int
) -> ShardInfo:
    h5py = _h5py()
    name = f"shard-{index:05d}.h5"
    final = out / name
    temp = files.temp_path(final)
    sizes = np.array([e.size for e in group], dtype=np.int64)
    offsets = np.zeros(len(group), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    crcs = np.zeros(len(group), dtype=np.uint32)
    total = int(sizes.sum())
    with h5py.File(temp, "w", libver="latest") as f:
        data = f.create_dataset("data", shape=(total,), dtype=np.uint8)
        slabs = group_by_size(list(range(len(group))), _SLAB, lambda i: group[i].size)
        for slab in slabs:
            buffer, slab_crcs = _read_files(src, [group[i] for i in slab], threads)
            start = int(offsets[slab[0]])
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
    file_bytes, file_crc = files.checksum_file(temp)
    with open(temp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temp, final)
    return ShardInfo(name, len(group), first_sample, total, data_offset, file_bytes, file_crc)


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
    ranks write different shards.  ``out/bbio-pack.json`` is written last.
    """
    config = config or load_config()
    start = time.monotonic()
    src, out = Path(src), config.expand(out)
    topo = topology(comm, config.ranks_per_node)
    threads = config.stage_threads(topo.node_comm.Get_size())
    topo.free()
    tree = walk(comm, src, include, exclude, listers=threads)
    check_readable(tree, False, str(src))
    shards = group_by_size(tree.files, shard_size, lambda e: e.size)
    firsts = [0]
    for group in shards[:-1]:
        firsts.append(firsts[-1] + len(group))
    with agreed(comm, f"pack: creating {out}"):
        if comm.Get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
    infos: list[ShardInfo] = []
    with agreed(comm, "pack: writing shards"):
        for index in deal(list(range(len(shards))), comm):
            infos.append(_write_shard(src, out, index, firsts[index], shards[index], threads))
    infos = sorted((i for part in comm.allgather(infos) for i in part), key=lambda i: i.file)
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
    return PackSummary(len(tree.files), len(infos), tree.total_bytes, time.monotonic() - start)


def read_index(out: str | os.PathLike) -> list[ShardInfo]:
    """The shards listed in ``out/bbio-pack.json``.  Not collective."""
    document = files.read_json(Path(out) / INDEX_NAME)
    if document is None:
        raise NotFoundError(
            "not a bbio pack (no index)",
            path=Path(out) / INDEX_NAME,
            hint="create it with 'bbio pack SRC OUT'",
        )
    if document.get("format") != FORMAT:
        raise IntegrityError(f"unknown pack format {document.get('format')!r}", path=out)
    return [ShardInfo(**s) for s in document["shards"]]
