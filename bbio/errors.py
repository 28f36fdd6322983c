"""The one error hierarchy of bbio, rooted at :class:`BBIOError`.

Each subclass also derives from the matching built-in exception, so callers may
catch ``FileNotFoundError`` or ``bbio.NotFoundError`` alike.  Messages name the
path, the rank or node, what was expected and what to do; :func:`from_oserror`
is the one table that turns an ``errno`` into the right subclass.
"""

from __future__ import annotations

import errno as errno_codes
import os


class BBIOError(Exception):
    """Base of every error bbio raises on purpose.

    ``path``, ``rank`` and ``node`` say where it happened; ``hint`` says what to
    do about it.  They are appended to the message by ``str()``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        rank: int | None = None,
        node: int | None = None,
        hint: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.rank = rank
        self.node = node
        self.hint = hint
        if isinstance(self, OSError):
            self.errno = errno
            self.strerror = message
            self.filename = self.path

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.node is not None:
            where.append(f"node {self.node}")
        text = f"{', '.join(where)}: {self.message}" if where else self.message
        if self.path is not None and self.path not in self.message:
            text += f" [{self.path}]"
        if self.hint:
            text += f". {self.hint[:1].upper()}{self.hint[1:]}"
        return text

    def __reduce__(self):
        fields = {k: getattr(self, k) for k in ("path", "rank", "node", "hint")}
        return (_rebuild, (type(self), self.message, fields, getattr(self, "errno", None)))


def _rebuild(cls: type[BBIOError], message: str, fields: dict, errno: int | None) -> BBIOError:
    return cls(message, errno=errno, **fields)


class ConfigError(BBIOError, ValueError):
    """A setting is missing or has an invalid value."""


class UsageError(BBIOError, ValueError):
    """A call was given arguments it cannot work with."""


class NotFoundError(BBIOError, FileNotFoundError):
    """A path that must exist does not."""


class AlreadyExistsError(BBIOError, FileExistsError):
    """A path that must not exist does."""


class PermissionDeniedError(BBIOError, PermissionError):
    """The file system refused access."""


class IsDirectoryError(BBIOError, IsADirectoryError):
    """A file was expected, a directory was found."""


class NotDirectoryError(BBIOError, NotADirectoryError):
    """A directory was expected, something else was found."""


class NoSpaceError(BBIOError, OSError):
    """A device is, or would become, full: ``errno`` is ENOSPC unless given."""

    def __init__(self, message: str, *, errno: int | None = errno_codes.ENOSPC, **where) -> None:
        super().__init__(message, errno=errno, **where)


class IOFailure(BBIOError, OSError):
    """Any other operating-system error during I/O."""


class OutOfMemoryError(BBIOError, MemoryError):
    """Memory a call needs could not be allocated."""


class IntegrityError(BBIOError):
    """Bytes did not match their recorded size or CRC32C."""


class CollectiveError(BBIOError, RuntimeError):
    """Another rank failed in a collective call; raised on every rank alike."""


class BBIOTimeoutError(BBIOError, TimeoutError):
    """An operation did not finish within its timeout."""


class DependencyError(BBIOError, ImportError):
    """A required component (MPI, parallel h5py, the native extension) is missing."""


_ERRNO_CLASSES: dict[int, type[BBIOError]] = {
    errno_codes.ENOENT: NotFoundError,
    errno_codes.EEXIST: AlreadyExistsError,
    errno_codes.EACCES: PermissionDeniedError,
    errno_codes.EPERM: PermissionDeniedError,
    errno_codes.EROFS: PermissionDeniedError,
    errno_codes.EISDIR: IsDirectoryError,
    errno_codes.ENOTDIR: NotDirectoryError,
    errno_codes.ENOSPC: NoSpaceError,
    errno_codes.EDQUOT: NoSpaceError,
}


def error_class_for_errno(code: int | None) -> type[BBIOError]:
    """The BBIOError subclass for an errno value (``IOFailure`` by default)."""
    return _ERRNO_CLASSES.get(code or 0, IOFailure)


def from_oserror(
    exc: OSError,
    action: str,
    path: str | os.PathLike | None = None,
    *,
    rank: int | None = None,
    node: int | None = None,
    hint: str | None = None,
) -> BBIOError:
    """Translate an ``OSError`` raised while doing ``action`` into a BBIOError.

    The message reads like "cannot open for reading: No such file or directory".
    """
    if isinstance(exc, BBIOError):
        return exc
    target = path if path is not None else exc.filename
    reason = exc.strerror or str(exc)
    cls = error_class_for_errno(exc.errno)
    return cls(
        f"cannot {action}: {reason}",
        path=target,
        rank=rank,
        node=node,
        hint=hint,
        errno=exc.errno,
    )


def errno_error(
    code: int, action: str, path: str | os.PathLike | None, hint: str | None = None
) -> BBIOError:
    """A BBIOError for a raw errno value, as returned by the native core."""
    return from_oserror(OSError(code, os.strerror(code)), action, path, hint=hint)


CLASSES_BY_NAME: dict[str, type[BBIOError]] = {
    cls.__name__: cls
    for cls in (
        BBIOError,
        ConfigError,
        UsageError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        IsDirectoryError,
        NotDirectoryError,
        NoSpaceError,
        IOFailure,
        OutOfMemoryError,
        IntegrityError,
        CollectiveError,
        BBIOTimeoutError,
        DependencyError,
    )
}
