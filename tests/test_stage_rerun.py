"""Reruns after the source changed or a run failed: a copy is never written through a
stale symlink, never served as complete while it changes, and a symlink's copy points
into the copied tree; what an interrupted run left is removed, and a file replaced by a
symlink is never followed.  On 2 or 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import bbio
from bbio.stage import run as stage_run
from bbio.transfer import files
from tests.test_stage import (
    _keep_changing,
    assert_removed_during_the_copy,
    change_until_copied,
    files_under,
    same_on_all_ranks,
    stage_in_while_changing,
    two_nodes,
)
from tests.test_stage_usage import damage

pytestmark = pytest.mark.mpi(min_size=2)


def test_a_symlink_replaced_by_a_directory_in_the_source_is_not_written_through(comm, shared_tmp):
    src, config = shared_tmp / "pfs" / "swap", two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "swap"
    if comm.Get_rank() == 0:
        (src / "a").mkdir(parents=True)
        (src / "a" / "x").write_bytes(b"content of a/x")
        (src / "b").symlink_to("a")
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    if comm.Get_rank() == 0:
        (src / "b").unlink()
        (src / "b").mkdir()
        (src / "b" / "x").write_bytes(b"CONTENT OF B/X")  # the same size as a/x ...
        mtime = (src / "a" / "x").stat().st_mtime_ns  # ... and mtime, as after cp -a
        os.utime(src / "b" / "x", ns=(mtime, mtime))
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config, verify=True)
    for node in ("0", "1"):
        copy = shared_tmp / "bb" / node / "swap"
        assert not (copy / "b").is_symlink()
        assert (copy / "a" / "x").read_bytes() == b"content of a/x"
        assert (copy / "b" / "x").read_bytes() == b"CONTENT OF B/X"


def test_a_path_that_changed_kind_in_the_source_is_copied_anew_by_the_rerun(comm, shared_tmp):
    """Before, every rerun failed ("File exists", "Is a directory") until the user removed
    the copy's paths by hand, and left a temporary symlink behind."""
    src, config = shared_tmp / "pfs" / "kinds", two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "kinds"
    if comm.Get_rank() == 0:
        for directory in ("d/sub", "k", "mine"):
            (src / directory).mkdir(parents=True)
        for name in ("f", "d/g", "d/sub/h", "k/x", "mine/y"):
            (src / name).write_bytes(f"old {name}".encode())
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    node = comm.Get_rank() * 2 // comm.Get_size()
    copy = shared_tmp / "bb" / str(node) / "kinds"
    if comm.Get_rank() == 0:
        (src / "f").unlink()  # a file, now a directory
        (src / "f").mkdir()
        (src / "f" / "inner").write_bytes(b"new f/inner")
        shutil.rmtree(src / "d")  # a directory, now a file
        (src / "d").write_bytes(b"new d")
        shutil.rmtree(src / "k")  # a directory, now a symlink
        (src / "kk").mkdir()
        (src / "kk" / "x").write_bytes(b"new kk/x")
        (src / "k").symlink_to("kk")
        shutil.rmtree(src / "mine")
        (src / "mine").write_bytes(b"new mine")
    comm.Barrier()
    if comm.Get_rank() % (comm.Get_size() // 2) == 0:
        (copy / "mine" / "results.txt").write_bytes(b"the job's own file")  # not bbio's
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_in(comm, src, dst, config=config)
    message = str(refused.value)
    assert same_on_all_ranks(comm, message)
    assert "1 path(s) of the copy changed kind in the source" in message and "mine" in message
    assert (copy / "mine" / "results.txt").read_bytes() == b"the job's own file"
    assert (copy / "f").is_file() and (copy / "d" / "g").is_file()  # refused: nothing deleted
    comm.Barrier()
    if comm.Get_rank() % (comm.Get_size() // 2) == 0:
        shutil.move(copy / "mine" / "results.txt", copy.parent / "results.txt")  # as told
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config, verify=True)
    assert files_under(copy) == {
        "f/inner": b"new f/inner",
        "d": b"new d",
        "kk/x": b"new kk/x",
        "mine": b"new mine",
    }
    assert os.readlink(copy / "k") == "kk"
    assert not list(copy.rglob("*bbio-part"))


def test_a_rerun_stopped_while_it_removes_a_copy_that_changed_kind_is_finished_by_the_next(
    comm, shared_tmp, monkeypatch
):
    """The copy of a directory, now a file in the source, cannot be removed whole (as when
    the run is killed half-way).  Before, its entries had left the manifest first, and
    every rerun refused what was left of it as the job's own files."""
    src, config = shared_tmp / "pfs" / "kind", two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "kind"
    if comm.Get_rank() == 0:
        (src / "d").mkdir(parents=True)
        for i in range(5):
            (src / "d" / f"f{i}").write_bytes(b"x")
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    if comm.Get_rank() == 0:
        shutil.rmtree(src / "d")
        (src / "d").write_bytes(b"now a file")
    comm.Barrier()

    def removing_one_then_failing(path, *args, **kwargs):
        os.unlink(os.path.join(path, "f0"))
        raise PermissionError(errno.EPERM, "Operation not permitted", os.path.join(path, "f1"))

    with monkeypatch.context() as patched:
        patched.setattr(stage_run.shutil, "rmtree", removing_one_then_failing)
        with pytest.raises(bbio.PermissionDeniedError) as stopped:
            bbio.stage_in(comm, src, dst, config=config)
    assert same_on_all_ranks(comm, str(stopped.value))
    comm.Barrier()
    copy = shared_tmp / "bb" / "1" / "kind"
    left = files.read_manifest(copy)
    assert left.attrs["unfinished"] is True
    assert {"d/f1", "d/f4"} <= {e.path for e in left.entries}  # still recorded as bbio's
    bbio.stage_in(comm, src, dst, config=config, verify=True)
    assert files_under(copy) == {"d": b"now a file"}


def test_an_empty_source_directory_is_copied_with_filters_and_one_they_empty_is_not(
    comm, shared_tmp
):
    """Before, any filter also left out the directories that were empty in the source."""
    src, config = shared_tmp / "pfs" / "dirs", two_nodes(comm, shared_tmp)
    if comm.Get_rank() == 0:
        for directory in ("empty", "deep/empty", "logs", "scratch"):
            (src / directory).mkdir(parents=True)
        (src / "logs" / "x.tmp").write_bytes(b"t")
        (src / "keep.txt").write_bytes(b"k")
    comm.Barrier()
    dst = shared_tmp / "bb" / "{node}" / "dirs"
    bbio.stage_in(comm, src, dst, exclude=["*.tmp", "scratch"], config=config)
    copy = shared_tmp / "bb" / "1" / "dirs"
    made = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if ".bbio" not in p.parts)
    assert made == ["deep", "deep/empty", "empty", "keep.txt"]


@pytest.mark.timeout(120)
def test_a_rerun_that_fails_leaves_no_manifest_entry_for_what_it_changed(comm, shared_tmp):
    """The rerun commits the grown f2, then fails on a file that keeps changing: the old
    manifest must not make the reader serve the new f2's first bytes as the old f2."""
    src = shared_tmp / "pfs" / "grow"
    config = two_nodes(comm, shared_tmp, stage_round_bytes=4096)
    dst = shared_tmp / "bb" / "{node}" / "grow"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for i in range(4):
            (src / f"f{i}").write_bytes(b"C" * 1000)
        (src / "zz.log").write_bytes(b"start")
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    stop, writer = threading.Event(), None
    if comm.Get_rank() == 0:
        (src / "f2").write_bytes(b"M" * 3000)
        writer = threading.Thread(target=_keep_changing, args=(src / "zz.log", stop, None))
        writer.start()
    comm.Barrier()
    try:
        with pytest.raises(bbio.IntegrityError, match="kept changing while being copied"):
            bbio.stage_in(comm, src, dst, config=config)
    finally:
        stop.set()
        if writer:
            writer.join()
    comm.Barrier()
    for node in ("0", "1"):
        left = files.read_manifest(shared_tmp / "bb" / node / "grow")
        assert left.attrs["complete"] is False
        assert {e.path for e in left.entries if e.kind == "file"} == {"f0", "f1", "f3"}
    with bbio.open_dataset(comm, src, config=config) as ds:
        got = ds.read([2])
    assert bytes(np.asarray(got[0])) == b"M" * 3000


def test_a_relative_symlink_through_the_sources_own_name_points_into_the_copy(comm, shared_tmp):
    src, config = shared_tmp / "pfs" / "data", two_nodes(comm, shared_tmp)
    if comm.Get_rank() == 0:
        (src / "sub").mkdir(parents=True)
        (src / "f").write_bytes(b"the source's f")
        (src / "sub" / "l").symlink_to("../../data/f")
        (shared_tmp / "bb" / "0").mkdir(parents=True)
        (shared_tmp / "bb" / "0" / "data").mkdir()  # beside the copy, a tree named like SRC
        (shared_tmp / "bb" / "0" / "data" / "f").write_bytes(b"another tree's f")
    comm.Barrier()
    bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "copy", config=config)
    for node in ("0", "1"):
        link = shared_tmp / "bb" / node / "copy" / "sub" / "l"
        assert os.readlink(link) == "../f"
        assert link.read_bytes() == b"the source's f"


def test_verify_on_a_resumed_run_checks_the_copies_against_the_source(comm, shared_tmp):
    """A first run killed before its manifest: the rerun finds the copies up to date but
    knows no CRC32C for them; --verify must compare them with the source, not themselves."""
    src, config = shared_tmp / "pfs" / "resumed", two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "resumed"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for i in range(3):
            (src / f"f{i}").write_bytes(bytes([i]) * 5000)
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    damage(comm, shared_tmp / "bb" / "1" / "resumed" / "f1")
    if comm.Get_rank() == 0:
        for node in ("0", "1"):
            files.manifest_path(shared_tmp / "bb" / node / "resumed").unlink()
    comm.Barrier()
    with pytest.raises(bbio.IntegrityError, match="f1"):
        bbio.stage_in(comm, src, dst, config=config, verify=True)
    bbio.stage_in(comm, src, dst, config=config, verify=True)  # copies f1 again
    for node in ("0", "1"):
        assert (shared_tmp / "bb" / node / "resumed" / "f1").read_bytes() == b"\1" * 5000


def test_job_and_user_in_a_source_path_are_expanded(comm, shared_tmp):
    config = two_nodes(comm, shared_tmp, job_id="77", user="ada")
    src = shared_tmp / "pfs" / "ada-77"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        (src / "f").write_bytes(b"f")
    comm.Barrier()
    template = shared_tmp / "pfs" / "{user}-{job}"
    bbio.stage_in(comm, template, shared_tmp / "bb" / "{node}" / "in", config=config)
    bbio.pack(comm, template, shared_tmp / "pfs" / "packed-{job}", config=config)
    assert (shared_tmp / "bb" / "1" / "in" / "f").read_bytes() == b"f"
    assert (shared_tmp / "pfs" / "packed-77" / "bbio-pack.json").exists()


def _direction(comm, tmp: Path, direction: str, name: str) -> tuple:
    """A stage-in ("in": tmp/pfs/NAME to each node's burst buffer) or stage-out ("out":
    each node's burst buffer to tmp/pfs/NAME) of a tree called NAME: this rank's node,
    src and dst templates, the source roots this rank fills in if it is ``first`` (their
    writer), the copies' roots, and ``bbio.stage_in`` or ``bbio.stage_out``."""
    node = comm.Get_rank() // (comm.Get_size() // 2)
    on_each_node = tmp / "bb" / "{node}" / name
    if direction == "in":
        src = tmp / "pfs" / name
        copies = [tmp / "bb" / n / name for n in ("0", "1")]
        return node, src, on_each_node, [src], copies, bbio.stage_in, comm.Get_rank() == 0
    dst = tmp / "pfs" / name
    first = comm.Get_rank() % (comm.Get_size() // 2) == 0
    return node, on_each_node, dst, [tmp / "bb" / str(node) / name], [dst], bbio.stage_out, first


@pytest.mark.parametrize("direction", ["in", "out"])
def test_a_mode_change_alone_reaches_the_copy_without_copying_it(comm, shared_tmp, direction):
    """A file made private after its copy keeps its size and mtime: a rerun gives the
    copy the new mode (a copy left readable by others would leak it) without copying."""
    config = two_nodes(comm, shared_tmp)
    node, src, dst, sources, copies, stage, first = _direction(comm, shared_tmp, direction, "modes")
    if first:
        for root in sources:
            root.mkdir(parents=True)
            (root / f"secret-{node}" if direction == "out" else root / "secret").write_bytes(b"s")
    comm.Barrier()
    stage(comm, src, dst, config=config)
    comm.Barrier()
    if first:
        for root in sources:
            for secret in root.glob("secret*"):
                os.chmod(secret, 0o600)
    comm.Barrier()
    again = stage(comm, src, dst, config=config)
    assert again.files == 0
    for root in copies:
        for secret in root.glob("secret*"):
            assert secret.stat().st_mode & 0o777 == 0o600
        listed = {e.path: e.mode for e in files.read_manifest(root).entries if e.kind == "file"}
        assert listed and set(listed.values()) == {0o600}


@pytest.mark.parametrize("direction", ["in", "out"])
def test_leftovers_in_a_directory_since_removed_from_the_source_are_removed(
    comm, shared_tmp, direction
):
    """A run killed while copying old/f left old/.f.bbio-part; old/ then left the source.
    The rerun looks in the directories of the previous manifest too, not only the tree's."""
    config = two_nodes(comm, shared_tmp)
    _, src, dst, sources, copies, stage, first = _direction(comm, shared_tmp, direction, "tidy")
    if first:
        for root in sources:
            (root / "old").mkdir(parents=True)
            (root / "old" / "f").write_bytes(b"f")
            (root / "kept").write_bytes(b"kept")
            os.utime(root / "old" / "f", ns=(10**18, 10**18))
            os.utime(root / "kept", ns=(10**18, 10**18))
    comm.Barrier()
    stage(comm, src, dst, config=config)
    comm.Barrier()
    if first:
        for root in sources:
            (root / "old" / "f").unlink()
            (root / "old").rmdir()
    if comm.Get_rank() == 0:
        for copy in copies:
            (copy / "old" / ".f.bbio-part").write_bytes(b"half of a newer f")
    comm.Barrier()
    stage(comm, src, dst, config=config)
    for copy in copies:
        assert not (copy / "old" / ".f.bbio-part").exists()
        assert files_under(copy) == {"old/f": b"f", "kept": b"kept"}  # like cp: no --delete


def _change_then_link(hot: Path, copies: list[Path], secret: Path, stop: threading.Event) -> None:
    """Change ``hot`` until one of ``copies`` exists, then replace it by a symlink to
    ``secret``: the copy saw it change, its retry finds a symlink."""
    change_until_copied(hot, copies, stop)
    hot.unlink()
    hot.symlink_to(secret)


@pytest.mark.timeout(120)
def test_a_file_replaced_by_a_symlink_during_the_copy_is_not_followed(comm, shared_tmp):
    """The retry of a file that changed looks at it again without following symlinks:
    the copy must not get the bytes of a file outside the source."""
    src = shared_tmp / "pfs" / "swapped"
    secret = shared_tmp / "pfs" / "secret.txt"
    config = two_nodes(comm, shared_tmp)
    copies = [
        shared_tmp / "bb" / node / "swapped" / name
        for node in ("0", "1")
        for name in ("hot.log", ".hot.log.bbio-part")
    ]
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        secret.write_bytes(b"another user's secret")
        (src / "hot.log").write_bytes(b"start")
        (src / "calm.bin").write_bytes(b"calm")
    summary = stage_in_while_changing(
        comm, _change_then_link, (src / "hot.log", copies, secret), src, "swapped", config
    )
    assert_removed_during_the_copy(comm, summary, "hot.log")
    for node in ("0", "1"):
        copy = shared_tmp / "bb" / node / "swapped" / "hot.log"
        assert not copy.exists() and not copy.is_symlink()
