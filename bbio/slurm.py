"""Slurm prolog and epilog work on one node, without MPI (``bbio slurm prolog|epilog``).

Both run as root.  The prolog (before the job) creates the job's directory:
``bb_root`` up to its component that holds ``{job}``, owned by the job's user,
mode 0700; the ranks create the node directories below it (``{node}``).  The
epilog (after the job) finishes draining, as the job's user, every checkpoint
still queued anywhere under the job's directory on this host, then removes
the job's directory as root — unless something could not be drained: then
the data stays and the epilog fails, which makes Slurm drain the node so
that an admin can recover it.  ``jobscripts/slurm-prolog.sh`` and
``slurm-epilog.sh`` call these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import multiprocessing
import os
import pwd
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from bbio.checkpoint import admin, drain, layout
from bbio.config import Config
from bbio.errors import ConfigError, from_oserror


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
            uid = int(env["SLURM_JOB_UID"])
            gid = int(env["SLURM_JOB_GID"]) if env.get("SLURM_JOB_GID") else None
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"not run by Slurm: {exc} is missing or invalid",
                hint="run this from a Slurm Prolog/Epilog, which sets SLURM_JOB_ID, "
                "SLURM_JOB_USER and SLURM_JOB_UID",
            ) from None
        if not job_id:
            raise ConfigError("not run by Slurm: SLURM_JOB_ID is empty")
        if gid is not None:
            return cls(job_id, user, uid, gid)
        try:
            return cls(job_id, user, uid, pwd.getpwnam(user).pw_gid)
        except KeyError:
            raise ConfigError(
                f"the job's user {user} (SLURM_JOB_USER) is unknown on this node",
                hint="check the node's user database (getent passwd), or set SLURM_JOB_GID",
            ) from None


def job_config(config: Config, job: Job) -> Config:
    """``config`` for ``job``: {job} and {user} are Slurm's job id and user, whatever
    ``BBIO_JOB_ID`` or ``BBIO_USER`` say."""
    return dataclasses.replace(config, job_id=job.id, user=job.user)


def job_dir(config: Config) -> Path:
    """The job's directory: ``bb_root`` up to its component with {job}, expanded.

    Raises :class:`ConfigError` if ``bb_root`` has no {job}, or {node} up to it.
    """
    parts = Path(config.bb_root).parts
    index = next((i for i, part in enumerate(parts) if "{job}" in part), None)
    if index is None:
        raise ConfigError(
            f"bb_root {config.bb_root} has no {{job}}: the Slurm hooks create and remove one "
            "directory per job, and would remove what other jobs on this node still use",
            hint="set bb_root in /etc/bbio/bbio.toml to e.g. /local/nvme/bbio/{job}",
        )
    template = os.path.join(*parts[: index + 1])
    if "{node}" in template:
        raise ConfigError(
            f"bb_root {config.bb_root} has {{node}} before or beside {{job}}: the hooks "
            "cannot know which node index this host has in the job",
            hint="put {node} in a component below the job's, e.g. /local/nvme/bbio/{job}/{node}",
        )
    return config.expand(template)


def journals_under(job_root: Path) -> list[Path]:
    """Every checkpoint journal under ``job_root`` (D/ckpt/NAME/.journal at any depth: the
    hooks run without MPI and cannot know a host's node index, and a checkpointer may
    have been given its own ``bb_root`` there).  Symlinks are not followed."""
    try:
        return sorted(
            journal
            for journal in job_root.rglob(drain.JOURNAL)
            if journal.parent.parent.name == layout.CKPT_DIR
            and journal.is_dir()
            and not journal.is_symlink()
        )
    except OSError as exc:  # changed meanwhile (another job of the user's on this node)
        raise from_oserror(exc, "look for checkpoint journals in", job_root) from None


def prolog(config: Config, job: Job) -> Path:
    """Create the job's directory, owned by the job's user, mode 0700.  Not collective.

    An existing one (a requeued job's) must be a directory of root or of the
    job's user; it is changed through a descriptor opened without following
    symlinks, so that nothing swapped in meanwhile is handed to the user.
    """
    path = job_dir(job_config(config, job))
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
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
        os.fchown(fd, job.uid, job.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


@dataclasses.dataclass(frozen=True)
class Epilog:
    """What :func:`epilog` did: the job's directory, what could not be drained (then the
    directory is kept) and whether the directory was removed (False: also when there
    was none)."""

    path: Path
    failed: list[str]
    removed: bool


def epilog(config: Config, job: Job, timeout: float | None) -> Epilog:
    """Drain what is queued under the job's directory on this host, as the job's user,
    then remove the directory if nothing failed.  Not collective."""
    path = job_dir(job_config(config, job))
    if not path.exists():
        return Epilog(path, [], False)
    failed = _finish_as(job, journals_under(path), timeout)
    if failed:
        return Epilog(path, failed, False)
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise from_oserror(
            exc, "remove the job's burst-buffer directory", exc.filename or path
        ) from None
    return Epilog(path, [], True)


def _finish_as(job: Job, journals: list[Path], timeout: float | None) -> list[str]:
    """:func:`admin.finish_journals` of ``journals``, as the job's user when this runs as
    root (a child process that drops root's privileges: the PFS sees the user's files)."""
    if os.geteuid() != 0 or job.uid == 0:
        return admin.finish_journals(journals, timeout)
    _load_drain_code()
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_finish_in_child, args=(job, journals, timeout, sending))
    child.start()
    sending.close()
    try:
        failed = receiving.recv()
    except EOFError:  # the child died before it could answer
        failed = [f"{j} (the drain as user {job.user} ended abnormally)" for j in journals]
    child.join()
    return failed


def _finish_in_child(job: Job, journals: list[Path], timeout: float | None, sending) -> None:
    try:
        os.setgroups(os.getgrouplist(job.user, job.gid))
        os.setgid(job.gid)
        os.setuid(job.uid)
        sending.send(admin.finish_journals(journals, timeout))
    except Exception as exc:  # say why in the epilog's log; the parent keeps the data
        print(f"bbio epilog: draining as {job.user} failed: {exc}", file=sys.stderr)
        sending.send([f"{j} ({exc})" for j in journals])


def _load_drain_code() -> None:
    """Import what draining needs while still root, so that the child, once it is the
    user, reads nothing of the installation (which a site may keep readable by root)."""
    import h5py  # noqa: F401  (the drain describes node files with it)

    from bbio.checkpoint import globalview  # noqa: F401
