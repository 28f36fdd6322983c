"""Suite ``checkpoint``: bbio's asynchronous checkpoints against h5py, DCP and raw limits.

``mpirun -n 4 python -m bbio.bench checkpoint [--quick] [--json FILE] [--pfs DIR]
[--bb DIR] [--sizes 16MiB,64MiB] [--repeats N] [--systems ...] [--stream N]
[--no-drop-caches]``

Every rank holds a state of ``--arrays`` (4) float32 arrays, equal parts of
the per-rank size (16, 64 and 256 MiB; ``--quick``: 16 and 64 MiB); the ranks
form virtual nodes of 2 (4 ranks: 2 nodes).  The case is the per-rank size
(``64MiB``).  Metric ``seconds``, each value the maximum over the ranks of
one measurement that starts after a barrier:

* ``bbio``: the blocking time of ``Checkpointer.save`` in the steady state of a
  run (each node rewrites in place the file of a checkpoint that retention
  trimmed, ``ckpt_recycle``: every rank's arrays written into it with their
  CRC32C, its node leader setting the root and CRC attributes anew, fsync,
  rename, the drain's journal entry); ``bbio-committed``: from the same start
  until ``SaveHandle.wait()`` returns (the drain processes copied, verified
  and committed the checkpoint on the PFS).  ``keep_bb`` is 1: the burst
  buffer holds the last checkpoint and the spare file.  One checkpointer
  serves the whole run, so its drain processes stay up as they would in
  training.
* ``bbio-fresh``: the same save by a second checkpointer with ``ckpt_recycle``
  off: each node's HDF5 file laid out collectively anew (a run's first saves,
  or every save with recycling off).
* ``bbio-stream``: ``--stream`` (4) saves by ``bbio``'s checkpointer back to
  back, then waited for: the seconds from the end of the first save to every one
  committed (the later saves run meanwhile, as training would; a queued save
  finds no spare, so it lays its file out anew).  What a queue of checkpoints
  costs the drain, whose copy of one overlaps the finishing of the one before.
* ``h5py-sync``: the baseline, a synchronous write of the same arrays straight
  to the PFS: one HDF5 file (h5py, driver ``mpio``, ``COMM_WORLD``), every
  rank's datasets created collectively, each rank writing its own; close, then
  fsync by rank 0.
* ``h5py-bb``: the same h5py write in bbio's layout, one file per node (driver
  ``mpio`` on the node communicator) into the burst buffer, fsync by the node
  leader, and nothing else: HDF5's own floor for bbio's ``save``, which also
  checksums the arrays, agrees on the outcome and writes records.
* ``dcp-async`` and ``dcp-async-committed``: the peer,
  ``torch.distributed.checkpoint.async_save`` of the same arrays as CPU tensors
  (``torch.from_numpy``, keys prefixed with the rank so that nothing is
  deduplicated) into a directory on the PFS, gloo process group over TCP on
  127.0.0.1, one intra-op thread per rank (``torch.set_num_threads(1)``): the
  time until ``async_save`` returns, and until its future completes.  Skipped,
  with a logged note, when torch cannot be imported on every rank.
* ``memcpy``: each rank copies its arrays into other arrays in memory (the
  physical floor).
* ``bb-write``: raw ``os.pwrite`` of the same bytes into the burst buffer in
  bbio's layout, one file per node: the node leader creates it, every rank
  of the node writes its bytes at its offset, then the leader fsyncs.
* ``bb-rewrite``: the same raw writes into the node file a previous
  ``bb-write`` left (written untimed just before): the floor of a save that
  rewrites a recycled file.
* ``bb-write-fpp``: raw write+fsync into the burst buffer, one file per rank
  (what the device takes; on tmpfs writes to one file are serialised).
* ``pfs-write``: raw write+fsync of the same bytes to the PFS, one file per
  rank (all ranks writing: what the PFS takes).
* ``pfs-write-node``: raw write+fsync to the PFS as the drain writes: one file
  per node, written by one process per node (the leader writes the node's
  byte count from its own arrays) while the other ranks wait.
* ``pfs-commit``: the floor of what the issue asks of a drain, with none of
  the drain's code (only the transfer layer's durable writes and read-back
  checksum): as ``pfs-write-node``, but each leader makes the
  step directory and writes under a temporary name, reads the file back with
  its CRC32C in a thread during the fsync (as the drain verifies), renames it
  and fsyncs the directory; once every node's file is in place (a barrier, no
  look at the PFS), rank 0 writes a ``global.h5``-sized and a manifest-sized
  document (``VIEW_BYTES``, ``MANIFEST_BYTES``) under temporary names, each
  fsynced, at once, renames the view, then the manifest, and fsyncs the
  directory once.  No burst-buffer read, no records, no lock and one directory
  fsync fewer than bbio's commit: a lower bound on any drain that copies one
  file per node, verifies it and commits with the manifest last.
* ``pfs-commit-bb``: ``pfs-commit`` with the bytes copied from the burst
  buffer, as a drain must take them: each leader copies a node file of the
  node's bytes (written there untimed just before, as a save leaves it) with
  the native copy and its CRC32C, in file order, as the drain copies.  The
  floor of a drain on this machine, where reading the burst buffer takes the
  same cores as the PFS's client and servers.

Derived, metric ``GB_per_s`` (10**9 bytes/s of state, all ranks): ``bbio-drain``
= bytes / (``bbio-committed`` - ``bbio``) of the same save, ``bbio-drain-stream``
= ``--stream`` x bytes / ``bbio-stream``, ``pfs-write``, ``pfs-write-node``,
``pfs-commit`` and ``pfs-commit-bb``.

Before measuring, one untimed round of every system at 1 MiB per rank warms
up imports, MPI-IO, the drain processes and gloo; before each size, one
untimed round of every system and three more saves by ``bbio`` bring it to
the steady state of a run: the two files each node takes turns with (the last
checkpoint and the spare) each rewritten once in the size's layout (on tmpfs,
each rank keeps its mapping of them).  So do three untimed saves after each
``bbio-stream``, whose queued saves lay out new files.  The systems'
order rotates from one repetition to the next.  Before every system the files of the
previous one are removed (the burst buffer is memory), except what bbio's
retention keeps (each checkpointer's last checkpoint, and ``bbio``'s spare),
and, as root, the page cache is dropped (``sync; echo 1 >
/proc/sys/vm/drop_caches``; tmpfs keeps its files).  The PFS is a fresh
directory under ``--pfs`` (default: the system temp directory, local disk),
the burst buffers a fresh directory under
``--bb`` (default ``/dev/shm``, tmpfs), both removed at the end.  The JSON's
``machine.checkpoint`` holds the paths, file system types, sizes, repetitions,
the saves of one ``bbio-stream`` and the torch version (or why DCP was skipped).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import bbio.bench as bench
from bbio import _native
from bbio.bench import (
    BenchContext,
    MiB,
    at_least,
    byte_size,
    drop_caches,
    fs_type,
    gb_per_s,
    idle_barrier,
    names,
    suite,
)
from bbio.bench.copy import size_label
from bbio.checkpoint import drain, layout
from bbio.checkpoint.checkpointer import Checkpointer
from bbio.config import Config
from bbio.errors import UsageError
from bbio.mpi import topology
from bbio.transfer import files

FULL_SIZES = (16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (16 * MiB, 64 * MiB)
WARMUP_SIZE = MiB
RANKS_PER_NODE = 2
KEYS = ("model/w0", "model/w1", "optim/exp_avg", "optim/exp_avg_sq")
COLUMNS = 256  # arrays are (rows, 256) float32 when the size allows
SYSTEMS = (
    "memcpy",
    "bb-write",
    "bb-rewrite",
    "bb-write-fpp",
    "bbio",
    "bbio-fresh",
    "bbio-stream",
    "h5py-bb",
    "h5py-sync",
    "dcp-async",
    "pfs-write",
    "pfs-write-node",
    "pfs-commit",
    "pfs-commit-bb",
)
# The seconds recorded, in this order (two systems give two values each).
REPORTED = (
    "memcpy",
    "bb-write",
    "bb-rewrite",
    "bb-write-fpp",
    "bbio",
    "bbio-committed",
    "bbio-fresh",
    "bbio-stream",
    "h5py-bb",
    "h5py-sync",
    "dcp-async",
    "dcp-async-committed",
    "pfs-write",
    "pfs-write-node",
    "pfs-commit",
    "pfs-commit-bb",
)
COMMIT_TIMEOUT = 1800.0
CKPT_NAME = "bench"
KEEP_BB = 1
STREAM_SAVES = 4
MANIFEST_BYTES = 1024  # a bbio manifest of two nodes' files is about 400 bytes
VIEW_BYTES = 20 << 10  # global.h5 of the suite's two nodes of 2 x 4 arrays


def _sizes(text: str) -> list[int]:
    sizes = [byte_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one size, e.g. 16MiB,64MiB")
    return sizes


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pfs",
        metavar="DIR",
        help="the PFS: a fresh subdirectory is used and removed (default: the temp directory)",
    )
    parser.add_argument(
        "--bb",
        metavar="DIR",
        default="/dev/shm",
        help="the burst buffers: a fresh subdirectory is used and removed (default: /dev/shm)",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        metavar="LIST",
        help="per-rank state sizes, e.g. 1MiB,2MiB (default 16MiB,64MiB,256MiB; --quick: "
        "16MiB,64MiB)",
    )
    parser.add_argument(
        "--repeats", type=at_least(1), help="repetitions per size (default 5; --quick: 2)"
    )
    parser.add_argument("--arrays", type=at_least(1), default=len(KEYS), help="arrays per rank")
    parser.add_argument(
        "--stream",
        type=at_least(2),
        default=STREAM_SAVES,
        metavar="N",
        help=f"saves back to back in one measurement of bbio-stream (default {STREAM_SAVES})",
    )
    parser.add_argument(
        "--systems",
        type=names(SYSTEMS),
        default=list(SYSTEMS),
        metavar="LIST",
        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)",
    )
    parser.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="do not drop the page cache before each system (default: drop it, as root)",
    )


# ------------------------------------------------------------------ helpers


def make_state(rank: int, nbytes: int, arrays: int) -> dict[str, np.ndarray]:
    """``arrays`` float32 arrays of random values summing to ``nbytes`` (a multiple of 4)."""
    if nbytes % 4 or nbytes < 4 * arrays:
        raise UsageError(f"a per-rank size must be a multiple of 4 bytes, >= {4 * arrays}")
    floats = nbytes // 4
    counts = [floats // arrays] * arrays
    counts[-1] += floats - sum(counts)
    rng = np.random.default_rng(1_000 + rank)
    keys = [KEYS[i] if i < len(KEYS) else f"extra/a{i}" for i in range(arrays)]
    state = {}
    for key, count in zip(keys, counts, strict=True):
        shape = (count // COLUMNS, COLUMNS) if count % COLUMNS == 0 else (count,)
        state[key] = rng.random(count, dtype=np.float32).reshape(shape)
    return state


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def write_arrays(fd: int, arrays: list[np.ndarray], offset: int = 0) -> int:
    """``os.pwrite`` the arrays one after the other from ``offset``; the bytes written."""
    start = offset
    for array in arrays:
        view = _bytes_of(array)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        offset += len(view)
    return offset - start


def write_bytes(fd: int, arrays: list[np.ndarray], nbytes: int) -> None:
    """``os.pwrite`` ``nbytes`` from the start of ``fd``, cycling through the arrays."""
    offset = 0
    while offset < nbytes:
        for array in arrays:
            view = _bytes_of(array)[: nbytes - offset]
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            offset += len(view)


def write_file(path: Path, arrays: list[np.ndarray]) -> None:
    """Create ``path``, write the arrays, fsync, close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_arrays(fd, arrays)
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_node_file(source: Path, fd: int, target: Path) -> None:
    """Copy the file ``source`` into the empty open file ``fd`` (``target``) as the drain
    copies a node file: the native copy with its CRC32C, in file order."""
    source_fd = os.open(source, os.O_RDONLY)
    try:
        _native.copy_whole(
            source_fd, fd, src_path=source, dst_path=target, checksum=True, sequential=True
        )
    finally:
        os.close(source_fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _max(comm, value: float) -> float:
    from mpi4py import MPI

    return float(comm.allreduce(value, op=MPI.MAX))


def _into_the_burst_buffer(ck: Checkpointer, handle) -> None:
    """Raise if ``handle``'s save did not go through the burst buffer (the numbers would
    not measure it)."""
    if handle.direct or handle.skipped:
        raise UsageError(
            f"the save of checkpointer {ck.name} went "
            f"{'straight to the PFS' if handle.direct else 'skipped'}: "
            "the numbers would not measure the burst buffer",
            hint="give --bb a directory with room for more checkpoints of a node (four, "
            "and bbio-stream's --stream more)",
        )


def _torch_status(comm, wanted: bool) -> tuple[bool, str]:
    """Collective: (whether every rank can import torch, its version or why not)."""
    if not wanted:
        return False, "not selected (--systems)"
    reason = None
    try:
        import torch
        import torch.distributed.checkpoint

        version = str(torch.__version__)
    except Exception as exc:
        reason = f"torch is not importable ({type(exc).__name__}: {exc})"
        version = ""
    reasons = [r for r in comm.allgather(reason) if r]
    return (False, reasons[0]) if reasons else (True, version)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ the suite


class CheckpointBench:
    """The systems of one run; every method but the helpers is collective."""

    def __init__(self, ctx: BenchContext, pfs: Path, bb: Path, use_torch: bool) -> None:
        self.ctx, self.comm, self.args = ctx, ctx.comm, ctx.args
        self.rank, self.size = ctx.rank, ctx.comm.Get_size()
        self.pfs, self.bb = pfs, bb
        self.topo = topology(self.comm, RANKS_PER_NODE)
        self.node, self.nodes = self.topo.node, self.topo.nodes
        self.leader = self.topo.is_leader
        self.node_bb = bb / str(self.node)
        self.drops: list[bool] = []
        self.step = 0
        self.use_torch = use_torch
        self.torch_ready = False
        self.config = Config(
            bb_root=str(bb / "{node}"),
            pfs_root=str(pfs),
            ranks_per_node=RANKS_PER_NODE,
            progress="never",
        )
        self.ck: Checkpointer | None = None
        self.ck_fresh: Checkpointer | None = None
        self.stopped = False

    # -------------------------------------------------------------- set-up

    def start(self) -> None:
        if self.leader:
            for sub in ("raw", "h5py"):
                (self.node_bb / sub).mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            for sub in ("raw", "h5py", "dcp"):
                (self.pfs / sub).mkdir(parents=True, exist_ok=True)
        self.comm.Barrier()
        if {"bbio", "bbio-stream"} & set(self.args.systems):
            self.ck = Checkpointer(
                self.comm, CKPT_NAME, keep_bb=KEEP_BB, keep_pfs=1_000_000, config=self.config
            )
        if "bbio-fresh" in self.args.systems:
            self.ck_fresh = Checkpointer(
                self.comm,
                f"{CKPT_NAME}-fresh",
                keep_bb=KEEP_BB,
                keep_pfs=1_000_000,
                config=dataclasses.replace(self.config, ckpt_recycle="off"),
            )
        if self.use_torch:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            port = self.comm.bcast(_free_port() if self.rank == 0 else None, root=0)
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=self.rank,
                world_size=self.size,
                timeout=datetime.timedelta(seconds=COMMIT_TIMEOUT),
            )
            self.torch_ready = True

    def stop(self) -> None:
        """Collective: close the checkpointer (its drains exit), gloo and the node split."""
        for ck in (self.ck, self.ck_fresh):
            if ck is not None:
                ck.close(wait=True, timeout=COMMIT_TIMEOUT)
        self.ck = self.ck_fresh = None
        if self.torch_ready:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.torch_ready = False
        self.topo.free()
        self.stopped = True

    def prepare(self) -> None:
        """Between systems: drop the page cache (rank 0) while the others sleep."""
        if self.rank == 0:
            self.drops.append(drop_caches(self.args.drop_caches))
        idle_barrier(self.comm)

    # -------------------------------------------------------------- systems

    def memcpy(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        targets = [np.empty_like(a) for a in state.values()]
        for target, array in zip(targets, state.values(), strict=True):
            np.copyto(target, array)  # fault the pages in before timing
        self.comm.Barrier()
        start = time.perf_counter()
        for target, array in zip(targets, state.values(), strict=True):
            np.copyto(target, array)
        return {"memcpy": _max(self.comm, time.perf_counter() - start)}

    def _node_file(self, path: Path, arrays: list[np.ndarray], offset: int) -> None:
        """bbio's layout: one file per node, each rank at its offset, the leader fsyncs.
        The leader creates the file if it is not there (else it is overwritten)."""
        node_comm = self.topo.node_comm
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if self.leader else -1
        node_comm.Barrier()
        if not self.leader:
            fd = os.open(path, os.O_WRONLY)
        try:
            write_arrays(fd, arrays, offset)
            node_comm.Barrier()
            if self.leader:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _bb_node_write(self, state: dict[str, np.ndarray], rewrite: bool) -> float:
        """Seconds of a raw write in bbio's layout into a new file, or (``rewrite``)
        into the file an untimed write just left."""
        arrays = list(state.values())
        mine = sum(a.nbytes for a in arrays)
        offset = self.topo.node_comm.exscan(mine) or 0  # None on the node's first rank
        path = self.node_bb / "raw" / f"node-{self.node:05d}.bin"
        if rewrite:
            self._node_file(path, arrays, offset)
        self.comm.Barrier()
        start = time.perf_counter()
        self._node_file(path, arrays, offset)
        seconds = _max(self.comm, time.perf_counter() - start)
        if self.leader:
            path.unlink()
        return seconds

    def bb_write(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        return {"bb-write": self._bb_node_write(state, rewrite=False)}

    def bb_rewrite(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        return {"bb-rewrite": self._bb_node_write(state, rewrite=True)}

    def bb_write_fpp(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        path = self.node_bb / "raw" / f"rank-{self.rank:05d}.bin"
        self.comm.Barrier()
        start = time.perf_counter()
        write_file(path, list(state.values()))
        seconds = _max(self.comm, time.perf_counter() - start)
        path.unlink()
        return {"bb-write-fpp": seconds}

    def pfs_write(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        path = self.pfs / "raw" / f"rank-{self.rank:05d}.bin"
        self.comm.Barrier()
        start = time.perf_counter()
        write_file(path, list(state.values()))
        seconds = _max(self.comm, time.perf_counter() - start)
        path.unlink()
        return {"pfs-write": seconds}

    def pfs_write_node(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        """One writer per node, as the drain: the leader writes the node's byte count."""
        arrays = list(state.values())
        node_bytes = self.topo.node_comm.allreduce(sum(a.nbytes for a in arrays))
        path = self.pfs / "raw" / f"node-{self.node:05d}.bin"
        self.comm.Barrier()
        start = time.perf_counter()
        if self.leader:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_bytes(fd, arrays, node_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)
        mine = time.perf_counter() - start
        idle_barrier(self.comm)
        seconds = _max(self.comm, mine)
        if self.leader:
            path.unlink()
        return {"pfs-write-node": seconds}

    def pfs_commit(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        """The floor of a drain, the bytes written from memory."""
        return {"pfs-commit": self._pfs_commit(state, from_bb=False)}

    def pfs_commit_bb(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        """The floor of a drain, the bytes copied from the burst buffer."""
        return {"pfs-commit-bb": self._pfs_commit(state, from_bb=True)}

    def _pfs_commit(self, state: dict[str, np.ndarray], from_bb: bool) -> float:
        """One file per node written under a temporary name (from memory, or copied from
        a node file in the burst buffer), read back during its fsync and renamed; then a
        view and a manifest written at once and renamed, the manifest last (rank 0)."""
        arrays = list(state.values())
        node_bytes = self.topo.node_comm.allreduce(sum(a.nbytes for a in arrays))
        step_dir = self.pfs / "raw" / "commit"
        node_file = step_dir / f"node-{self.node:05d}.h5"
        view, manifest = step_dir / "global.h5", step_dir / "manifest.json"
        source = self.node_bb / "raw" / f"node-{self.node:05d}.h5"
        if from_bb and self.leader:
            fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_bytes(fd, arrays, node_bytes)
            finally:
                os.close(fd)
        self.comm.Barrier()
        start = time.perf_counter()
        if self.leader:
            step_dir.mkdir(exist_ok=True)
            temp = files.temp_path(node_file)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if from_bb:
                    _copy_node_file(source, fd, temp)
                else:
                    write_bytes(fd, arrays, node_bytes)
                with ThreadPoolExecutor(1) as pool:
                    reading = pool.submit(files.checksum_file, temp)
                    os.fsync(fd)
                size, _ = reading.result()  # the CRC32C is computed for its cost
                if size != node_bytes:
                    raise UsageError(f"{temp} reads back {size} bytes, not {node_bytes}")
            finally:
                os.close(fd)
            os.rename(temp, node_file)
            _fsync_path(step_dir)
        idle_barrier(self.comm)  # every node's file is in place
        if self.rank == 0:
            with ThreadPoolExecutor(1) as pool:
                viewing = pool.submit(files.write_durably, files.temp_path(view), bytes(VIEW_BYTES))
                files.write_durably(files.temp_path(manifest), bytes(MANIFEST_BYTES))
                viewing.result()
            os.rename(files.temp_path(view), view)
            os.rename(files.temp_path(manifest), manifest)
            _fsync_path(step_dir)
        seconds = time.perf_counter() - start
        idle_barrier(self.comm)
        seconds = _max(self.comm, seconds)
        if self.rank == 0:
            _remove(step_dir)
        if from_bb and self.leader:
            source.unlink()
        return seconds

    def _h5py_write(self, comm, path: Path, state: dict[str, np.ndarray]) -> float:
        """Collective over ``comm``: the arrays into one HDF5 file (``mpio``), fsynced; seconds."""
        import h5py

        self.comm.Barrier()
        start = time.perf_counter()
        everyone = comm.allgather([(k, a.shape, a.dtype.str) for k, a in state.items()])
        ranks = comm.allgather(self.rank)
        with h5py.File(path, "w", driver="mpio", comm=comm) as f:
            for owner, spec in zip(ranks, everyone, strict=True):
                for key, shape, dtype in spec:
                    f.create_dataset(f"{key}/r{owner:05d}", shape=shape, dtype=dtype)
            for key, array in state.items():
                f[f"{key}/r{self.rank:05d}"][...] = array
        comm.Barrier()
        if comm.Get_rank() == 0:
            _fsync_path(path)
        seconds = _max(self.comm, time.perf_counter() - start)
        if comm.Get_rank() == 0:
            path.unlink()
        return seconds

    def h5py_sync(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        path = self.pfs / "h5py" / "checkpoint.h5"
        return {"h5py-sync": self._h5py_write(self.comm, path, state)}

    def h5py_bb(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        path = self.node_bb / "h5py" / f"node-{self.node:05d}.h5"
        return {"h5py-bb": self._h5py_write(self.topo.node_comm, path, state)}

    def _save(self, ck: Checkpointer, state: dict[str, np.ndarray]) -> tuple[float, float]:
        """Collective: one save by ``ck``; its blocking and committed seconds."""
        self.step += 1
        comm = self.comm
        comm.Barrier()
        start = time.perf_counter()
        handle = ck.save(self.step, state)
        blocking = time.perf_counter() - start
        handle.wait(COMMIT_TIMEOUT)
        committed = time.perf_counter() - start
        _into_the_burst_buffer(ck, handle)
        result = _max(comm, blocking), _max(comm, committed)
        self._settle(ck, [self.step])
        return result

    def bbio(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        assert self.ck is not None
        blocking, committed = self._save(self.ck, state)
        return {"bbio": blocking, "bbio-committed": committed}

    def bbio_fresh(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        assert self.ck_fresh is not None
        return {"bbio-fresh": self._save(self.ck_fresh, state)[0]}

    def bbio_stream(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        """Collective: ``--stream`` saves by ``bbio``'s checkpointer back to back, then
        waited for: seconds from the end of the first save to every one committed."""
        ck = self.ck
        assert ck is not None
        comm = self.comm
        steps = [self.step + 1 + i for i in range(self.args.stream)]
        self.step = steps[-1]
        comm.Barrier()
        start = time.perf_counter()
        handles = [ck.save(steps[0], state)]
        first = time.perf_counter() - start
        handles += [ck.save(step, state) for step in steps[1:]]
        for handle in handles:
            _into_the_burst_buffer(ck, handle)  # agreed: every rank raises alike
        for handle in handles:
            handle.wait(COMMIT_TIMEOUT)
        committed = time.perf_counter() - start
        seconds = _max(comm, committed) - _max(comm, first)
        self._settle(ck, steps)
        self._steady_state(state)  # the queued saves laid out files that are new to it
        return {"bbio-stream": seconds}

    def _steady_state(self, state: dict[str, np.ndarray]) -> None:
        """Collective, untimed: saves by ``bbio``'s checkpointer until each of the files
        its nodes take turns with (``KEEP_BB`` checkpoints and the spare) was rewritten
        once in the layout of ``state`` (and is mapped, on tmpfs), as in a run."""
        if self.ck is not None:
            for _ in range(KEEP_BB + 2):
                self._save(self.ck, state)

    def _settle(self, ck: Checkpointer, steps: list[int]) -> None:
        """Collective, untimed: wait until ``ck``'s drains are idle and have trimmed its
        burst buffers to ``KEEP_BB`` checkpoints (the older file is the spare, or gone),
        then delete ``steps`` on the PFS."""
        if self.leader:
            deadline = time.monotonic() + COMMIT_TIMEOUT
            while time.monotonic() < deadline and (
                drain.pending(ck.journal) or len(list(ck.bb_dir.glob("step-*"))) > KEEP_BB
            ):
                time.sleep(0.01)
        idle_barrier(self.comm)  # a trim needs the step committed: removed only after
        if self.rank == 0:
            for step in steps:
                _remove(ck.pfs_dir / layout.step_dirname(step))
        idle_barrier(self.comm)

    def dcp_async(self, state: dict[str, np.ndarray]) -> dict[str, float]:
        import torch
        import torch.distributed.checkpoint as dcp

        self.step += 1
        path = self.pfs / "dcp" / f"step-{self.step:08d}"
        if self.rank == 0:
            path.mkdir(parents=True)
        tensors = {f"rank{self.rank:05d}/{k}": torch.from_numpy(a) for k, a in state.items()}
        comm = self.comm
        comm.Barrier()
        start = time.perf_counter()
        future = dcp.async_save(tensors, checkpoint_id=str(path))
        blocking = time.perf_counter() - start
        getattr(future, "upload_completion", future).result()
        committed = time.perf_counter() - start
        result = {
            "dcp-async": _max(comm, blocking),
            "dcp-async-committed": _max(comm, committed),
        }
        idle_barrier(comm)
        if self.rank == 0:
            _remove(path)
        return result

    # -------------------------------------------------------------- running

    def runners(self) -> list[tuple[str, Callable[[dict[str, np.ndarray]], dict[str, float]]]]:
        table = {
            "memcpy": self.memcpy,
            "bb-write": self.bb_write,
            "bb-rewrite": self.bb_rewrite,
            "bb-write-fpp": self.bb_write_fpp,
            "bbio": self.bbio,
            "bbio-fresh": self.bbio_fresh,
            "bbio-stream": self.bbio_stream,
            "h5py-sync": self.h5py_sync,
            "h5py-bb": self.h5py_bb,
            "dcp-async": self.dcp_async,
            "pfs-write": self.pfs_write,
            "pfs-write-node": self.pfs_write_node,
            "pfs-commit": self.pfs_commit,
            "pfs-commit-bb": self.pfs_commit_bb,
        }
        chosen = [s for s in SYSTEMS if s in self.args.systems]
        if not self.use_torch:
            chosen = [s for s in chosen if s != "dcp-async"]
        return [(name, table[name]) for name in chosen]

    def round(self, state: dict[str, np.ndarray], repeat: int) -> dict[str, float]:
        """One measurement of every system, order rotated by ``repeat``."""
        runners = self.runners()
        k = repeat % len(runners)
        seconds: dict[str, float] = {}
        for _, measure in runners[k:] + runners[:k]:
            self.prepare()
            seconds.update(measure(state))
        return seconds

    def record(self, case: str, total_bytes: int, seconds: dict[str, float]) -> None:
        add = self.ctx.results.add
        for system in REPORTED:
            if system in seconds:
                add(case, system, "seconds", "s", seconds[system])
        if "bbio" in seconds:
            drain_seconds = seconds["bbio-committed"] - seconds["bbio"]
            add(case, "bbio-drain", "GB_per_s", "GB/s", gb_per_s(total_bytes, drain_seconds))
        if "bbio-stream" in seconds:
            streamed = total_bytes * self.args.stream
            add(
                case,
                "bbio-drain-stream",
                "GB_per_s",
                "GB/s",
                gb_per_s(streamed, seconds["bbio-stream"]),
            )
        for system in ("pfs-write", "pfs-write-node", "pfs-commit", "pfs-commit-bb"):
            if system in seconds:
                add(case, system, "GB_per_s", "GB/s", gb_per_s(total_bytes, seconds[system]))

    def warm_up(self) -> None:
        self.ctx.log(f"warm-up: one untimed round at {size_label(WARMUP_SIZE)} per rank")
        self.round(make_state(self.rank, WARMUP_SIZE, self.args.arrays), 0)

    def run_size(self, nbytes: int, repeats: int) -> None:
        case = size_label(nbytes)
        state = make_state(self.rank, nbytes, self.args.arrays)
        total = nbytes * self.size
        self.ctx.log(f"{case} per rank ({size_label(total)} in all): {repeats} repetitions")
        self.round(state, 0)  # untimed: the steady state
        self._steady_state(state)
        for repeat in range(repeats):
            seconds = self.round(state, repeat)
            self.record(case, total, seconds)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in seconds.items())
            self.ctx.log(f"{case} #{repeat + 1}: {shown} s")


@suite(
    "checkpoint",
    "checkpoint save: bbio (blocking, committed) vs h5py, torch DCP async_save, raw limits",
    _arguments,
)
def run(ctx: BenchContext) -> None:
    """Warm up, then measure every size; rank 0 records the setting in the JSON."""
    comm, args = ctx.comm, ctx.args
    sizes = args.sizes or list(QUICK_SIZES if ctx.quick else FULL_SIZES)
    repeats = args.repeats or (2 if ctx.quick else 5)
    if comm.Get_size() % RANKS_PER_NODE:
        raise UsageError(f"the checkpoint suite needs a multiple of {RANKS_PER_NODE} ranks")
    use_torch, torch_note = _torch_status(comm, "dcp-async" in args.systems)
    if not use_torch:
        ctx.log(f"dcp-async and dcp-async-committed are skipped: {torch_note}")
    paths = None
    if ctx.rank == 0:
        pfs_base = Path(args.pfs or tempfile.gettempdir())
        pfs_base.mkdir(parents=True, exist_ok=True)
        Path(args.bb).mkdir(parents=True, exist_ok=True)
        pfs = tempfile.mkdtemp(prefix="bbio-bench-checkpoint-", dir=pfs_base)
        bb = tempfile.mkdtemp(prefix="bbio-bench-checkpoint-", dir=args.bb)
        paths = (pfs, bb)
    pfs, bb = (Path(p) for p in comm.bcast(paths, root=0))
    ctx.log(
        f"checkpoint suite: {comm.Get_size()} ranks in nodes of {RANKS_PER_NODE}; "
        f"PFS {pfs} ({fs_type(pfs)}), burst buffers {bb} ({fs_type(bb)}); "
        f"sizes {', '.join(size_label(s) for s in sizes)} per rank; {repeats} repetitions"
    )
    runner = CheckpointBench(ctx, pfs, bb, use_torch)
    ctx.nodes = runner.nodes
    try:
        runner.start()
        runner.warm_up()
        for nbytes in sizes:
            runner.run_size(nbytes, repeats)
        runner.stop()
    finally:
        # Not collective: after a failure the harness aborts every rank (the drains
        # then exit too: their parent is gone, their journal removed).
        if runner.stopped:
            idle_barrier(comm)
        if ctx.rank == 0:
            shutil.rmtree(pfs, ignore_errors=True)
            shutil.rmtree(bb, ignore_errors=True)
    if ctx.rank == 0:
        bench.record_machine(
            ctx,
            "checkpoint",
            {
                "pfs": str(pfs),
                "pfs_fstype": fs_type(pfs),
                "bb": str(bb),
                "bb_fstype": fs_type(bb),
                "ranks_per_node": RANKS_PER_NODE,
                "sizes_per_rank": sizes,
                "arrays_per_rank": args.arrays,
                "repeats": repeats,
                "stream_saves": args.stream,
                "systems": [s for s in SYSTEMS if s in args.systems],
                "torch": torch_note if use_torch else None,
                "dcp_skipped": None if use_torch else torch_note,
                "warmup_size_per_rank": WARMUP_SIZE,
            },
            drops=runner.drops,
            drop_requested=bool(args.drop_caches),
        )
