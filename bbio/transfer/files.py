"""File operations of the transfer layer: temporary names, piecewise copy, commit, manifests.

Not collective: each function works on one process's files.  A destination
file is written under a hidden temporary name next to it (``.NAME.bbio-part``),
possibly by several ranks at once at disjoint offsets, and only its committer
gives it its final name, after setting mode and mtime and fsyncing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bbio import _native
from bbio.errors import BBIOError, IntegrityError, from_oserror
from bbio.transfer.manifest import META_DIR, Manifest

TEMP_SUFFIX = ".bbio-part"
# Unique temporary names end in "-bbio-part", after a last dot: ".NAME.PID-RANDOM-bbio-part".
# GlusterFS's DHT places ".NAME.ANYTHING" (one dot-free part after NAME) where it
# places NAME (its default rsync-hash-regex), so the rename moves no file between
# bricks and leaves no link file behind; as ".NAME.PID.RANDOM.bbio-part" would.
UNIQUE_TEMP_SUFFIX = "-bbio-part"
_UNIQUE_TEMP_NAME = re.compile(r"\..+\.[0-9]+-[0-9a-f]{8}-bbio-part", re.DOTALL)
_NAME_MAX = 255
_VERIFY_BUFFER = 4 << 20
# fsyncs run on this many threads: the file system merges concurrent fsyncs
# into fewer journal commits, and the device gets a deeper queue.
FSYNC_THREADS = 32


def temp_path(final: Path) -> Path:
    """The temporary name a file is written under before it is committed."""
    return Path(temp_name(os.fspath(final)))


def temp_name(final: str) -> str:
    """:func:`temp_path` of a path given as a string (cheaper for many files)."""
    head, name = os.path.split(final)
    temp = f".{name}{TEMP_SUFFIX}"
    if len(os.fsencode(temp)) > _NAME_MAX:
        temp = f".{hashlib.sha1(os.fsencode(name)).hexdigest()}{TEMP_SUFFIX}"
    return os.path.join(head, temp)


def is_temp_name(name: str) -> bool:
    """True for names made by :func:`temp_path` or :func:`unique_temp_path` (never staged
    or listed)."""
    if name.startswith(".") and name.endswith(TEMP_SUFFIX):
        return True
    return _UNIQUE_TEMP_NAME.fullmatch(name) is not None


def is_real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory, not a symlink to one.  Not collective."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_temp_files(directory: Path | str) -> int:
    """Delete the temporary files (:func:`is_temp_name`) directly in ``directory``, which
    an interrupted run left; returns how many.  Raises the OSError of a failure."""
    with os.scandir(directory) as entries:
        leftovers = [e.path for e in entries if is_temp_name(e.name) and not e.is_dir()]
    for path in leftovers:
        os.unlink(path)
    return len(leftovers)


def _fail(exc: OSError, action: str, path: Path | str):
    return from_oserror(exc, action, path)


def prepare(final: Path, size: int) -> Path:
    """Create (or empty) the temporary file of ``final`` and reserve ``size`` bytes.

    A leftover of an earlier, interrupted run is overwritten.  Returns its path.
    """
    temp = temp_path(final)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        raise _fail(exc, "create the temporary file", temp) from None
    try:
        _native.preallocate(fd, size)
    except OSError as exc:
        raise _fail(exc, f"reserve {size} bytes", temp) from None
    finally:
        os.close(fd)
    return temp


@dataclasses.dataclass(frozen=True)
class PieceResult:
    """What copying one piece did: bytes, their CRC32C, whether the source changed."""

    nbytes: int
    crc32c: int
    changed: bool


def open_source(path: Path) -> int | None:
    """Open ``path`` for reading as the regular file a walk found there: its descriptor,
    or None when it is gone or no longer a regular file (replaced by a symlink, a FIFO or
    a directory since the walk), which the caller counts as changed.  A symlink in the
    last component is never followed and a FIFO never blocks the open.  Not collective."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # now a symlink
            return None
        raise _fail(exc, "open for reading", path) from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError as exc:
        os.close(fd)
        raise _fail(exc, "look at", path) from None
    if regular:
        return fd
    os.close(fd)
    return None


def copy_piece(
    src: Path,
    dst_temp: Path,
    offset: int,
    length: int,
    expected_size: int,
    expected_mtime_ns: int,
    buffer_size: int = 2 << 20,
) -> PieceResult:
    """Copy ``length`` bytes at ``offset`` of ``src`` into the same range of ``dst_temp``.

    ``changed`` is True when the source no longer has the size and mtime the
    plan was made with, or when fewer bytes than expected could be read.
    """
    src_fd = open_source(src)
    if src_fd is None:  # gone, or no longer a regular file: looked at again by the caller
        return PieceResult(0, 0, True)
    try:
        try:
            dst_fd = os.open(dst_temp, os.O_WRONLY)
        except OSError as exc:
            raise _fail(exc, "open the temporary file", dst_temp) from None
        try:
            result = _native.copy_range(
                src_fd,
                dst_fd,
                offset,
                offset,
                length,
                checksum=True,
                buffer_size=buffer_size,
                src_path=src,
                dst_path=dst_temp,
            )
        finally:
            os.close(dst_fd)
        after = os.fstat(src_fd)
    finally:
        os.close(src_fd)
    changed = (
        result.nbytes != length
        or after.st_size != expected_size
        or after.st_mtime_ns != expected_mtime_ns
    )
    return PieceResult(result.nbytes, result.crc32c or 0, changed)


@dataclasses.dataclass(frozen=True)
class Commit:
    """A finished temporary file to give its final name, mode and mtime."""

    final: Path
    mode: int
    mtime_ns: int


def seal(items: Sequence[Commit]) -> None:
    """Not collective: give finished temporary files their mode and mtime and fsync them
    (concurrently), without renaming them; :func:`commit` with ``sealed`` renames them."""
    if len(items) > 1:
        with ThreadPoolExecutor(min(FSYNC_THREADS, len(items))) as pool:
            list(pool.map(_seal, items))
    elif items:
        _seal(items[0])


def _seal(item: Commit) -> None:
    temp = temp_path(item.final)
    try:
        fd = os.open(temp, os.O_WRONLY)
        try:
            os.fchmod(fd, item.mode & 0o7777)
            os.utime(fd, ns=(item.mtime_ns, item.mtime_ns))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _fail(exc, "commit", item.final) from None


def commit(items: Sequence[Commit], sealed: Sequence[str | Path] = ()) -> None:
    """Commit finished temporary files: mode, mtime and fsync each, then rename them all.

    ``sealed`` are finals whose temporary files already have their mode and
    mtime and were fsynced (by the native batched copy, or :func:`seal`).  The fsyncs run
    concurrently; the renames follow only once every file is durable, and the
    parent directories are fsynced last.
    """
    seal(items)
    finals = [os.fspath(item.final) for item in items] + [os.fspath(f) for f in sealed]
    rename_sealed(finals)
    fsync_dirs({os.path.dirname(final) for final in finals})


def rename_sealed(finals: Sequence[str | Path]) -> None:
    """Rename the sealed temporary files of ``finals`` into place, in order, without
    fsyncing their directories: for a caller that fsyncs them before anything depends on
    the renames being durable.  Not collective."""
    for final in finals:
        try:
            os.replace(temp_name(os.fspath(final)), final)
        except OSError as exc:
            raise _fail(exc, "rename into place", final) from None


def commit_symlink(final: Path, target: str, mtime_ns: int) -> None:
    """Create the symlink ``final`` -> ``target`` atomically (temp name, then rename)."""
    temp = temp_path(final)
    try:
        if temp.is_symlink() or temp.exists():
            temp.unlink()
        os.symlink(target, temp)
        os.utime(temp, ns=(mtime_ns, mtime_ns), follow_symlinks=False)
        os.replace(temp, final)
    except OSError as exc:
        raise _fail(exc, "create the symlink", final) from None


def fsync_dirs(directories: Iterable[str | Path]) -> None:
    """fsync each directory, so that the renames inside it are durable."""
    for directory in set(directories):
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise _fail(exc, "open the directory", directory) from None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_atomic(path: Path, document: Any, make_parent: bool = True) -> None:
    """Write ``document`` as JSON to ``path`` durably: temp name, fsync, rename, fsync dir."""
    write_bytes_atomic(path, json.dumps(document, separators=(",", ":")).encode(), make_parent)


def write_bytes_atomic(path: Path, data: bytes, make_parent: bool = True) -> None:
    """Write ``data`` to ``path`` durably, in one write: temp name, fsync, rename, fsync dir.

    The temporary name is unique (:func:`unique_temp_path`), so concurrent writers never
    share one; it is removed if the write fails.  Errors name ``path``.  Without
    ``make_parent``, a missing directory is an error instead of being created.
    """
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    temp = unique_temp_path(path)
    try:
        try:
            _write_fsynced(temp, data, 0o644)
        except OSError as exc:
            raise _fail(exc, "write", path) from None
        rename_durably(temp, path)
    except BBIOError:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        raise


def unique_tag() -> str:
    """A part of a name that no other process, and no other call, makes: the process ID
    and a random part."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def unique_temp_path(final: Path) -> Path:
    """A temporary name for ``final`` that no other writer uses (:func:`unique_tag`; a
    temporary name as :func:`is_temp_name` knows them), for files several processes
    might write at once."""
    return final.with_name(f".{final.name}.{unique_tag()}{UNIQUE_TEMP_SUFFIX}")


def write_temp(final: Path, data: bytes) -> None:
    """Write ``data`` durably under ``final``'s temporary name, for :func:`commit` with
    ``sealed`` to rename (with other files, and one directory fsync).  Not collective."""
    write_durably(temp_path(final), data)


def write_durably(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create (or truncate) ``path``, write ``data`` whole and fsync it.  Not collective."""
    try:
        _write_fsynced(path, data, mode)
    except OSError as exc:
        raise _fail(exc, "write", path) from None


def create_durably(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """Create ``path`` if no file is there, write ``data`` whole and fsync it: True, or
    False (nothing written) if a file is there.  Not collective."""
    try:
        _write_fsynced(path, data, mode, os.O_EXCL)
    except FileExistsError:
        return False
    except OSError as exc:
        raise _fail(exc, "write", path) from None
    return True


def _write_fsynced(path: Path, data: bytes, mode: int, flags: int = os.O_TRUNC) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durably(temp: Path, final: Path) -> None:
    """Rename ``temp`` to ``final``, then fsync the directory.  Not collective."""
    try:
        os.replace(temp, final)
    except OSError as exc:
        raise _fail(exc, "rename into place", final) from None
    fsync_dirs([final.parent])


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None if there is none (also when a directory above
    it is a file).

    Raises :class:`IntegrityError` when the file is not valid JSON or not an
    object (bbio writes its documents whole, and each is an object: such a file
    is damaged), an OS error as a bbio error.
    """
    try:
        with open(path, "rb") as f:
            document = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _fail(exc, "read", path) from None
    except ValueError as exc:
        raise _damaged(path, f"not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise _damaged(path, f"a JSON {type(document).__name__}, not an object")
    return document


def read_json_if_sound(path: Path) -> dict[str, Any] | None:
    """:func:`read_json`, with a damaged document (not valid JSON, not an object) taken
    for none."""
    try:
        return read_json(path)
    except IntegrityError:
        return None


def _damaged(path: Path, what: str) -> IntegrityError:
    return IntegrityError(
        f"the file is damaged: {what}",
        path=path,
        hint="bbio writes it whole, so something else changed it; remove it, or what "
        "holds it, and rerun what wrote it",
    )


def manifest_path(root: Path, name: str = "manifest") -> Path:
    """Where the manifest ``name`` of the tree ``root`` lives."""
    return root / META_DIR / f"{name}.json"


def write_manifest(root: Path, manifest: Manifest, name: str = "manifest") -> Path:
    """Commit ``manifest`` for the tree ``root`` (written last, durably).  Returns its path."""
    path = manifest_path(root, name)
    write_json_atomic(path, manifest.to_json())
    return path


def withdraw_entries(root: Path, manifest: Manifest, paths: Iterable[str]) -> None:
    """Before the files ``paths`` of ``root`` change: commit ``manifest`` (the tree's
    previous one) without their entries, no longer ``complete`` and ``unfinished``.  A run
    that then fails or is killed leaves a manifest that describes only files it did not
    touch, and says so (a run that finishes writes a new manifest)."""
    changing = set(paths)
    kept = [e for e in manifest.entries if e.path not in changing]
    attrs = {**manifest.attrs, "complete": False, "unfinished": True}
    write_manifest(root, Manifest(manifest.kind, kept, attrs))


def read_manifest(root: Path, name: str = "manifest") -> Manifest | None:
    """The committed manifest of ``root``, or None if there is none."""
    path = manifest_path(root, name)
    document = read_json(path)
    return None if document is None else Manifest.from_json(document, str(path))


def checksum_file(path: Path, *, drop_cache: bool = False) -> tuple[int, int]:
    """(size, CRC32C) of the bytes of ``path``, read now.

    ``drop_cache`` first asks the kernel to drop its cached pages (after an
    fsync they are on the device), so the bytes come from the device.
    """
    fd = open_for_verification(path)
    try:
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return checksum_fd(fd, path)
    finally:
        os.close(fd)


def open_for_verification(path: Path) -> int:
    """A read-only descriptor of ``path``, to read it back (:func:`checksum_fd`); errors
    name the path.  Not collective."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise _fail(exc, "open for verification", path) from None


def forget_cached_pages(path: Path) -> None:
    """Ask the kernel to drop the clean cached pages of ``path`` (after an fsync they are
    on the device).  Best effort: a file gone, or a file system that keeps them, is no
    error."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checksum_fd(fd: int, path: Path) -> tuple[int, int]:
    """(size, CRC32C) of the bytes of the open file ``fd`` from its offset on (``path``
    names it in errors)."""
    buffer = _native.aligned_buffer(_VERIFY_BUFFER)
    size = crc = 0
    try:
        while True:
            n = os.readv(fd, [buffer])
            if n == 0:
                return size, crc
            crc = _native.crc32c(buffer[:n], crc)
            size += n
    except OSError as exc:
        raise _fail(exc, "read for verification", path) from None


def checksum_around(fd: int, path: Path, size: int, known: Iterable[tuple[int, int, int]]) -> int:
    """The CRC32C of the first ``size`` bytes of the open file ``fd``, given the CRC32C of
    some of its extents, ``known`` (offset, length, CRC32C): only the bytes outside them
    are read.  Raises :class:`IntegrityError` naming ``path`` if the extents overlap or
    pass ``size``, or the file is shorter.  Not collective."""
    crc = at = 0
    for offset, length, extent_crc in sorted((*known, (size, 0, 0))):
        if offset < at or offset + length > size:
            raise IntegrityError(
                f"the extent of {length} bytes at {offset} overlaps another, or passes the "
                f"file's {size} bytes",
                path=path,
            )
        while at < offset:
            try:
                piece = os.pread(fd, min(offset - at, _VERIFY_BUFFER), at)
            except OSError as exc:
                raise _fail(exc, "read for its CRC32C", path) from None
            if not piece:
                raise IntegrityError(f"the file ends at byte {at}, not {size}", path=path)
            crc = _native.crc32c(piece, crc)
            at += len(piece)
        crc = _native.crc32c_combine(crc, extent_crc, length)
        at = offset + length
    return crc


def free_bytes(path: Path) -> int:
    """Bytes available to this user on the file system of ``path`` (or its nearest parent)."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _fail(exc, "check free space on", candidate) from None
        return st.f_bavail * st.f_frsize
    return 0
