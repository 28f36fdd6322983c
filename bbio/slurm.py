"""Slurm prolog and epilog work on one node, without MPI (``bbio slurm prolog|epilog``).

Both run as root.  The prolog (before the job) creates the job's directory:
``bb_root`` up to its component that holds ``{job}``, owned by the job's user,
mode 0700; the ranks create the node directories below it (``{node}``).  The
epilog (after the job) finishes draining, as the job's user, every checkpoint
still queued in the node directories of the job on this host, then removes
the job's directory as root — unless something could not be drained: then
the data stays and the epilog fails, which makes Slurm drain the node so
that an admin can recover it.  ``jobscripts/slurm-prolog.sh`` and
``slurm-epilog.sh`` call these.
"""

from __future__ import annotations

import dataclasses
import glob
import multiprocessing
import os
import pwd
import shutil
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from bbio.checkpoint import admin
from bbio.config import Config
from bbio.errors import ConfigError


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
            uid, group = int(env["SLURM_JOB_UID"]), env.get("SLURM_JOB_GID")
            gid = int(group) if group else pwd.getpwnam(user).pw_gid
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"not run by Slurm: {exc} is missing or invalid",
                hint="run this from a Slurm Prolog/Epilog, which sets SLURM_JOB_ID, "
                "SLURM_JOB_USER and SLURM_JOB_UID",
            ) from None
        if not job_id:
            raise ConfigError("not run by Slurm: SLURM_JOB_ID is empty")
        return cls(job_id, user, uid, gid)


def job_config(config: Config, job: Job) -> Config:
    """``config`` for ``job``: {job} and {user} are Slurm's job id and user, whatever
    ``BBIO_JOB_ID`` or ``BBIO_USER`` say."""
    return dataclasses.replace(config, job_id=job.id, user=job.user)


def _job_component(config: Config) -> int:
    """The index of ``bb_root``'s path component that holds {job}; ConfigError without one."""
    parts = Path(config.bb_root).parts
    index = next((i for i, part in enumerate(parts) if "{job}" in part), None)
    if index is None:
        raise ConfigError(
            f"bb_root {config.bb_root} has no {{job}}: the Slurm hooks create and remove one "
            "directory per job, and would remove what other jobs on this node still use",
            hint="set bb_root in /etc/bbio/bbio.toml to e.g. /local/nvme/bbio/{job}",
        )
    if "{node}" in os.path.join(*parts[: index + 1]):
        raise ConfigError(
            f"bb_root {config.bb_root} has {{node}} before or beside {{job}}: the hooks "
            "cannot know which node index this host has in the job",
            hint="put {node} in a component below the job's, e.g. /local/nvme/bbio/{job}/{node}",
        )
    return index


def job_dir(config: Config) -> Path:
    """The job's directory: ``bb_root`` up to the component with {job}, expanded."""
    parts = Path(config.bb_root).parts
    return config.expand(os.path.join(*parts[: _job_component(config) + 1]))


def node_dirs(config: Config) -> list[Path]:
    """The job's node burst buffers on this host: ``bb_root`` for every {node} whose
    directory exists here (the hooks run without MPI, so they do not know the index)."""
    parts = Path(config.bb_root).parts
    index = _job_component(config)
    below = parts[index + 1 :]
    root = job_dir(config)
    if not any("{node}" in part for part in below):
        path = config.expand(config.bb_root)
        return [path] if path.is_dir() else []
    pattern = os.path.join(
        *(
            "*".join(
                glob.escape(os.fspath(config.expand(piece))) if piece else ""
                for piece in part.split("{node}")
            )
            for part in below
        )
    )
    return sorted(p for p in root.glob(pattern) if p.is_dir() and not p.is_symlink())


def prolog(config: Config, job: Job) -> Path:
    """Create the job's directory, owned by the job's user, mode 0700.  Not collective."""
    path = job_dir(job_config(config, job))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:  # a requeued job's, or the prolog run again
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise ConfigError(
                "the job's burst-buffer path exists and is not a directory",
                path=path,
                hint="remove it, then requeue the job",
            ) from None
    os.chown(path, job.uid, job.gid)
    path.chmod(0o700)
    return path


def epilog(config: Config, job: Job, timeout: float | None) -> tuple[Path, list[str]]:
    """Drain what is queued in the job's node directories on this host, as the job's
    user, then remove the job's directory if nothing failed.  Not collective.

    Returns the job's directory and what could not be drained (then the
    directory is kept).
    """
    config = job_config(config, job)
    path = job_dir(config)
    if not path.exists():
        return path, []
    failed = _finish_as(job, node_dirs(config), timeout)
    if not failed:
        shutil.rmtree(path)
    return path, failed


def _finish_as(job: Job, directories: list[Path], timeout: float | None) -> list[str]:
    """:func:`admin.finish` of ``directories``, as the job's user when this runs as root
    (a child process that drops root's privileges: the PFS sees the user's files)."""
    if os.geteuid() != 0 or job.uid == 0:
        return _finish(directories, timeout)
    _load_drain_code()
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_finish_in_child, args=(job, directories, timeout, sending))
    child.start()
    sending.close()
    try:
        failed = receiving.recv()
    except EOFError:  # the child died before it could answer
        failed = [f"{d} (the drain as user {job.user} ended abnormally)" for d in directories]
    child.join()
    return failed


def _finish(directories: list[Path], timeout: float | None) -> list[str]:
    deadline = None if timeout is None else time.monotonic() + timeout
    failed = []
    for directory in directories:
        left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
        failed += admin.finish(directory, left).failed
    return failed


def _finish_in_child(job: Job, directories: list[Path], timeout: float | None, sending) -> None:
    try:
        os.setgroups(os.getgrouplist(job.user, job.gid))
        os.setgid(job.gid)
        os.setuid(job.uid)
        sending.send(_finish(directories, timeout))
    except Exception as exc:  # say why in the epilog's log; the parent keeps the data
        print(f"bbio epilog: draining as {job.user} failed: {exc}", file=sys.stderr)
        sending.send([f"{d} ({exc})" for d in directories])


def _load_drain_code() -> None:
    """Import what draining needs while still root, so that the child, once it is the
    user, reads nothing of the installation (which a site may keep readable by root)."""
    import h5py  # noqa: F401  (the drain describes node files with it)

    from bbio.checkpoint import drain, globalview  # noqa: F401
