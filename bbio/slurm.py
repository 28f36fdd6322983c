"""Slurm prolog and epilog work on one node, without MPI (``bbio slurm prolog|epilog``).

The prolog (root, before the job) creates the job's burst-buffer directory,
owned by the job's user.  The epilog (as the job's user, after the job) finishes
draining every checkpoint still queued in that directory to the PFS, then
removes the directory — unless something could not be drained: then the data
stays and the epilog fails, which makes Slurm drain the node so that an admin
can recover it.  ``jobscripts/slurm-prolog.sh`` and ``slurm-epilog.sh`` call
these.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
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
        """Read ``SLURM_JOB_ID``, ``SLURM_JOB_USER``, ``SLURM_JOB_UID``, ``SLURM_JOB_GID``."""
        try:
            return cls(
                env["SLURM_JOB_ID"],
                env["SLURM_JOB_USER"],
                int(env["SLURM_JOB_UID"]),
                int(env.get("SLURM_JOB_GID", env["SLURM_JOB_UID"])),
            )
        except (KeyError, ValueError) as exc:
            raise ConfigError(
                f"not run by Slurm: {exc} is missing or invalid",
                hint="run this from a Slurm Prolog/Epilog, which sets SLURM_JOB_ID, "
                "SLURM_JOB_USER and SLURM_JOB_UID",
            ) from None


def job_bb_dir(config: Config) -> Path:
    """This node's burst-buffer directory for the job (``bb_root``; {node} as 0)."""
    return config.bb_dir(0)


def prolog(config: Config, job: Job) -> Path:
    """Create the job's burst-buffer directory, owned by the job's user, mode 0700."""
    path = job_bb_dir(config)
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, job.uid, job.gid)
    path.chmod(0o700)
    return path


def epilog(config: Config, timeout: float | None) -> tuple[Path, list[str]]:
    """Drain what is queued in the job's burst buffer, then remove it if nothing failed.

    Returns the directory and the journals that could not be drained (then the
    directory is kept).
    """
    path = job_bb_dir(config)
    if not path.exists():
        return path, []
    failed = admin.finish(path, timeout)
    if not failed:
        shutil.rmtree(path)
    return path, failed
