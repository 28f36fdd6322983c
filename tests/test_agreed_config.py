"""A bad setting on one rank only (its node's config file, or a ``BBIO_*`` variable of its
own): every rank raises the same ConfigError from the call that reads the settings.
Before, that rank raised alone and the others waited in the call's first collective."""

from __future__ import annotations

import pytest

import bbio
from bbio.errors import ConfigError, UsageError

pytestmark = pytest.mark.mpi(min_size=2)

BAD = "read_max_hole must be an integer, got '64k'"


@pytest.fixture
def bad_setting_on_the_last_rank(comm, monkeypatch):
    """``BBIO_READ_MAX_HOLE=64k`` (a unit bbio does not read) on the last rank alone."""
    if comm.Get_rank() == comm.Get_size() - 1:
        monkeypatch.setenv("BBIO_READ_MAX_HOLE", "64k")


def raises_everywhere(call) -> None:
    with pytest.raises(ConfigError, match=BAD):
        call()


def test_a_checkpointer(comm, shared_tmp, bad_setting_on_the_last_rank):
    raises_everywhere(
        lambda: bbio.Checkpointer(
            comm, "run", bb_root=shared_tmp / "bb" / "{node}", pfs_root=shared_tmp / "pfs"
        )
    )


def test_verify(comm, shared_tmp, bad_setting_on_the_last_rank):
    (shared_tmp / "src").mkdir(exist_ok=True)
    raises_everywhere(lambda: bbio.verify(comm, shared_tmp / "src", shared_tmp / "dst"))


@pytest.mark.parametrize("direction", ["stage_in", "stage_out"])
def test_staging(comm, shared_tmp, bad_setting_on_the_last_rank, direction):
    (shared_tmp / "src").mkdir(exist_ok=True)
    stage = getattr(bbio, direction)
    raises_everywhere(lambda: stage(comm, shared_tmp / "src", shared_tmp / "dst"))


def test_pack(comm, shared_tmp, bad_setting_on_the_last_rank):
    (shared_tmp / "src").mkdir(exist_ok=True)
    raises_everywhere(lambda: bbio.pack(comm, shared_tmp / "src", shared_tmp / "packed"))


def test_a_rank_in_another_call_makes_every_rank_say_so(comm, shared_tmp):
    """The settings are read as each call begins, in the check that every rank is in
    that call: a rank in ``verify`` while the others make a Checkpointer on the same
    communicator is every rank's UsageError."""
    (shared_tmp / "src").mkdir(exist_ok=True)
    with pytest.raises(UsageError, match="different collective calls: rank 0 in Checkpointer"):
        if comm.Get_rank() == 0:
            bbio.Checkpointer(comm, "run", bb_root=shared_tmp / "bb", pfs_root=shared_tmp / "pfs")
        else:
            bbio.verify(comm, shared_tmp / "src", shared_tmp / "dst")
