"""Suite ``copy``: the native copy and CRC32C against their baselines, hot page cache.

Copies (metric ``GB_per_s``): ``bbio`` is the native copy with CRC32C in the
same pass (what staging and the drain do), with as many CPUs as the process
may use; ``bbio-1cpu`` is the same with the thread pinned to one CPU (a rank
bound to one core: no reader thread).  Baselines: ``shutil`` (copyfile,
sendfile), ``cp`` and ``memcpy`` of the same bytes in memory (the physical
limit).  Run it unbound (``mpirun --bind-to none``) to let ``bbio`` use its
reader thread.  Checksums: ``bbio`` (hardware path), ``bbio-sw`` (table fallback),
the ``crc32c`` package and ``zlib`` (CRC-32, not the same polynomial).
Rank 0 measures; other ranks wait.  Dirty pages are synced (untimed) before
each copy.  Systems alternate within each repetition
so that drift in the machine's speed hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bbio import _native
from bbio.bench import BenchContext, GiB, KiB, MiB, gb_per_s, suite, timed
from bbio.report import format_bytes


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", help="directory for the test files (default: the system temp directory)"
    )


def size_label(nbytes: int) -> str:
    """4096 -> '4KiB', 1 << 30 -> '1GiB'."""
    for unit, factor in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


def _write_random(path: Path, nbytes: int) -> None:
    rng = np.random.default_rng(nbytes)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            chunk = min(left, 64 * MiB)
            f.write(rng.integers(0, 256, chunk, dtype=np.uint8).tobytes())
            left -= chunk


def _on_one_cpu(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with this thread pinned to one CPU, as a rank bound to one core is."""

    def pinned() -> object:
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})
        try:
            return fn()
        finally:
            os.sched_setaffinity(0, allowed)

    return pinned


def _copiers(src: Path, dst: Path) -> dict[str, Callable[[], object]]:
    def bbio_copy() -> object:
        return _native.copy_file(src, dst, checksum=True)

    return {
        "bbio": bbio_copy,
        "bbio-1cpu": _on_one_cpu(bbio_copy),
        "shutil": lambda: shutil.copyfile(src, dst),
        "cp": lambda: subprocess.run(["cp", str(src), str(dst)], check=True),
    }


def _bench_memcpy(ctx: BenchContext, case: str, nbytes: int, repeats: int) -> None:
    src_mem = np.ones(nbytes, dtype=np.uint8)
    dst_mem = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst_mem, src_mem)  # fault the pages in before timing
    for _ in range(repeats):
        ctx.results.add(
            case,
            "memcpy",
            "GB_per_s",
            "GB/s",
            gb_per_s(nbytes, timed(lambda: np.copyto(dst_mem, src_mem))),
        )


def _bench_copies(ctx: BenchContext, workdir: Path) -> None:
    sizes = [4 * KiB, MiB, 256 * MiB] if ctx.quick else [4 * KiB, MiB, 64 * MiB, GiB]
    for nbytes in sizes:
        case = f"copy-{size_label(nbytes)}"
        repeats = 20 if nbytes <= MiB else (3 if ctx.quick else 11)
        src, dst = workdir / "src.bin", workdir / "dst.bin"
        _write_random(src, nbytes)
        ctx.log(f"{case}: {repeats} repetitions of bbio, bbio-1cpu, shutil, cp, then memcpy")
        copiers = list(_copiers(src, dst).items())
        n = len(copiers)
        for repeat in range(repeats):
            # Rotate the order so that no system always follows the same one
            # (the file system's background work after a delete hits the next copy).
            for system, copy in copiers[repeat % n :] + copiers[: repeat % n]:
                dst.unlink(missing_ok=True)
                os.sync()  # no write-back of the previous copy during this one
                ctx.results.add(case, system, "GB_per_s", "GB/s", gb_per_s(nbytes, timed(copy)))
        _bench_memcpy(ctx, case, nbytes, repeats)
        if _native.copy_file(src, dst).crc32c != _native.crc32c(np.fromfile(src, np.uint8)):
            raise AssertionError(f"{case}: the copy's CRC32C differs from the source's")
        src.unlink()
        dst.unlink()


def _bench_checksums(ctx: BenchContext) -> None:
    import crc32c as crc32c_package

    nbytes = 256 * MiB if ctx.quick else GiB
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    ctx.log(f"crc32c: {format_bytes(nbytes)} buffer, bbio, bbio-sw, crc32c, zlib")
    checksums = {
        "bbio": lambda: _native.crc32c(data),
        "bbio-sw": lambda: _native.crc32c(data, impl="sw"),
        "crc32c": lambda: crc32c_package.crc32c(data),
        "zlib": lambda: zlib.crc32(data),
    }
    if checksums["bbio"]() != checksums["crc32c"]():
        raise AssertionError("bbio's CRC32C differs from the crc32c package")
    for _ in range(3 if ctx.quick else 5):
        for system, checksum in checksums.items():
            ctx.results.add("crc32c", system, "GB_per_s", "GB/s", gb_per_s(nbytes, timed(checksum)))


@suite("copy", "native copy and CRC32C against shutil, cp, crc32c, zlib and memcpy", _arguments)
def run(ctx: BenchContext) -> None:
    """Measure on rank 0; the other ranks wait at the harness's barrier."""
    if ctx.rank != 0:
        return
    base = ctx.args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bbio-bench-copy-", dir=base))
    ctx.log(f"copy suite in {workdir} ({os.statvfs(workdir).f_bsize}-byte blocks)")
    try:
        _bench_copies(ctx, workdir)
        _bench_checksums(ctx)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
