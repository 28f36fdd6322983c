"""Staging onto a file system that keeps mtimes in whole seconds, as Lustre, BeeGFS and ext4
with 128-byte inodes do: reruns find bbio's own copies up to date, stage-out does not take
them for the user's, and verify's mark of a damaged copy stays apart from its source's
mtime.  MPI tests on 2 or 4 ranks in 2 virtual nodes, on a loop-mounted ext4 with 128-byte
inodes (skipped where it cannot be mounted: root and a loop device are needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import bbio
from bbio.stage import plan
from bbio.stage import run as stage_run
from tests.test_stage import files_under, same_on_all_ranks, two_nodes
from tests.test_stage_out import write_on_every_node
from tests.test_stage_usage import damage

pytestmark = pytest.mark.mpi(min_size=2)

SECOND = 1_000_000_000
MTIME_NS = 1_700_000_000_123_456_789  # sub-second digits a whole-second file system drops


def _mount_coarse_ext4(image: Path, mount: Path) -> str | None:
    """Mount an ext4 of 128-byte inodes (mtimes in whole seconds) at ``mount``; None, or
    why it cannot be."""
    if os.geteuid() != 0:
        return "mounting a loop device needs root"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed"
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    mount.mkdir()
    for command in (
        ["mkfs.ext4", "-q", "-I", "128", "-F", str(image)],
        ["mount", "-o", "loop", str(image), str(mount)],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(command[:2])} failed: {done.stderr.strip()}"
    return None


@pytest.fixture
def coarse(comm, shared_tmp):
    """A directory on an ext4 of 128-byte inodes, mounted by rank 0 for the test."""
    mount = shared_tmp / "coarse"
    problem = _mount_coarse_ext4(shared_tmp / "coarse.img", mount) if comm.rank == 0 else None
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        pytest.skip(problem)
    yield mount
    comm.Barrier()
    if comm.rank == 0:
        subprocess.run(["umount", str(mount)], check=True)


def test_the_probe_finds_whole_seconds_and_leaves_nothing(comm, coarse):
    if comm.rank == 0:
        assert stage_run.probe_mtime_granularity(coarse) == SECOND
        assert stage_run.probe_mtime_granularity(coarse / "not yet") == 1  # nothing to compare
        assert sorted(os.listdir(coarse)) == ["lost+found"]


def test_stage_in_again_onto_whole_seconds_copies_nothing(comm, shared_tmp, coarse):
    """Before, every rerun copied every file again; and a directory of the copy now a
    file in the source was taken for the user's, and refused."""
    config = two_nodes(comm, shared_tmp)
    src, dst = shared_tmp / "pfs" / "src", coarse / "{node}" / "data"
    if comm.rank == 0:
        (src / "d").mkdir(parents=True)
        for name in ("a", "d/b", "d/c"):
            (src / name).write_bytes(name.encode())
            os.utime(src / name, ns=(MTIME_NS, MTIME_NS))
    comm.Barrier()
    assert bbio.stage_in(comm, src, dst, config=config).files == 6  # 3 on each of 2 nodes
    again = bbio.stage_in(comm, src, dst, verify=True, config=config)
    assert (again.files, again.unchanged) == (0, 6)
    if comm.rank == 0:
        shutil.rmtree(src / "d")
        (src / "d").write_bytes(b"now a file")
    comm.Barrier()
    assert bbio.stage_in(comm, src, dst, config=config).files == 2
    assert files_under(coarse / "1" / "data") == {"a": b"a", "d": b"now a file"}


def test_stage_out_again_onto_whole_seconds_is_no_change_of_the_users(comm, shared_tmp, coarse):
    """Before, the second stage-out refused bbio's own files ("changed since bbio last wrote
    them"); a damaged copy is still marked, and copied again by the next run."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", coarse / "out"
    for name in ("r0.txt", "r1.txt"):
        write_on_every_node(comm, shared_tmp, "out", name, f"result {name}".encode(), MTIME_NS)
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 2
    again = bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    assert (again.files, again.unchanged) == (0, 2)
    damage(comm, pfs / "r1.txt")
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    assert same_on_all_ranks(comm, str(info.value)) and "r1.txt" in str(info.value)
    assert (pfs / "r1.txt").stat().st_mtime_ns == 0
    repaired = bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    assert repaired.files == 1
    assert files_under(pfs) == {"r0.txt": b"result r0.txt", "r1.txt": b"result r1.txt"}
    assert (pfs / "r1.txt").stat().st_mtime_ns == MTIME_NS - MTIME_NS % SECOND


def test_stage_out_again_through_a_symlink_onto_whole_seconds_copies_nothing(
    comm, shared_tmp, coarse
):
    """The PFS directory keeps nanoseconds, but the user's symlink in it, which stage-out
    writes through, leads to a whole-second file system.  Before, only DST was probed:
    every rerun refused bbio's own files there as changed on the PFS."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    for name in ("ckpt/a.txt", "ckpt/b.txt"):
        write_on_every_node(comm, shared_tmp, "out", name, name.encode(), MTIME_NS)
    if comm.rank == 0:
        (coarse / "ckpt").mkdir()
        pfs.mkdir(parents=True)
        (pfs / "ckpt").symlink_to(coarse / "ckpt")
    comm.Barrier()
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 2
    again = bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    assert (again.files, again.unchanged) == (0, 2)
    assert (pfs / "ckpt").is_symlink()
    assert sorted(os.listdir(coarse / "ckpt")) == ["a.txt", "b.txt"]  # no probe left


def test_a_copy_marked_damaged_before_its_destination_existed_is_copied_again(
    comm, shared_tmp, coarse, monkeypatch
):
    """The first stage-out creates DST on whole seconds (probed as exact: it did not exist
    yet), and verify marks a damaged copy of a file of mtime 0 (tar --mtime=@0).  Before,
    the mark (1 ns) was kept as 0, the source's mtime at the rerun's granularity (1 s):
    the damaged copy was taken as up to date and recorded with its bad CRC32C."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", coarse / "out"
    write_on_every_node(comm, shared_tmp, "out", "r1.txt", b"result r1 of the job", 0)
    verify_copies = stage_run._verify_copies

    def damaging_first(comm_, root, *args, **kwargs):
        damage(comm_, root / "r1.txt")
        return verify_copies(comm_, root, *args, **kwargs)

    monkeypatch.setattr(stage_run, "_verify_copies", damaging_first)
    with pytest.raises(bbio.IntegrityError):
        bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    monkeypatch.undo()
    repaired = bbio.stage_out(comm, bb, pfs, verify=True, config=config)
    assert (repaired.files, repaired.unchanged) == (1, 0)
    assert files_under(pfs) == {"r1.txt": b"result r1 of the job"}


def test_staging_an_unchanged_copy_kept_in_whole_seconds_back_out_rewrites_nothing(
    comm, shared_tmp, coarse
):
    """A burst buffer of whole seconds: the copies carry their sources' mtimes truncated,
    the PFS originals their nanoseconds.  Before, the first stage-out of the unchanged copy
    back onto the PFS rewrote every file there (compared at the PFS's granularity)."""
    config = two_nodes(comm, shared_tmp)
    pfs, bb = shared_tmp / "pfs" / "proj", coarse / "{node}" / "proj"
    names = [f"f{i}" for i in range(plan.MTIME_INFERENCE_MIN_FILES)]
    if comm.rank == 0:
        pfs.mkdir(parents=True)
        for name in names:
            (pfs / name).write_bytes(name.encode())
            os.utime(pfs / name, ns=(MTIME_NS, MTIME_NS))
    comm.Barrier()
    bbio.stage_in(comm, pfs, bb, config=config)
    for _ in range(2):
        back = bbio.stage_out(comm, bb, pfs, config=config)
        assert (back.files, back.unchanged) == (0, len(names))
    assert {(pfs / name).stat().st_mtime_ns for name in names} == {MTIME_NS}
