"""The low level: the only module that imports the compiled extension.

Each function maps to one function of ``csrc/bbio_native_api.h``; the C code
runs with the GIL released.  Errors come back as :class:`bbio.BBIOError`
subclasses that are also ``OSError`` and carry ``errno`` and the path.
Nothing here is collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from bbio.errors import DependencyError, UsageError, errno_error

try:
    from bbio._bbio_native import ffi, lib
except ImportError as exc:  # the package was not built: bbio info reports it
    ffi = lib = None
    LOAD_ERROR: str | None = str(exc)
else:
    LOAD_ERROR = None

ALIGNMENT = 4096
_thread_state = threading.local()


def available() -> bool:
    """Whether the compiled extension is loaded."""
    return lib is not None


def _lib():
    if lib is None:
        raise DependencyError(
            f"bbio's native extension is not built ({LOAD_ERROR})",
            hint="run 'make setup' or 'pip install -e .' in the bbio checkout",
        )
    return lib


def hw_crc32c() -> bool:
    """Whether CRC32C runs on hardware instructions (SSE4.2) on this CPU."""
    return bool(_lib().bbio_crc32c_hw_available())


def aligned_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of ``size`` bytes whose address is 4096-aligned (for O_DIRECT)."""
    raw = np.empty(size + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + size]


def _scratch(size: int) -> np.ndarray:
    buf = getattr(_thread_state, "buffer", None)
    if buf is None or buf.size != size:
        buf = aligned_buffer(size)
        _thread_state.buffer = buf
    return buf


def crc32c(data, value: int = 0, *, impl: str = "auto") -> int:
    """CRC32C of any contiguous buffer, continuing from ``value``.

    ``impl`` is "auto" (hardware when available), "hw" or "sw" (tables).
    Equals ``crc32c.crc32c(data, value)`` from PyPI.
    """
    fn = {"auto": "bbio_crc32c", "hw": "bbio_crc32c_hw", "sw": "bbio_crc32c_sw"}.get(impl)
    if fn is None:
        raise UsageError(f"crc32c impl must be 'auto', 'hw' or 'sw', got {impl!r}")
    view = memoryview(data)
    if not view.contiguous:
        raise UsageError("crc32c needs a contiguous buffer")
    return int(getattr(_lib(), fn)(value & 0xFFFFFFFF, ffi.from_buffer(view), view.nbytes))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A+B given ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and ``len2`` = len(B)."""
    return int(_lib().bbio_crc32c_combine(crc1 & 0xFFFFFFFF, crc2 & 0xFFFFFFFF, len2))


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """What a copy did: ``nbytes`` copied and their CRC32C (None if not computed)."""

    nbytes: int
    crc32c: int | None


def copy_range(
    src_fd: int,
    dst_fd: int,
    src_offset: int = 0,
    dst_offset: int = 0,
    length: int = -1,
    *,
    checksum: bool = True,
    buffer_size: int = 2 << 20,
    use_copy_file_range: bool = True,
    sequential: bool = False,
    src_path: str | os.PathLike | None = None,
    dst_path: str | os.PathLike | None = None,
) -> CopyResult:
    """Copy ``length`` bytes (-1: to end of file) between descriptors at explicit offsets.

    With ``checksum`` the bytes stream once through an aligned per-thread buffer:
    pread, CRC32C, pwrite; a copy of 8 MiB or more runs on two threads, one per
    half, unless ``sequential`` asks for one thread writing in file order (for a
    network or FUSE destination).  Without ``checksum``, ``copy_file_range`` is
    used where the kernel supports it.  Stops early at end of file.  The paths
    only name the files in errors.  If the source shrinks during a two-thread
    copy, the second half may have written bytes beyond the ``nbytes`` returned:
    a caller that keeps the copy truncates it to ``nbytes`` (:func:`copy_file` does).
    """
    native = _lib()
    buf = _scratch(buffer_size)
    flags = 0
    if checksum:
        flags |= native.BBIO_COPY_CRC
    if not use_copy_file_range:
        flags |= native.BBIO_COPY_NO_COPY_FILE_RANGE
    if sequential:
        flags |= native.BBIO_COPY_SEQUENTIAL
    copied = ffi.new("int64_t *")
    crc = ffi.new("uint32_t *")
    failed_fd = ffi.new("int *")
    err = native.bbio_copy_range(
        src_fd,
        dst_fd,
        src_offset,
        dst_offset,
        length,
        ffi.from_buffer(buf),
        buf.size,
        flags,
        copied,
        crc,
        failed_fd,
    )
    if err:
        if failed_fd[0] == dst_fd:
            raise errno_error(err, "write the copy", dst_path)
        raise errno_error(err, "read for copying", src_path)
    return CopyResult(int(copied[0]), int(crc[0]) if checksum else None)


def pwrite_crc(fd: int, data, offset: int, path: str | os.PathLike | None = None) -> int:
    """Write all of the contiguous buffer ``data`` into ``fd`` at ``offset``; returns the
    bytes' CRC32C, computed in the same pass.  ``path`` only names the file in errors."""
    view = memoryview(data)
    if not view.contiguous:
        raise UsageError("pwrite_crc needs a contiguous buffer")
    crc = ffi.new("uint32_t *")
    err = _lib().bbio_pwrite_crc(fd, ffi.from_buffer(view), view.nbytes, offset, crc)
    if err:
        raise errno_error(err, "write", path)
    return int(crc[0])


TMPFS_MAGIC = 0x01021994  # statfs' f_type of tmpfs


def on_tmpfs(fd: int, path: str | os.PathLike | None = None) -> bool:
    """Whether the open file ``fd`` is on tmpfs.  ``path`` only names the file in errors."""
    magic = ffi.new("int64_t *")
    err = _lib().bbio_fs_magic(fd, magic)
    if err:
        raise errno_error(err, "find the file system of", path)
    return int(magic[0]) == TMPFS_MAGIC


class SharedMapping:
    """Bytes ``start`` (rounded down to a page) to ``end`` of the file open read-write as
    ``fd``, mapped shared and writable and left out of forked children.  The file must
    stay at least ``end`` bytes long while it is mapped: a write past a file's end is a
    SIGBUS.  Not thread-safe.  ``path`` only names the file in errors."""

    def __init__(self, fd: int, start: int, end: int, path: str | os.PathLike | None = None):
        self.start = start - start % os.sysconf("SC_PAGE_SIZE")
        self.end = end
        self.path = path
        addr = ffi.new("void **")
        err = _lib().bbio_map_shared(fd, self.start, end - self.start, addr)
        if err:
            raise errno_error(err, "map", path)
        self._base = ffi.cast("unsigned char *", addr[0])
        self._unmap = weakref.finalize(self, _lib().bbio_unmap, addr[0], end - self.start)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`forget` was called."""
        return not self._unmap.alive

    def write_crc(self, data, offset: int) -> int:
        """Copy the contiguous buffer ``data`` to the file's ``offset``; returns the CRC32C
        of the bytes written, computed in the same pass."""
        view = memoryview(data)
        if not view.contiguous:
            raise UsageError("write_crc needs a contiguous buffer")
        if self.closed or offset < self.start or offset + view.nbytes > self.end:
            raise UsageError(
                f"cannot write bytes {offset} to {offset + view.nbytes} of {self.path} "
                f"through {'a closed mapping' if self.closed else 'a mapping'} of bytes "
                f"{self.start} to {self.end}"
            )
        crc = ffi.new("uint32_t *")
        into = self._base + (offset - self.start)
        err = _lib().bbio_copy_crc(into, ffi.from_buffer(view), view.nbytes, crc)
        if err:
            raise errno_error(err, "write through a mapping of", self.path)
        return int(crc[0])

    def close(self) -> None:
        """Unmap the bytes (the file's pages stay the file's)."""
        self._unmap()

    def forget(self) -> None:
        """In a forked child, which has no such mapping: drop this object without unmapping."""
        self._unmap.detach()


def open_direct(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int | None:
    """``os.open`` with ``O_DIRECT``; None where the file system refuses it (tmpfs and
    some FUSE mounts).  Other failures raise their OSError."""
    try:
        return os.open(path, flags | os.O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _open(path: str | os.PathLike, flags: int, direct: bool, action: str, mode: int = 0o644) -> int:
    try:
        fd = open_direct(path, flags, mode) if direct else None
        return os.open(path, flags, mode) if fd is None else fd
    except OSError as exc:
        raise errno_error(exc.errno, action, path) from None


PREALLOCATE_MIN_BYTES = 8 << 20  # smaller files write faster without (ext4)


def preallocate(
    fd: int,
    nbytes: int,
    at_least: int = PREALLOCATE_MIN_BYTES,
    keep_size: bool = False,
    offset: int = 0,
) -> bool:
    """Reserve ``nbytes`` for ``fd`` from ``offset`` (``fallocate(2)``) if they are at least
    ``at_least``; returns whether it did (False also where the file system cannot reserve
    space: nothing is written then, unlike ``posix_fallocate``).  ``keep_size``: the
    file's size does not change (a truncate to its size later frees what was not written).

    Raises OSError (ENOSPC) when the device cannot hold them.
    """
    if nbytes < max(at_least, 1):
        return False
    err = _lib().bbio_fallocate(fd, offset, nbytes, int(keep_size))
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False  # the file system cannot reserve space; writing still works
    if err:
        raise OSError(err, os.strerror(err))
    return True


def copy_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    checksum: bool = True,
    direct: bool = False,
    buffer_size: int = 2 << 20,
    sequential: bool = False,
    on_open: Callable[[], object] | None = None,
) -> CopyResult:
    """Copy the whole file ``src`` into ``dst`` (created or truncated).

    A large destination is preallocated to the source's size first (less work
    for the file system, and a full device fails before any byte is copied).
    ``direct`` opens both with O_DIRECT where the file system allows it;
    ``sequential`` writes in file order from one thread (:func:`copy_range`).
    ``on_open`` is called once both files are open, right before the bytes are
    copied (the copy releases the GIL: a thread it starts runs meanwhile, and
    does not hold up the copy's start).
    Does not fsync and does not rename: the transfer layer does that.
    """
    src_fd = _open(src, os.O_RDONLY, direct, "open for reading")
    try:
        source = os.fstat(src_fd)
        with contextlib.suppress(OSError):  # a destination that cannot be looked at: _open says
            target = os.stat(dst)
            if (target.st_dev, target.st_ino) == (source.st_dev, source.st_ino):
                raise UsageError(f"copy_file: {dst} is {src} itself", path=dst)
        dst_fd = _open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct, "create")
        try:
            return copy_whole(
                src_fd,
                dst_fd,
                src_path=src,
                dst_path=dst,
                checksum=checksum,
                buffer_size=buffer_size,
                sequential=sequential,
                on_open=on_open,
            )
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def copy_whole(
    src_fd: int,
    dst_fd: int,
    *,
    src_path: str | os.PathLike | None = None,
    dst_path: str | os.PathLike | None = None,
    checksum: bool = True,
    buffer_size: int = 2 << 20,
    sequential: bool = False,
    on_open: Callable[[], object] | None = None,
) -> CopyResult:
    """Copy the whole open file ``src_fd`` into ``dst_fd``, an empty file the caller
    opened and keeps (say, to fsync it without opening it again), from their starts.
    As :func:`copy_file` otherwise: preallocated, ``on_open`` called right before the
    bytes are copied.  The paths only name the files in errors."""
    size = os.fstat(src_fd).st_size
    try:
        preallocate(dst_fd, size)
    except OSError as exc:
        raise errno_error(exc.errno, f"reserve {size} bytes for the copy", dst_path) from None
    if on_open is not None:
        on_open()
    result = copy_range(
        src_fd,
        dst_fd,
        checksum=checksum,
        buffer_size=buffer_size,
        sequential=sequential,
        src_path=src_path,
        dst_path=dst_path,
    )
    if result.nbytes != size:  # the source shrank during the copy: no reserved
        os.ftruncate(dst_fd, result.nbytes)  # nor stray bytes (a split copy's) beyond
    return result


@dataclasses.dataclass(frozen=True)
class FileCopy:
    """One file of :func:`copy_files`: bytes, CRC32C, the source's size and mtime once
    copied, and the error (None if it worked).  ``source_not_regular``: nothing was
    copied because the source is gone or no longer a regular file (a symlink, FIFO or
    directory in its place; never followed or opened blocking), with no error."""

    nbytes: int
    crc32c: int
    size_after: int
    mtime_ns_after: int
    error: BaseException | None
    source_not_regular: bool = False


def _path_bytes(path: str | os.PathLike) -> bytes:
    """``path`` encoded for C; a NUL in it would silently cut it short there."""
    encoded = os.fsencode(path)
    if b"\0" in encoded:
        raise UsageError(f"a path holds a NUL byte: {path!r}")
    return encoded


SIDE_SOURCE, SIDE_DESTINATION, SIDE_SOURCE_NOT_REGULAR = 0, 1, 2  # as in bbio_native.c


def copy_files(
    sources: Sequence[str | os.PathLike],
    destinations: Sequence[str | os.PathLike],
    *,
    threads: int = 8,
    checksum: bool = True,
    buffer_size: int = 1 << 20,
    modes: Sequence[int] | None = None,
    mtimes_ns: Sequence[int] | None = None,
) -> list[FileCopy]:
    """Copy whole files, ``threads`` at a time: ``sources[i]`` into ``destinations[i]``.

    Each destination is created (mode 0600) or truncated.  Given ``modes`` and
    ``mtimes_ns``, each copy is then sealed: its mode and mtime set and fsynced.
    Meant for many small files on a file system with high latency per file: the
    opens, reads, writes and fsyncs of different files overlap.  Failures are
    reported per file, as OSError-derived BBIOErrors naming the path, not raised.
    """
    count = len(sources)
    if len(destinations) != count:
        raise UsageError("copy_files: sources and destinations must have the same length")
    if (modes is None) != (mtimes_ns is None):
        raise UsageError("copy_files: give both modes and mtimes_ns, or neither")
    if modes is not None and not len(modes) == len(mtimes_ns) == count:
        raise UsageError("copy_files: modes and mtimes_ns need one entry per file")
    src = [ffi.new("char[]", _path_bytes(p)) for p in sources]
    dst = [ffi.new("char[]", _path_bytes(p)) for p in destinations]
    copied = np.zeros(count, dtype=np.int64)
    crcs = np.zeros(count, dtype=np.uint32)
    errors = np.zeros(count, dtype=np.intc)
    sides = np.zeros(count, dtype=np.intc)
    sizes = np.zeros(count, dtype=np.int64)
    mtimes = np.zeros(count, dtype=np.int64)
    seal_modes = seal_mtimes = ffi.NULL
    if modes is not None:
        seal_modes = ffi.from_buffer("uint32_t[]", np.ascontiguousarray(modes, dtype=np.uint32))
        seal_mtimes = ffi.from_buffer("int64_t[]", np.ascontiguousarray(mtimes_ns, dtype=np.int64))
    native = _lib()
    native.bbio_copy_files(
        ffi.new("char *[]", src),
        ffi.new("char *[]", dst),
        count,
        max(1, threads),
        buffer_size,
        native.BBIO_COPY_CRC if checksum else 0,
        seal_modes,
        seal_mtimes,
        ffi.from_buffer("int64_t[]", copied, require_writable=True),
        ffi.from_buffer("uint32_t[]", crcs, require_writable=True),
        ffi.from_buffer("int[]", errors, require_writable=True),
        ffi.from_buffer("int[]", sides, require_writable=True),
        ffi.from_buffer("int64_t[]", sizes, require_writable=True),
        ffi.from_buffer("int64_t[]", mtimes, require_writable=True),
    )
    results = []
    for i in range(count):
        error = None
        if errors[i] and sides[i] == SIDE_DESTINATION:
            error = errno_error(int(errors[i]), "write the copy", destinations[i])
        elif errors[i] and sides[i] == SIDE_SOURCE:
            error = errno_error(int(errors[i]), "read for copying", sources[i])
        results.append(
            FileCopy(
                int(copied[i]),
                int(crcs[i]),
                int(sizes[i]),
                int(mtimes[i]),
                error,
                source_not_regular=bool(errors[i]) and sides[i] == SIDE_SOURCE_NOT_REGULAR,
            )
        )
    return results


def pread_batch(
    fds: Sequence[int] | np.ndarray,
    offsets: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    out,
    out_offsets: Sequence[int] | np.ndarray | None = None,
    *,
    threads: int = 8,
    paths: Sequence[str | os.PathLike] | None = None,
    check: bool = True,
    aligned: Sequence[bool] | np.ndarray | None = None,
) -> np.ndarray:
    """Read many (fd, offset, length) requests into one buffer, ``threads`` in flight.

    Request i lands at ``out[out_offsets[i]:]`` (default: packed in order).
    Requests flagged in ``aligned`` read the 4096-byte-aligned range around
    them and copy their bytes out, as descriptors opened with ``O_DIRECT``
    (:func:`open_direct`) need.
    Returns each request's bytes read (short only at end of file) or -errno.
    With ``check``, a failed request raises an OSError-derived BBIOError naming
    ``paths[i]``.
    """
    fd_arr = np.ascontiguousarray(fds, dtype=np.int32)
    off_arr = np.ascontiguousarray(offsets, dtype=np.int64)
    len_arr = np.ascontiguousarray(lengths, dtype=np.int64)
    count = fd_arr.size
    if off_arr.size != count or len_arr.size != count:
        raise UsageError("pread_batch: fds, offsets and lengths must have the same length")
    if out_offsets is None:
        dst_arr = np.zeros(count, dtype=np.int64)
        np.cumsum(len_arr[:-1], out=dst_arr[1:])
    else:
        dst_arr = np.ascontiguousarray(out_offsets, dtype=np.int64)
        if dst_arr.size != count:
            raise UsageError("pread_batch: out_offsets must have one entry per request")
    view = memoryview(out)
    if view.readonly or not view.contiguous:
        raise UsageError("pread_batch: out must be a writable contiguous buffer")
    if count and (
        (len_arr < 0).any()
        or (off_arr < 0).any()
        or (dst_arr < 0).any()
        or (dst_arr > view.nbytes - len_arr).any()  # not dst + len: it could wrap
    ):
        raise UsageError(
            f"pread_batch: requests must have non-negative offsets and lengths and fit in "
            f"the {view.nbytes}-byte output buffer"
        )
    flags = ffi.NULL
    if aligned is not None:
        aligned_arr = np.ascontiguousarray(aligned, dtype=np.uint8)
        if aligned_arr.size != count:
            raise UsageError("pread_batch: aligned must have one entry per request")
        flags = ffi.from_buffer("uint8_t[]", aligned_arr)
    results = np.empty(count, dtype=np.int64)
    failures = ffi.new("int64_t *")
    _lib().bbio_pread_batch(
        ffi.from_buffer("int[]", fd_arr),
        ffi.from_buffer("int64_t[]", off_arr),
        ffi.from_buffer("int64_t[]", len_arr),
        ffi.from_buffer("int64_t[]", dst_arr),
        flags,
        count,
        ffi.from_buffer(view),
        max(1, threads),
        ffi.from_buffer("int64_t[]", results, require_writable=True),
        failures,
    )
    if check and failures[0]:
        first = int(np.flatnonzero(results < 0)[0])
        path = paths[first] if paths is not None else f"fd {int(fd_arr[first])}"
        raise errno_error(
            int(-results[first]),
            f"read {int(len_arr[first])} bytes at offset {int(off_arr[first])} "
            f"({failures[0]} of {count} requests failed)",
            path,
        )
    return results
