"""Node files rewritten through kept mappings (bbio.checkpoint.mapped), without MPI:
real tmpfs files (``/dev/shm``, and small tmpfs mounts as root), real mappings."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bbio import _native
from bbio.checkpoint.mapped import NodeFileMappings
from bbio.errors import UsageError

MiB = 1 << 20
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory on the tmpfs ``/dev/shm``."""
    directory = Path("/dev/shm") / f"bbio-test-{uuid.uuid4().hex}"
    directory.mkdir()
    try:
        yield directory
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=True)


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def written_file(path: Path, nbytes: int) -> int:
    """Create ``path`` with ``nbytes`` written bytes (as a drained node file has); its
    descriptor, open read-write."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.pwrite(fd, bytes(nbytes), 0)
    return fd


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


def test_a_mapping_writes_the_bytes_and_their_crc_and_is_kept_for_the_same_file(shm):
    mappings = NodeFileMappings(limit=4)
    fd = written_file(shm / "node.h5", 4 * MiB)
    data = np.random.default_rng(1).integers(0, 256, 1 * MiB + 17, dtype=np.uint8)
    try:
        mapping = mappings.mapping(fd, shm / "node.h5", 5000, 5000 + data.nbytes)
        assert mapping is not None
        assert mapping.write_crc(data, 5000) == _native.crc32c(data)
        assert os.pread(fd, data.nbytes, 5000) == data.tobytes()
        os.rename(shm / "node.h5", shm / "spare.h5")  # a file keeps its mapping by inode
        again = os.open(shm / "spare.h5", os.O_RDWR)
        assert mappings.mapping(again, shm / "spare.h5", 5000, 5000 + data.nbytes) is mapping
        assert mappings.mapping(again, shm / "spare.h5", 4096, 3 * MiB) is not mapping
        assert mapping.closed and len(mappings) == 1  # a range it did not cover: mapped anew
        os.close(again)
    finally:
        os.close(fd)
        mappings.close()


def test_a_write_outside_the_mapping_or_after_close_is_refused(shm):
    mappings = NodeFileMappings(limit=1)
    fd = written_file(shm / "node.h5", 1 * MiB)
    try:
        mapping = mappings.mapping(fd, shm / "node.h5", 8192, 16384)
        assert mapping is not None
        with pytest.raises(UsageError, match="cannot write bytes 12288 to 20480"):
            mapping.write_crc(bytes(8192), 12288)
        mappings.close()
        with pytest.raises(UsageError, match="closed mapping"):
            mapping.write_crc(bytes(10), 8192)
    finally:
        os.close(fd)


def test_no_mapping_off_tmpfs_or_past_the_end_of_the_file(shm, tmp_path):
    mappings = NodeFileMappings(limit=4)
    on_disk = written_file(tmp_path / "node.h5", 1 * MiB)
    short = written_file(shm / "node.h5", 1 * MiB)
    try:
        if _native.on_tmpfs(on_disk):
            pytest.skip("the temporary directory is on tmpfs")
        assert mappings.mapping(on_disk, tmp_path / "node.h5", 0, 4096) is None
        assert mappings.mapping(short, shm / "node.h5", 0, 1 * MiB + 1) is None
        assert len(mappings) == 0
    finally:
        os.close(on_disk)
        os.close(short)


def test_at_most_limit_mappings_are_kept_the_least_recently_used_released(shm):
    mappings = NodeFileMappings(limit=2)
    fds = [written_file(shm / f"node{i}.h5", 64 << 10) for i in range(3)]
    try:
        first, second = (mappings.mapping(fd, shm / "f", 0, 4096) for fd in fds[:2])
        assert mappings.mapping(fds[0], shm / "f", 0, 4096) is first  # now the most recent
        mappings.mapping(fds[2], shm / "f", 0, 4096)
        assert second.closed and not first.closed and len(mappings) == 2
    finally:
        mappings.close()
        for fd in fds:
            os.close(fd)


@as_root
def test_a_deleted_file_gives_its_memory_back_once_its_mapping_is_released(tmp_path):
    with small_tmpfs(tmp_path / "bb", "64m") as bb:
        mappings = NodeFileMappings(limit=4)
        fd = written_file(bb / "spare.h5", 32 * MiB)
        mapped = mappings.mapping(fd, bb / "spare.h5", 0, 32 * MiB)
        assert mapped is not None
        os.close(fd)
        before = free_bytes(bb)
        (bb / "spare.h5").unlink()
        assert free_bytes(bb) == before  # the mapping holds the pages
        mappings.release_unlinked()
        assert mapped.closed and len(mappings) == 0
        assert free_bytes(bb) >= before + 32 * MiB


@as_root
def test_a_hole_in_a_full_tmpfs_is_no_mapping_not_a_sigbus(tmp_path):
    """A file with a hole (never written) on a full tmpfs: a copy into the hole through a
    mapping would kill the process with SIGBUS; the hole is reserved first, which fails,
    so the caller writes with pwrite and gets ENOSPC."""
    with small_tmpfs(tmp_path / "bb", "8m") as bb:
        fd = os.open(bb / "spare.h5", os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(fd, 4 * MiB)  # a hole of 4 MiB
        filler = bb / "filler"
        with pytest.raises(OSError), open(filler, "wb") as out:
            out.write(bytes(16 * MiB))  # the tmpfs is full
        pid = os.fork()
        if pid == 0:  # the child: a SIGBUS kills it alone
            try:
                mapping = NodeFileMappings(limit=1).mapping(fd, bb / "spare.h5", 0, 4 * MiB)
                if mapping is not None:
                    mapping.write_crc(bytes(4 * MiB), 0)
                os._exit(0 if mapping is None else 3)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_holds_neither_the_mappings_nor_their_files(shm):
    mappings = NodeFileMappings(limit=2)
    fd = written_file(shm / "node.h5", 1 * MiB)
    try:
        mapping = mappings.mapping(fd, shm / "node.h5", 0, 1 * MiB)
        assert mapping is not None

        def holds_the_file() -> bool:
            maps = Path("/proc/self/maps").read_text()
            fds = []
            for n in os.listdir("/proc/self/fd"):
                with contextlib.suppress(FileNotFoundError):  # the listing's own
                    fds.append(os.readlink(f"/proc/self/fd/{n}"))
            return str(shm / "node.h5") in maps or str(shm / "node.h5") in fds

        os.close(fd)
        fd = -1
        assert holds_the_file()  # the parent: its mapping and its own descriptor
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(1 if holds_the_file() or len(mappings) else 0)
            finally:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not mapping.closed and holds_the_file()
    finally:
        if fd >= 0:
            os.close(fd)
        mappings.close()
