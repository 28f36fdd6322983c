"""Slurm prolog and epilog work on one node, without MPI (``bbio slurm prolog|epilog``).

Both run as root.  The prolog (before the job) creates the job's directory:
``bb_root`` up to its component that holds ``{job}``, owned by the job's user,
mode 0700; the ranks create the node directories below it (``{node}``).  The
epilog (after the job) finishes draining, as the job's user, every checkpoint
still queued anywhere under the job's directory on this host, then removes
the job's directory as root — unless something could not be drained: then
the data stays and the epilog fails, which makes Slurm drain the node so
that an admin can recover it.  ``jobscripts/slurm-prolog.sh`` and
``slurm-epilog.sh`` call these.  Both read the site file alone (:class:`Site`):
``BBIO_*`` variables in an admin's shell do not move the job's directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import math
import multiprocessing
import multiprocessing.connection
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from bbio.arguments import seconds_argument
from bbio.checkpoint import admin, drain, layout
from bbio.config import Config, config_file_path, load_config
from bbio.errors import BBIOError, ConfigError, PermissionDeniedError, from_oserror

ENDING_GRACE_SECONDS = 60.0  # after its timeout, the epilog's drain has this long to end
KILLED_GRACE_SECONDS = 5.0  # then it is killed, and waited for this long (not if it hangs)
DRAINS_AT_ONCE = 8  # journals drained at once, each in a process of its own
DRAIN_ROOM_BYTES = 16 << 20  # below this free, the epilog makes room before it drains
WAIT_SLICE_SECONDS = 3600.0  # the epilog waits for its drains this long at most per call
SITE_VARIABLES = ("BBIO_CONFIG",)  # the only BBIO_* variable the hooks read: the site file
LARGEST_ID = 2**32 - 2  # uid_t and gid_t; 2**32 - 1 is (uid_t) -1, "no change" to chown
CAP_CHOWN = 0  # its bit in /proc/self/status's CapEff
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8  # umount2's flags (linux/fs.h)
FILE_SYSTEM_HINT = (
    "check the burst buffer's file system (mounted read-write? space and inodes free: df -h, "
    "df -i), then resume the node (scontrol update nodename=NODE state=resume)"
)


@dataclasses.dataclass(frozen=True)
class Job:
    """What Slurm tells a prolog or epilog about the job."""

    id: str
    user: str
    uid: int
    gid: int

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Job:
        """Read ``SLURM_JOB_ID``, ``SLURM_JOB_USER``, ``SLURM_JOB_UID`` and ``SLURM_JOB_GID``
        (without it: the user's primary group)."""
        try:
            job_id, user = env["SLURM_JOB_ID"], env["SLURM_JOB_USER"]
            uid = _id_from_env(env, "SLURM_JOB_UID")
        except KeyError as exc:
            raise ConfigError(
                f"not run by Slurm: {exc.args[0]} is not set",
                hint="run this from a Slurm Prolog/Epilog, which sets SLURM_JOB_ID, "
                "SLURM_JOB_USER and SLURM_JOB_UID",
            ) from None
        if not job_id or not user:
            empty = "SLURM_JOB_ID" if not job_id else "SLURM_JOB_USER"
            raise ConfigError(f"not run by Slurm: {empty} is empty")
        gid = _id_from_env(env, "SLURM_JOB_GID") if env.get("SLURM_JOB_GID") else None
        if gid is not None:
            return cls(job_id, user, uid, gid)
        try:
            return cls(job_id, user, uid, pwd.getpwnam(user).pw_gid)
        except KeyError:
            raise ConfigError(
                f"the job's user {user} (SLURM_JOB_USER) is unknown on this node",
                hint="check the node's user database (getent passwd), or set SLURM_JOB_GID",
            ) from None


def _id_from_env(env: Mapping[str, str], name: str) -> int:
    """The user or group id in ``env[name]``; a :class:`ConfigError` naming ``name`` unless it
    is an integer from 0 to :data:`LARGEST_ID`."""
    text = env[name]
    if not (text.isascii() and text.isdigit()) or int(text) > LARGEST_ID:
        raise ConfigError(
            f"{name}={text!r} is not a user or group id (an integer from 0 to {LARGEST_ID})",
            hint=f"Slurm sets {name} to the job's; run by hand, give the job user's "
            "(id -u USER, id -g USER)",
        )
    return int(text)


@dataclasses.dataclass(frozen=True)
class Site:
    """The settings the hooks use: the site file's alone (``file`` None: there is none, the
    built-in defaults apply)."""

    config: Config
    file: str | None = None

    @classmethod
    def load(cls, config_file: str | None, env: Mapping[str, str]) -> Site:
        """The site file: ``config_file``, else ``BBIO_CONFIG``, else ``/etc/bbio/bbio.toml``;
        every other ``BBIO_*`` variable in ``env`` is ignored (an admin's own, when an
        epilog is run by hand, would else move the job's directory)."""
        site_env = {name: env[name] for name in SITE_VARIABLES if name in env}
        path = config_file_path(config_file, site_env)
        return cls(load_config(config_file, env=site_env), None if path is None else str(path))

    def describe(self) -> str:
        """Where ``bb_root`` comes from, for error messages."""
        return f"the site file {self.file}" if self.file else "the defaults: no site file"


def job_config(config: Config, job: Job) -> Config:
    """``config`` for ``job``: {job} and {user} are Slurm's job id and user, whatever
    ``BBIO_JOB_ID`` or ``BBIO_USER`` say."""
    return dataclasses.replace(config, job_id=job.id, user=job.user)


def job_dir(site: Site, job: Job) -> Path:
    """The job's directory: the site's ``bb_root`` up to its component with {job}, expanded
    for ``job``.

    Raises :class:`ConfigError` if ``bb_root`` has no {job}, has {node} up to it, or is
    not an absolute path.
    """
    bb_root = site.config.bb_root
    parts = Path(bb_root).parts
    index = next((i for i, part in enumerate(parts) if "{job}" in part), None)
    fix = f"set bb_root in {site.file or '/etc/bbio/bbio.toml'}"
    if index is None:
        raise ConfigError(
            f"bb_root {bb_root} (from {site.describe()}) has no {{job}}: the Slurm hooks "
            "create and remove one directory per job, and would remove what other jobs on "
            "this node still use",
            hint=f"{fix} to e.g. /local/nvme/bbio/{{job}}",
        )
    template = os.path.join(*parts[: index + 1])
    if "{node}" in template:
        raise ConfigError(
            f"bb_root {bb_root} (from {site.describe()}) has {{node}} before or beside "
            "{job}: the hooks cannot know which node index this host has in the job",
            hint=f"{fix} with {{node}} in a component below the job's, e.g. "
            "/local/nvme/bbio/{job}/{node}",
        )
    if not os.path.isabs(template):  # "~" too: root's home in the hooks, the user's in the job
        raise ConfigError(
            f"bb_root {bb_root} (from {site.describe()}) is not an absolute path: the hooks "
            "would make and remove the job's directory relative to wherever slurmd runs them "
            "(or, for ~, in root's home instead of the job's user's)",
            hint=f"{fix} to an absolute path, e.g. /local/nvme/bbio/{{job}}",
        )
    return job_config(site.config, job).expand(template)


def journals_under(job_root: Path) -> list[Path]:
    """Every checkpoint journal under ``job_root`` (D/ckpt/NAME/.journal at any depth: the
    hooks run without MPI and cannot know a host's node index, and a checkpointer may
    have been given its own ``bb_root`` there).  Symlinks are not followed.  GNU
    ``find`` walks the tree, relative to each directory: a tree of any depth the job
    left, and paths longer than the system's limit, are walked."""
    listing = subprocess.run(
        ["find", "-P", os.fspath(job_root), "-type", "d", "-name", drain.JOURNAL, "-print0"],
        capture_output=True,
        env={**os.environ, "LC_ALL": "C"},  # its messages in English, as read below
    )
    problems = [
        line
        for line in os.fsdecode(listing.stderr).splitlines()
        if not line.endswith("No such file or directory")  # removed during the walk
    ]
    if listing.returncode != 0 and problems:
        raise ConfigError(
            "could not look for checkpoint journals in the job's burst-buffer directory: "
            + "; ".join(problems),
            path=job_root,
            hint="the directory is kept; look at it, then run the epilog again",
        )
    found = [Path(os.fsdecode(raw)) for raw in listing.stdout.split(b"\0") if raw]
    return sorted(j for j in found if j.parent.parent.name == layout.CKPT_DIR)


def check_parents(path: Path, make: bool = False) -> None:
    """Raise :class:`ConfigError` unless every directory above ``path`` is root's (or
    this process's user's), and writable by no one else unless sticky (as ``/tmp``),
    and has no ACL: else a user could put a symlink there, and the hooks, as root,
    would hand the user or delete a directory elsewhere.  A symlink among them must be
    root's too (its target is then the site's choice).  With ``make``, a missing one is
    created (mode 0755), each only once the ones above it passed.  Not collective."""
    current = Path(path.anchor)
    for part in path.parent.parts[1:]:
        current = current / part
        if make:
            _make_directory(current, 0o755, "make a parent of the job's burst-buffer directory")
        _check_parent(current, path)


def _make_directory(path: Path, mode: int, action: str) -> bool:
    """``os.mkdir(path, mode)``: True if this made it, False if it existed; anything else
    the file system refuses (read-only, full, out of inodes) is a :class:`BBIOError`."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return False
    except OSError as exc:
        raise from_oserror(exc, action, path, hint=FILE_SYSTEM_HINT) from None
    return True


def _check_parent(parent: Path, path: Path) -> None:
    """:func:`check_parents` of one directory ``parent`` above ``path``."""
    try:
        info = os.lstat(parent)
    except OSError as exc:
        raise from_oserror(exc, "look at a parent of the job's directory", parent) from None
    link = stat.S_ISLNK(info.st_mode)
    trusted = info.st_uid in (0, os.geteuid())
    others_write = info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and info.st_gid != 0)
    acl = not link and _has_acl(parent)
    open_to_others = not link and (others_write or acl)
    if not trusted or (open_to_others and not info.st_mode & stat.S_ISVTX):
        raise ConfigError(
            f"a parent of the job's burst-buffer directory is not root's alone: {parent} "
            f"is uid {info.st_uid}'s, mode {stat.filemode(info.st_mode)}"
            + (", with an ACL" if acl else ""),
            path=path,
            hint="make every directory above bb_root's {job} directory root's and "
            "writable by root alone (or sticky, as /tmp), without ACLs; a user may have "
            "put it there to have the hooks, as root, act elsewhere",
        )


def _has_acl(directory: Path) -> bool:
    """Does ``directory`` carry a POSIX access ACL (which may let users write in it)?"""
    try:
        return "system.posix_acl_access" in os.listxattr(directory, follow_symlinks=False)
    except OSError:  # no extended attributes on this file system: no ACL
        return False


def _can_chown() -> bool:
    """Does this process hold CAP_CHOWN (as root does, unless a capability bounding set
    took it away)?  Where ``/proc`` cannot tell, whether it runs as root."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_CHOWN & 1)
    return os.geteuid() == 0


def _check_can_hand_over(job: Job, path: Path) -> None:
    """Raise :class:`PermissionDeniedError` unless this process may give ``path`` to the
    job's user: it is root with CAP_CHOWN, or the job's user itself."""
    if os.geteuid() == job.uid or _can_chown():
        return
    raise PermissionDeniedError(
        f"the prolog runs as uid {os.geteuid()} without CAP_CHOWN: it cannot give the job's "
        f"burst-buffer directory to the job's user (uid {job.uid}); nothing was made",
        path=path,
        hint="run it as root, as slurmd runs slurm.conf's Prolog= (not PrologSlurmctld, "
        "nor under a capability bounding set without CAP_CHOWN), then resume the node",
    )


def prolog(site: Site, job: Job) -> Path:
    """Create the job's directory, owned by the job's user, mode 0700.  Not collective.

    An existing one (a requeued job's) must be a directory of root or of the
    job's user; it is changed through a descriptor opened without following
    symlinks, so that nothing swapped in meanwhile is handed to the user.  Raises
    a :class:`BBIOError` naming the path when this process cannot hand a directory
    over (not root) or the file system refuses; a directory it made is then removed
    (parents it made stay, root's, mode 0755).
    """
    path = job_dir(site, job)
    _check_can_hand_over(job, path)
    check_parents(path, make=True)
    made = _make_directory(path, 0o700, "make the job's burst-buffer directory")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise from_oserror(exc, "open the job's burst-buffer directory", path) from None
        raise ConfigError(
            "the job's burst-buffer path exists and is not a directory",
            path=path,
            hint="remove it, then requeue the job",
        ) from None
    try:
        owner = os.fstat(fd).st_uid
        if owner not in (0, job.uid):
            raise ConfigError(
                f"the job's burst-buffer directory exists and belongs to uid {owner}, not to "
                f"root or the job's user (uid {job.uid})",
                path=path,
                hint="remove it, then requeue the job; keep the parent of bb_root's {job} "
                "directory writable by root alone",
            )
        try:
            os.fchown(fd, job.uid, job.gid)
            os.fchmod(fd, 0o700)
        except OSError as exc:
            if made:  # not left root's, for the job to find unusable
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise from_oserror(
                exc,
                f"give the job's burst-buffer directory to uid {job.uid}, gid {job.gid}",
                path,
                hint="run the prolog as root (with CAP_CHOWN); " + FILE_SYSTEM_HINT,
            ) from None
    finally:
        os.close(fd)
    return path


def epilog_timeout(text: str) -> float:
    """The epilog's ``--timeout`` (``BBIO_EPILOG_TIMEOUT`` in its script) in seconds: a number
    of at least 0, ``inf`` for no limit; else a :class:`ConfigError` saying what to set."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds >= 0:
        raise ConfigError(
            f"the epilog's timeout {text!r} (--timeout, from BBIO_EPILOG_TIMEOUT in "
            "slurm-epilog.sh) is not a number of seconds of at least 0",
            hint="set BBIO_EPILOG_TIMEOUT in the epilog script or its wrapper to e.g. 3600 "
            "(inf: no limit), then run the epilog again and resume the node",
        )
    return seconds


@dataclasses.dataclass(frozen=True)
class Epilog:
    """What :func:`epilog` did: the job's directory, what could not be drained (then the
    directory is kept) and whether the directory was removed (False: also when there
    was none)."""

    path: Path
    failed: list[str]
    removed: bool


def epilog(site: Site, job: Job, timeout: float | None) -> Epilog:
    """Drain what is queued under the job's directory on this host, as the job's user,
    then remove the directory if nothing failed.  On a burst buffer short of room
    (:func:`_short_of_room`) for the drain's records, it first removes what it would
    remove after draining anyway: all but the checkpoints.  Not collective.  Raises
    :class:`UsageError` for a negative or NaN ``timeout`` (``inf``: no limit)."""
    timeout = seconds_argument("epilog: timeout", timeout)
    limited = timeout is not None and not math.isinf(timeout)
    deadline = time.monotonic() + timeout if limited else None  # one budget for both steps
    path = job_dir(site, job)
    if not os.path.lexists(path):
        return Epilog(path, [], False)
    check_parents(path)
    _detach_mounts_below(path)  # not the job's burst buffer: nothing to drain or delete there
    journals = journals_under(path)
    if journals and _short_of_room(path):
        _make_room_as(job, path, journals, deadline)
    failed = _finish_as(job, journals, timeout, deadline)
    if failed:
        return Epilog(path, failed, False)
    _detach_mounts_below(path)  # again: what another job of the user mounted meanwhile
    _remove_tree(path)
    return Epilog(path, [], True)


def mounts_below(root: Path, mountinfo: bytes) -> list[Path]:
    """The mount points strictly below ``root`` in ``mountinfo`` (the text of
    ``/proc/self/mountinfo``), deepest first."""
    unescape = re.compile(rb"\\([0-7]{3})")  # space, tab, newline, backslash: \ooo
    below = []
    for line in mountinfo.splitlines():
        fields = line.split(b" ")
        if len(fields) > 4:
            point = unescape.sub(lambda octal: bytes([int(octal[1], 8)]), fields[4])
            path = Path(os.fsdecode(point))
            if root in path.parents:
                below.append(path)
    return sorted(below, key=lambda path: len(path.parts), reverse=True)


def _detach_mounts_below(job_root: Path) -> None:
    """Lazily unmount (``MNT_DETACH``) every file system the job left mounted in its
    directory, deepest first, so that neither making room nor removing the directory
    deletes anything on them (a user's FUSE mount, dead or alive), the search for
    journals does not fail on a dead one, and the removal does not fail on their mount
    points.  Each mount point is reached from the job's directory one component at a
    time without following a symlink (the job's user may still rename and swap them,
    from another job on the node): one that moved is refused, not followed."""
    real_root = Path(os.path.realpath(job_root))  # its parents are root's: mountinfo's path
    with open("/proc/self/mountinfo", "rb") as listing:
        mountinfo = listing.read()
    libc = ctypes.CDLL(None, use_errno=True)
    for point in mounts_below(real_root, mountinfo):
        try:
            parent = _open_beneath(real_root, point.parent.relative_to(real_root).parts)
        except OSError:
            raise ConfigError(
                "a file system is mounted in the job's directory under a path that changed "
                "while the epilog ran",
                path=point,
                hint="unmount it by hand (umount -l), then run the epilog again and resume "
                "the node",
            ) from None
        try:
            beneath = f"/proc/self/fd/{parent}/{point.name}"  # no path lookup above it
            if libc.umount2(os.fsencode(beneath), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
                code = ctypes.get_errno()
                if code not in (errno.EINVAL, errno.ENOENT):  # else unmounted meanwhile
                    raise from_oserror(
                        OSError(code, os.strerror(code)),
                        "unmount what the job left mounted in its burst-buffer directory",
                        point,
                        hint="unmount it by hand (umount -l), then run the epilog again and "
                        "resume the node",
                    )
        finally:
            os.close(parent)


def _open_beneath(root: Path, parts: tuple[str, ...]) -> int:
    """A descriptor (``O_PATH``) of the directory ``root``/``parts``, each component
    opened without following a symlink; OSError if one is not a directory."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in parts:
            inner = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _short_of_room(path: Path) -> bool:
    """Has the file system of ``path`` less than :data:`DRAIN_ROOM_BYTES` or no inode left
    for a drain's records and status?"""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize < DRAIN_ROOM_BYTES or (st.f_files > 0 and st.f_favail == 0)


def _make_room_as(job: Job, job_root: Path, journals: list[Path], deadline: float | None) -> None:
    """:func:`_remove_all_but_checkpoints` in a child process as the job's user: what the
    user may delete, never through a symlink the user swaps in meanwhile (as root, the
    job's processes could have root delete files elsewhere).  Waited for until
    ``deadline`` (``time.monotonic()``; None: no limit), then killed; a failure is said
    on stderr and the drains go on (they fail, named, if the room was needed)."""
    child = multiprocessing.get_context("fork").Process(
        target=_make_room_in_child, args=(job, job_root, journals)
    )
    child.start()
    while child.exitcode is None:
        left = WAIT_SLICE_SECONDS if deadline is None else deadline - time.monotonic()
        if left <= 0:
            child.kill()
            child.join(KILLED_GRACE_SECONDS)
            print(
                f"bbio epilog: making room in {job_root} was cut short at the epilog's "
                "timeout; the drains are tried in the time left",
                file=sys.stderr,
            )
            return
        child.join(min(left, WAIT_SLICE_SECONDS))


def _make_room_in_child(job: Job, job_root: Path, journals: list[Path]) -> None:
    try:
        _become(job)
        _remove_all_but_checkpoints(job_root, journals)
    except Exception as exc:  # said in the epilog's log; the drains follow regardless
        print(f"bbio epilog: making room as {job.user} failed: {exc}", file=sys.stderr)
        sys.exit(1)


def _remove_all_but_checkpoints(job_root: Path, journals: list[Path]) -> None:
    """Remove what the epilog would remove after draining anyway, now: everything under
    ``job_root`` but the checkpointers' directories of ``journals`` (their journals and
    burst-buffer copies) and the directories above them, walked without recursion (a
    tree of any depth).  Symlinks are removed, never followed.  What cannot be removed
    is passed over; the first of those is raised at the end."""
    kept = {journal.parent for journal in journals}
    above = {parent for directory in kept for parent in directory.parents}
    waiting = [job_root]
    refused: list[BBIOError] = []
    while waiting:
        with os.scandir(waiting.pop()) as listing:
            for entry in listing:
                path = Path(entry.path)
                if path in kept:
                    continue
                if path in above and entry.is_dir(follow_symlinks=False):
                    waiting.append(path)
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        _remove_tree(path)
                    else:
                        os.unlink(path)
                except BBIOError as exc:
                    refused.append(exc)
                except OSError as exc:
                    refused.append(from_oserror(exc, "make room for the drain", path))
    if refused:
        raise refused[0]


def _remove_tree(path: Path) -> None:
    """Remove the job's directory, never following a symlink in it, whatever its depth."""

    def refused(function, failed_path: str, exc: OSError) -> None:
        raise from_oserror(
            exc,
            "remove the job's burst-buffer directory",
            failed_path,
            hint="remove it by hand (or fix its file system and run the epilog again), "
            "then resume the node",
        ) from None

    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=refused)
        else:  # the full path of what failed comes only through onerror (its exc_info)
            shutil.rmtree(
                path, onerror=lambda function, failed, info: refused(function, failed, info[1])
            )
        return
    except RecursionError:  # deeper than Python's stack: rm walks it without recursing
        pass
    removing = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", os.fspath(path)], capture_output=True, text=True
    )
    if removing.returncode != 0:
        raise ConfigError(
            f"could not remove the job's burst-buffer directory: {removing.stderr.strip()}",
            path=path,
            hint="remove it by hand, then resume the node",
        )


def _finish_as(
    job: Job, journals: list[Path], timeout: float | None, deadline: float | None
) -> list[str]:
    """:func:`admin.finish_journals` of each of ``journals`` in a child process of its
    own, up to ``DRAINS_AT_ONCE`` at a time: as the job's user when this runs as root
    (it drops root's privileges: the PFS sees the user's files), given what is left
    until the epilog's ``deadline`` (``time.monotonic()``, ``timeout`` seconds after the
    epilog began; None: no limit), and killed if it is not done
    ``ENDING_GRACE_SECONDS`` after it (a file operation that never returns, on a hung
    PFS or a FIFO the job left, can hold neither the node for ever nor the other
    journals: what it did not drain is reported and kept).  Children killed are waited
    for ``KILLED_GRACE_SECONDS`` in all: one stuck in the kernel is left."""
    if not journals:
        return []
    _load_drain_code()
    context = multiprocessing.get_context("fork")
    killed_at = None if deadline is None else deadline + ENDING_GRACE_SECONDS
    waiting, running, ended, failed = list(journals), {}, [], []
    try:
        while waiting or running:
            while waiting and len(running) < DRAINS_AT_ONCE:
                journal = waiting.pop(0)
                receiving, sending = context.Pipe(duplex=False)
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                child = context.Process(
                    target=_finish_in_child, args=(job, [journal], left, sending)
                )
                child.start()
                sending.close()
                running[receiving] = (journal, child)
            left = None if killed_at is None else killed_at - time.monotonic()
            if left is not None and left <= 0:
                break
            waiting_for = None if left is None else min(left, WAIT_SLICE_SECONDS)
            for receiving in multiprocessing.connection.wait(list(running), waiting_for):
                journal, child = running.pop(receiving)
                ended.append(child)
                try:
                    failed += receiving.recv()
                except EOFError:  # the child died before it could answer
                    failed.append(f"{journal} (the drain as user {job.user} ended abnormally)")
    finally:  # the time is up, or this process failed: no child is left draining
        cut_short = (
            "not drained"
            if killed_at is None or timeout is None
            else f"not drained within {timeout + ENDING_GRACE_SECONDS:.0f} s"
        )
        for journal, child in running.values():
            child.kill()
            ended.append(child)
            failed.append(f"{journal} ({cut_short}: killed)")
        failed += [f"{journal} ({cut_short}: not begun)" for journal in waiting]
        joined_by = time.monotonic() + KILLED_GRACE_SECONDS
        for child in ended:
            child.join(max(joined_by - time.monotonic(), 0.0))
    return failed


def _become(job: Job) -> None:
    """As root, drop to the job's user: its uid, gid and groups."""
    if os.geteuid() == 0 and job.uid != 0:
        os.setgroups(os.getgrouplist(job.user, job.gid))
        os.setgid(job.gid)
        os.setuid(job.uid)


def _finish_in_child(job: Job, journals: list[Path], timeout: float | None, sending) -> None:
    try:
        _become(job)
        sending.send(admin.finish_journals(journals, timeout))
    except Exception as exc:  # say why in the epilog's log; the parent keeps the data
        print(f"bbio epilog: draining as {job.user} failed: {exc}", file=sys.stderr)
        sending.send([f"{j} ({exc})" for j in journals])


def _load_drain_code() -> None:
    """Import what draining needs while still root, so that the child, once it is the
    user, reads nothing of the installation (which a site may keep readable by root)."""
    import h5py  # noqa: F401  (the drain describes node files with it)

    from bbio.checkpoint import globalview  # noqa: F401
