"""Suite ``stage``: stage-in from a PFS into a burst buffer, against cp, rsync and tar.

``mpirun -n 4 --bind-to none python -m bbio.bench stage [--quick] [--json FILE]
[--pfs DIR] [--bb DIR] [sizes...]``

Cases (metric ``GB_per_s``, the case's dataset bytes over the wall time of one
system's run, caches dropped first):

* ``small-files``: 20,000 files of 100 KiB (``--quick``: 1,000), 1,000 per
  directory.
* ``large-files``: 4 files of 1 GiB (``--quick``: 4 of 64 MiB).
* ``packed``: the small-file tree after ``bbio pack`` (256 MiB shards;
  ``--quick``: 32 MiB).  ``bbio-2``/``bbio-4`` stage the packed directory, the
  ``raw-*`` limits read and write the packed files, while ``cp``, ``rsync`` and
  ``tar`` copy the *unpacked* tree.  GB/s uses the bytes of the unpacked tree
  for every system, so ratios are time ratios.

Systems, in this order in every case and repetition: ``raw-read`` (rank 0
reads every source file once, in path order, 1 MiB reads: one stream),
``raw-write`` (rank 0 writes the same bytes as the same directories and files
into the burst buffer, 1 MiB writes, fsync of every file and directory),
``cp`` (``cp -a``), ``rsync`` (``rsync -a``), ``tar`` (``tar -cf - | tar -xf -``),
all subprocesses of rank 0 while the other ranks sleep (a tool that is not
installed is skipped, logged and listed in ``machine.stage.skipped_baselines``);
then ``bbio-2`` (the first 2 ranks, a sub-communicator; the others sleep) and
``bbio-4`` (4 ranks), both ``stage_in`` into ONE destination (one node:
``ranks_per_node`` = communicator size, mode replicate), timed as a barrier,
the call (walk, capacity check, copy, commit with fsync, manifest) and the
maximum over the ranks.  Fewer than 4 ranks: ``bbio-4`` is skipped (logged).
Ranks that wait sleep in a polled non-blocking barrier, so that they do not
take CPU from the ranks that work.

Replicate (metric ``pfs_bytes_read``, bytes): ``bbio-replicate`` stages the
tree to 2 virtual nodes (4 ranks, ``ranks_per_node=2``); ``naive-per-node``
has each node's leader copy the whole tree itself with a Python read/write
loop.  Both are measured as the sum over ranks of the increase of ``rchar`` in
``/proc/self/io`` (``IoCounters``, its own reads excluded: bytes returned by read
system calls, counted by the kernel,
whether or not the page cache served them: on real nodes each would go to
the PFS).  The bbio count is checked against ``StageSummary.source_bytes_read``
(``machine.stage.replicate_check`` in the JSON).  Done for small and large files.

Trees are generated once per run into ``--pfs`` (default: a temporary
directory on local disk, removed at the end), in ``PFS/bbio-bench-stage/``.
Next to each tree a marker file (``.small-files.json`` ...) holds the sizes it
was made with; a later run with the same sizes reuses the tree instead of
writing it again (minutes on GlusterFS), and a run with other sizes replaces
it.  Trees under an explicit ``--pfs`` are kept for that reuse unless
``--clean`` is given.  The packed tree is made (untimed) by ``bbio pack``.
Destination copies go to a fresh directory under ``--bb`` (default
``/dev/shm``, tmpfs, like a node-local burst buffer), removed between systems
and at the end.

Caches: before every system, rank 0 runs ``sync`` and ``echo 1 >
/proc/sys/vm/drop_caches`` (needs root; ``--no-drop-caches`` skips it).  The
JSON's ``machine`` says whether every drop succeeded (``caches_dropped``), and
``machine.stage`` holds the sizes, paths, file system types and repetitions.
One repetition per system is the default (``--repeats``): a full run on
GlusterFS takes about half an hour.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import bbio.bench as bench
from bbio.bench import (
    BenchContext,
    GiB,
    IoCounters,
    KiB,
    MiB,
    at_least,
    byte_size,
    drop_caches,
    fs_type,
    gb_per_s,
    idle_barrier,
    suite,
)
from bbio.config import Config, load_config
from bbio.report import format_bytes
from bbio.stage.pack import pack
from bbio.stage.run import stage_in

FULL = {
    "small_files": 20_000,
    "small_size": 100 * KiB,
    "large_files": 4,
    "large_size": GiB,
    "shard_size": 256 * MiB,
}
QUICK = {**FULL, "small_files": 1_000, "large_size": 64 * MiB, "shard_size": 32 * MiB}
FILES_PER_DIR = 1000
TREE_FORMAT = "bbio-bench-stage/1"
TREES_DIR = "bbio-bench-stage"
CASES = ("small-files", "large-files", "packed")
BASELINES = ("cp", "rsync", "tar")
BBIO_RANKS = (2, 4)
REPLICATE_NODES = 2
_WRITE_POOL = 1 * MiB
_SMALL_POOL = 16 * MiB


COUNT = at_least(1)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pfs",
        metavar="DIR",
        help="where to generate the source trees (default: a temporary directory on local disk)",
    )
    parser.add_argument(
        "--bb",
        metavar="DIR",
        default="/dev/shm",
        help="destination burst buffer; a fresh subdirectory is used (default: /dev/shm)",
    )
    parser.add_argument("--small-files", type=COUNT, metavar="N", help="files of the small tree")
    parser.add_argument("--small-size", type=byte_size, metavar="BYTES", help="each small file")
    parser.add_argument("--large-files", type=COUNT, metavar="N", help="files of the large tree")
    parser.add_argument("--large-size", type=byte_size, metavar="BYTES", help="each large file")
    parser.add_argument("--shard-size", type=byte_size, metavar="BYTES", help="bbio pack shards")
    parser.add_argument("--repeats", type=COUNT, default=1, help="repetitions (default 1)")
    parser.add_argument(
        "--stage-files-in-flight",
        type=COUNT,
        help="files bbio copies at once per node (default: BBIO_STAGE_FILES_IN_FLIGHT, else 32)",
    )
    parser.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="do not drop the page cache before each system (default: drop it, as root)",
    )
    parser.add_argument(
        "--clean", action="store_true", help="remove the generated trees at the end, even in --pfs"
    )


# ------------------------------------------------------------------ helpers


def list_tree(root: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Directories and (file, size) under ``root``, relative, in path order; skips ``.bbio``."""
    dirs, found = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == ".":
            dirnames[:] = [d for d in dirnames if d != ".bbio"]
        dirnames.sort()
        if rel != ".":
            dirs.append(rel)
        for name in filenames:
            path = name if rel == "." else f"{rel}/{name}"
            found.append((path, os.lstat(os.path.join(dirpath, name)).st_size))
    found.sort()
    return sorted(dirs), found


def _small_pool() -> np.ndarray:
    rng = np.random.default_rng(20_000)
    return rng.integers(0, 2**64 - 1, _SMALL_POOL // 8, dtype=np.uint64, endpoint=True).view(
        np.uint8
    )


def _write_small(path: Path, index: int, size: int, pool: np.ndarray) -> None:
    start = (index * 40_961) % max(1, pool.size - size)
    data = bytearray(pool[start : start + size].tobytes())
    stamp = index.to_bytes(8, "little")[: len(data)]
    data[: len(stamp)] = stamp
    with open(path, "wb", buffering=0) as f:
        f.write(data)


def _write_large(path: Path, index: int, size: int) -> None:
    rng = np.random.default_rng(1_000 + index)
    with open(path, "wb", buffering=0) as f:
        left = size
        while left:
            n = min(left, 64 * MiB)
            words = rng.integers(0, 2**64 - 1, (n + 7) // 8, dtype=np.uint64, endpoint=True)
            f.write(memoryview(words.view(np.uint8)[:n]))
            left -= n


def _small_path(index: int) -> str:
    return f"d{index // FILES_PER_DIR:03d}/f{index:06d}.bin"


# ------------------------------------------------------------------ the trees


class Trees:
    """The source trees in the PFS: generated once, reused when their marker matches."""

    def __init__(self, ctx: BenchContext, root: Path, sizes: dict[str, int]) -> None:
        self.ctx, self.root, self.sizes = ctx, root, sizes
        self.status: dict[str, str] = {}
        self.markers: dict[str, dict] = {}

    def path(self, name: str) -> Path:
        return self.root / name

    def _marker(self, name: str) -> Path:
        return self.root / f".{name}.json"

    def _reusable(self, name: str, spec: dict) -> bool:
        """Collective: whether ``name`` exists with a marker describing ``spec``."""
        ok = None
        if self.ctx.rank == 0:
            try:
                old = json.loads(self._marker(name).read_text())
            except (OSError, ValueError):
                old = None
            ok = bool(old and old.get("spec") == spec and self.path(name).is_dir())
            if not ok:
                old = None
                self._marker(name).unlink(missing_ok=True)
                shutil.rmtree(self.path(name), ignore_errors=True)
        old = self.ctx.comm.bcast(old if self.ctx.rank == 0 else None, root=0)
        if old is not None:
            self.markers[name] = old
        return old is not None

    def _done(self, name: str, spec: dict, started: float) -> None:
        idle_barrier(self.ctx.comm)
        if self.ctx.rank == 0:
            os.sync()
            marker = {
                "spec": spec,
                "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.monotonic() - started, 2),
            }
            self._marker(name).write_text(json.dumps(marker, indent=1) + "\n")
            self.markers[name] = marker
            self.ctx.log(f"{name}: generated in {marker['seconds']:.1f} s")
        self.markers[name] = self.ctx.comm.bcast(self.markers.get(name), root=0)

    def _generate(self, name: str, spec: dict, write_mine: Callable[[Path], None]) -> None:
        if self._reusable(name, spec):
            self.status[name] = "reused"
            self.ctx.log(f"{name}: reusing {self.path(name)} (marker matches)")
            return
        self.status[name] = "generated"
        self.ctx.log(f"{name}: generating {self.path(name)}")
        started = time.monotonic()
        write_mine(self.path(name))
        self._done(name, spec, started)

    def generate_all(self) -> None:
        """Collective: make (or reuse) small-files, large-files and packed."""
        comm, rank, size = self.ctx.comm, self.ctx.rank, self.ctx.comm.Get_size()
        s = self.sizes
        small_spec = {"format": TREE_FORMAT, "files": s["small_files"], "size": s["small_size"]}
        large_spec = {"format": TREE_FORMAT, "files": s["large_files"], "size": s["large_size"]}

        def write_small(root: Path) -> None:
            if rank == 0:
                for d in range((s["small_files"] + FILES_PER_DIR - 1) // FILES_PER_DIR):
                    (root / f"d{d:03d}").mkdir(parents=True, exist_ok=True)
            idle_barrier(comm)
            pool = _small_pool()
            for index in range(rank, s["small_files"], size):
                _write_small(root / _small_path(index), index, s["small_size"], pool)

        def write_large(root: Path) -> None:
            if rank == 0:
                root.mkdir(parents=True, exist_ok=True)
            idle_barrier(comm)
            for index in range(rank, s["large_files"], size):
                _write_large(root / f"f{index:02d}.bin", index, s["large_size"])

        def write_packed(root: Path) -> None:
            config = Config(progress="never")
            pack(comm, self.path("small-files"), root, shard_size=s["shard_size"], config=config)

        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        comm.Barrier()
        self._generate("small-files", small_spec, write_small)
        self._generate("large-files", large_spec, write_large)
        packed_spec = {
            "format": TREE_FORMAT,
            "shard_size": s["shard_size"],
            "source": self.markers["small-files"],
        }
        self._generate("packed", packed_spec, write_packed)


# ------------------------------------------------------------------ systems


def raw_read(root: Path, listing: list[tuple[str, int]]) -> int:
    """Read every file once, in order, 1 MiB at a time; the bytes read."""
    view = memoryview(bytearray(MiB))
    total = 0
    for rel, _ in listing:
        fd = os.open(root / rel, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total


def raw_write(dst: Path, dirs: list[str], listing: list[tuple[str, int]], pool: bytes) -> None:
    """Write the layout of ``listing`` under ``dst``: 1 MiB writes, fsync every file and dir."""
    view = memoryview(pool)
    dst.mkdir(parents=True)
    for d in dirs:
        (dst / d).mkdir(parents=True, exist_ok=True)
    for rel, size in listing:
        fd = os.open(dst / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = size
            while left:
                left -= os.write(fd, view[: min(left, len(view))])
            os.fsync(fd)
        finally:
            os.close(fd)
    for d in [*reversed(dirs), "."]:
        fd = os.open(dst / d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run_baseline(system: str, src: Path, dst: Path) -> None:
    """One baseline copy of the tree ``src`` to the new directory ``dst``."""
    if system == "cp":
        subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    elif system == "rsync":
        subprocess.run(["rsync", "-a", f"{src}/", f"{dst}/"], check=True)
    elif system == "tar":
        dst.mkdir()
        reader = subprocess.Popen(["tar", "-C", str(src), "-cf", "-", "."], stdout=subprocess.PIPE)
        try:
            writer = subprocess.run(["tar", "-C", str(dst), "-xf", "-"], stdin=reader.stdout)
        finally:
            assert reader.stdout is not None
            reader.stdout.close()
            reader.wait()
        if reader.returncode or writer.returncode:
            raise subprocess.CalledProcessError(
                reader.returncode or writer.returncode, f"tar -C {src} -cf - . | tar -C {dst} -xf -"
            )
    else:
        raise ValueError(system)


def naive_copy(src: Path, dst: Path) -> None:
    """What a node does without bbio: a plain Python copy of the whole tree."""
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        target = dst / os.path.relpath(dirpath, src)
        target.mkdir(parents=True, exist_ok=True)
        for name in sorted(filenames):
            with open(os.path.join(dirpath, name), "rb") as fin, open(target / name, "wb") as fout:
                while chunk := fin.read(MiB):
                    fout.write(chunk)


def check_copy(dst: Path, listing: list[tuple[str, int]], what: str) -> None:
    """The destination holds the files of ``listing`` with their sizes (else AssertionError)."""
    _, found = list_tree(dst)
    if found != listing:
        missing = sorted(set(listing) - set(found))[:5]
        extra = sorted(set(found) - set(listing))[:5]
        raise AssertionError(
            f"{what}: {dst} holds {len(found)} files, expected {len(listing)} "
            f"(missing or different: {missing}; unexpected: {extra})"
        )


# ------------------------------------------------------------------ the run


class StageBench:
    """State of one suite run (the same object on every rank)."""

    def __init__(self, ctx: BenchContext, trees: Trees, work: Path, sizes: dict[str, int]):
        from mpi4py import MPI

        self.ctx, self.trees, self.work, self.sizes = ctx, trees, work, sizes
        self.comm = ctx.comm
        self.rank, self.size = ctx.rank, ctx.comm.Get_size()
        self.dst = work / "dst"
        self.subs = {}
        for k in BBIO_RANKS:
            if k <= self.size:
                sub = self.comm.Split(0 if self.rank < k else MPI.UNDEFINED, self.rank)
                self.subs[k] = None if sub == MPI.COMM_NULL else sub
        self.in_flight = ctx.args.stage_files_in_flight or load_config().stage_files_in_flight
        self.drops: list[bool] = []
        self.replicate_check: dict[str, dict[str, int]] = {}
        listings = None
        if self.rank == 0:
            listings = {name: list_tree(trees.path(name)) for name in CASES}
        self.listings: dict[str, tuple[list[str], list[tuple[str, int]]]] = self.comm.bcast(
            listings, root=0
        )
        self.pool = np.random.default_rng(7).bytes(_WRITE_POOL)
        self.counters = IoCounters()  # this process's read syscalls and bytes
        # a baseline whose tool is not installed is skipped (logged, listed in the JSON)
        self.baselines = [name for name in BASELINES if shutil.which(name)]
        self.missing = [name for name in BASELINES if name not in self.baselines]
        for name in self.missing:
            ctx.log(f"{name} is not installed: the {name} baseline is skipped")

    def free(self) -> None:
        self.counters.close()
        for sub in self.subs.values():
            if sub is not None:
                sub.Free()

    def config(self, ranks_per_node: int) -> Config:
        return Config(
            ranks_per_node=ranks_per_node,
            progress="never",
            bb_root=str(self.work / "bb-{node}"),
            stage_files_in_flight=self.in_flight,
        )

    def prepare(self) -> None:
        """Collective: remove the destinations, drop caches, then start together."""
        if self.rank == 0:
            for child in self.work.iterdir():
                shutil.rmtree(child)
            self.drops.append(drop_caches(self.ctx.args.drop_caches))
        idle_barrier(self.comm)

    def on_rank0(self, fn: Callable[[], object]) -> float | None:
        """Collective: time ``fn`` on rank 0 while the other ranks sleep."""
        seconds = None
        if self.rank == 0:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        idle_barrier(self.comm)
        return seconds

    def bbio(self, k: int, src: Path, listing: list[tuple[str, int]]) -> float | None:
        """Collective: stage ``src`` with the first ``k`` ranks as one node; max seconds."""
        from mpi4py import MPI

        sub = self.subs[k]
        seconds = None
        if sub is not None:
            sub.Barrier()
            start = time.perf_counter()
            summary = stage_in(sub, src, self.dst, mode="replicate", config=self.config(k))
            seconds = sub.allreduce(time.perf_counter() - start, op=MPI.MAX)
            expected = sum(size for _, size in listing)
            if (summary.bytes_written, summary.files, summary.nodes) != (expected, len(listing), 1):
                raise AssertionError(
                    f"bbio-{k} staged {summary.files} files, {summary.bytes_written} bytes on "
                    f"{summary.nodes} node(s); expected {len(listing)} files, {expected} bytes"
                )
        idle_barrier(self.comm)
        return seconds

    def run_case(self, case: str) -> None:
        """Collective: every system on one case, in the documented order."""
        source = "small-files" if case == "packed" else case
        src = self.trees.path(case)
        unpacked = self.trees.path(source)
        nbytes = sum(size for _, size in self.listings[source][1])
        dirs, listing = self.listings[case]
        _, unpacked_listing = self.listings[source]
        systems: list[tuple[str, Callable[[], float | None]]] = [
            ("raw-read", lambda: self.on_rank0(lambda: raw_read(src, listing))),
            (
                "raw-write",
                lambda: self.on_rank0(lambda: raw_write(self.dst, dirs, listing, self.pool)),
            ),
        ]
        for name in self.baselines:
            systems.append(
                (
                    name,
                    lambda name=name: self.on_rank0(lambda: run_baseline(name, unpacked, self.dst)),
                )
            )
        for k in BBIO_RANKS:
            if k in self.subs:
                systems.append((f"bbio-{k}", lambda k=k: self.bbio(k, src, listing)))
        for repeat in range(self.ctx.args.repeats):
            for system, measure in systems:
                self.prepare()
                seconds = measure()
                if self.rank != 0:
                    continue
                if system != "raw-read":
                    check_copy(
                        self.dst,
                        unpacked_listing if system in BASELINES else listing,
                        f"{case} {system}",
                    )
                assert seconds is not None
                value = gb_per_s(nbytes, seconds)
                self.ctx.results.add(case, system, "GB_per_s", "GB/s", value)
                self.ctx.log(
                    f"{case} [{repeat + 1}/{self.ctx.args.repeats}] {system}: "
                    f"{seconds:.2f} s, {value:.3f} GB/s"
                )

    def replicate(self, case: str) -> None:
        """Collective: bytes read from the PFS by bbio replicate vs a naive per-node copy."""
        k = 4 if self.size >= 4 else 2
        sub = self.subs[k]
        ranks_per_node = k // REPLICATE_NODES
        src = self.trees.path(case)
        nbytes = sum(size for _, size in self.listings[case][1])
        # bbio replicate: every rank of the sub-communicator reads its share
        self.prepare()
        delta, summary = 0, None
        if sub is not None:
            config = self.config(ranks_per_node)
            sub.Barrier()
            before = self.counters.snapshot()
            summary = stage_in(sub, src, self.work / "bb-{node}", mode="replicate", config=config)
            delta = self.counters.delta(before, self.counters.snapshot())[1]
            if (
                summary.nodes != REPLICATE_NODES
                or summary.bytes_written != REPLICATE_NODES * nbytes
            ):
                raise AssertionError(f"replicate {case}: unexpected summary {summary}")
        idle_barrier(self.comm)
        deltas = self.comm.gather(delta, root=0)
        if self.rank == 0:
            for node in range(REPLICATE_NODES):
                check_copy(self.work / f"bb-{node}", self.listings[case][1], f"replicate {case}")
        # naive: each node's leader copies the whole tree with Python
        self.prepare()
        naive = 0
        if sub is not None and sub.Get_rank() % ranks_per_node == 0:
            node = sub.Get_rank() // ranks_per_node
            before = self.counters.snapshot()
            naive_copy(src, self.work / f"naive-{node}")
            naive = self.counters.delta(before, self.counters.snapshot())[1]
        idle_barrier(self.comm)
        naives = self.comm.gather(naive, root=0)
        if self.rank != 0:
            return
        assert summary is not None  # rank 0 is in every sub-communicator
        for node in range(REPLICATE_NODES):
            check_copy(self.work / f"naive-{node}", self.listings[case][1], f"naive {case}")
        if min(deltas) < 0 or min(naives) < 0:
            self.ctx.log(f"replicate {case}: /proc/self/io is unreadable; not recorded")
            return
        read_bbio, read_naive = sum(deltas), sum(naives)
        self.ctx.results.add(case, "bbio-replicate", "pfs_bytes_read", "bytes", read_bbio)
        self.ctx.results.add(case, "naive-per-node", "pfs_bytes_read", "bytes", read_naive)
        self.replicate_check[case] = {
            "dataset_bytes": nbytes,
            "rchar_bbio": read_bbio,
            "source_bytes_read_bbio": summary.source_bytes_read,
            "rchar_naive": read_naive,
        }
        close = abs(read_bbio - summary.source_bytes_read) <= 0.05 * max(1, nbytes)
        self.ctx.log(
            f"replicate {case}: bbio read {format_bytes(read_bbio)} "
            f"({read_bbio / nbytes:.3f} x the dataset; bbio counted "
            f"{format_bytes(summary.source_bytes_read)}: {'agrees' if close else 'DIFFERS'}), "
            f"naive {format_bytes(read_naive)} ({read_naive / nbytes:.3f} x)"
        )


def _sizes(args: argparse.Namespace, quick: bool) -> dict[str, int]:
    sizes = dict(QUICK if quick else FULL)
    for name in sizes:
        if getattr(args, name, None) is not None:
            sizes[name] = getattr(args, name)
    return sizes


@suite("stage", "stage-in PFS -> burst buffer: bbio vs cp, rsync, tar and raw limits", _arguments)
def run(ctx: BenchContext) -> None:
    """Generate (or reuse) the trees, then measure every case and the replicate reads."""
    comm, args = ctx.comm, ctx.args
    sizes = _sizes(args, ctx.quick)
    temporary_pfs = args.pfs is None
    paths = None
    if ctx.rank == 0:
        pfs = Path(tempfile.mkdtemp(prefix="bbio-bench-stage-pfs-")) if temporary_pfs else None
        pfs = pfs or Path(args.pfs)
        Path(args.bb).mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="bbio-bench-stage-", dir=args.bb))
        paths = (str(pfs), str(work))
    pfs_text, work_text = comm.bcast(paths, root=0)
    pfs, work = Path(pfs_text), Path(work_text)
    trees = Trees(ctx, pfs / TREES_DIR, sizes)
    bench_run = None
    try:
        ctx.log(
            f"stage suite: {comm.Get_size()} ranks; PFS {pfs} ({fs_type(pfs)}), "
            f"burst buffer {work} ({fs_type(work)}); small {sizes['small_files']} x "
            f"{format_bytes(sizes['small_size'])}, large {sizes['large_files']} x "
            f"{format_bytes(sizes['large_size'])}, shards {format_bytes(sizes['shard_size'])}"
        )
        for k in BBIO_RANKS:
            if k > comm.Get_size():
                ctx.log(f"only {comm.Get_size()} rank(s): bbio-{k} is skipped")
        trees.generate_all()
        bench_run = StageBench(ctx, trees, work, sizes)
        for case in CASES:
            bench_run.run_case(case)
        if comm.Get_size() >= REPLICATE_NODES:
            for case in ("small-files", "large-files"):
                bench_run.replicate(case)
        else:
            ctx.log("one rank: the replicate comparison (2 virtual nodes) is skipped")
        if ctx.rank == 0:
            bench.record_machine(
                ctx,
                "stage",
                {
                    "pfs": str(pfs),
                    "pfs_fstype": fs_type(pfs),
                    "bb": str(work),
                    "bb_fstype": fs_type(work),
                    "sizes": sizes,
                    "files_per_dir": FILES_PER_DIR,
                    "repeats": args.repeats,
                    "stage_files_in_flight": bench_run.in_flight,
                    "skipped_baselines": bench_run.missing,
                    "trees": trees.status,
                    "replicate_check": bench_run.replicate_check,
                },
                drops=bench_run.drops,
                drop_requested=bool(args.drop_caches),
            )
        bench_run.free()
        comm.Barrier()
    finally:
        if ctx.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
            if temporary_pfs:
                shutil.rmtree(pfs, ignore_errors=True)
            elif args.clean:
                shutil.rmtree(trees.root, ignore_errors=True)
