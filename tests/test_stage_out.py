"""Stage-out back to the PFS never silently replaces what changed there since bbio wrote or
read it, and leaves the PFS's own directories and symlinks to directories as they are.
MPI tests on 2 or 4 ranks in 2 virtual nodes; one runs the command without root's
right to change other users' directories."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import bbio
from bbio.transfer import files
from bbio.transfer.manifest import Manifest
from tests.conftest import MPI_ENV
from tests.test_stage import files_under, same_on_all_ranks, two_nodes

PENDING = Path(".bbio") / "stage-out-pending.json"


def node_leader(comm) -> int | None:
    """This rank's node when it leads it (writes that node's burst buffer), else None."""
    per_node = comm.Get_size() // 2
    return comm.Get_rank() // per_node if comm.Get_rank() % per_node == 0 else None


def write_on_every_node(comm, tmp: Path, name: str, path: str, data: bytes, mtime: int) -> None:
    """The job writes ``data`` to ``path`` in every node's burst-buffer tree ``name``, alike
    (the same bytes and mtime, so that stage-out writes it once)."""
    node = node_leader(comm)
    if node is not None:
        target = tmp / "bb" / str(node) / name / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        os.utime(target, ns=(mtime, mtime))
    comm.Barrier()


def stage_in_a_model_then_change_it(comm, tmp: Path, name: str, config) -> tuple[Path, Path]:
    """Collective: stage in tmp/pfs/NAME holding model.txt v1, then the job makes it v2 on
    every node; (the PFS tree, the burst-buffer template)."""
    pfs = tmp / "pfs" / name
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True)
        (pfs / "model.txt").write_bytes(b"model v1")
    comm.Barrier()
    bb = tmp / "bb" / "{node}" / name
    bbio.stage_in(comm, pfs, bb, config=config)
    write_on_every_node(comm, tmp, name, "model.txt", b"model v2", 10**18)
    return pfs, bb


@pytest.mark.mpi(min_size=2)
def test_a_file_edited_on_the_pfs_since_the_stage_in_is_not_replaced(comm, shared_tmp):
    """Stage in a project, edit one of its files on the PFS, stage the burst-buffer tree
    back: the edit is refused as a conflict on every rank, before anything is copied,
    unless overwrite."""
    config = two_nodes(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "proj" / "data"
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True)
        (pfs / "config.yaml").write_bytes(b"lr: 0.1\n")
        (pfs / "model.txt").write_bytes(b"model v1")
    comm.Barrier()
    bb = shared_tmp / "bb" / "{node}" / "data"
    bbio.stage_in(comm, pfs, bb, config=config)
    if comm.Get_rank() == 0:
        (pfs / "config.yaml").write_bytes(b"lr: 0.01  # the user's newer setting\n")
    write_on_every_node(comm, shared_tmp, "data", "model.txt", b"model v2", 2_000_000_000 * 10**9)
    write_on_every_node(comm, shared_tmp, "data", "results.txt", b"loss 0.3", 10**18)
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_out(comm, bb, pfs, config=config)
    message = str(refused.value)
    assert f"stage-out would replace, in {pfs}, 1 path(s) changed since bbio last" in message
    assert "read them there: config.yaml. Move aside" in message and "--overwrite" in message
    assert same_on_all_ranks(comm, message)
    assert files_under(pfs) == {
        "config.yaml": b"lr: 0.01  # the user's newer setting\n",
        "model.txt": b"model v1",
    }
    summary = bbio.stage_out(comm, bb, pfs, config=config, overwrite=True)
    assert summary.files == 3
    assert files_under(pfs) == {
        "config.yaml": b"lr: 0.1\n",
        "model.txt": b"model v2",
        "results.txt": b"loss 0.3",
    }


@pytest.mark.mpi(min_size=2)
def test_a_subdirectory_staged_out_keeps_an_edit_made_on_the_pfs(comm, shared_tmp):
    """The project was staged in whole; only its data/ goes back.  Before, no manifest was
    found for data/ (the stage-in's is the project's), and the edit was overwritten."""
    config = two_nodes(comm, shared_tmp)
    project = shared_tmp / "pfs" / "proj"
    if comm.Get_rank() == 0:
        (project / "data").mkdir(parents=True)
        (project / "code").mkdir()
        (project / "data" / "config.yaml").write_bytes(b"lr: 0.1\n")
        (project / "code" / "train.py").write_bytes(b"print()")
    comm.Barrier()
    bbio.stage_in(comm, project, shared_tmp / "bb" / "{node}" / "proj", config=config)
    if comm.Get_rank() == 0:
        (project / "data" / "config.yaml").write_bytes(b"lr: 0.01  # edited on the PFS\n")
    write_on_every_node(comm, shared_tmp, "proj", "data/results.txt", b"loss 0.3", 10**18)
    data = shared_tmp / "bb" / "{node}" / "proj" / "data"
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_out(comm, data, project / "data", config=config)
    assert "read them there: config.yaml. Move aside" in str(refused.value)
    assert same_on_all_ranks(comm, str(refused.value))
    assert files_under(project / "data") == {"config.yaml": b"lr: 0.01  # edited on the PFS\n"}
    write_on_every_node(comm, shared_tmp, "proj", "data/config.yaml", b"lr: 0.2\n", 10**18)
    if comm.Get_rank() == 0:  # the PFS edit undone: the file is bbio's version again
        (project / "data" / "config.yaml").write_bytes(b"lr: 0.1\n")
        mtime = (
            files.read_manifest(shared_tmp / "bb" / "0" / "proj")
            .by_path()["data/config.yaml"]
            .mtime_ns
        )
        os.utime(project / "data" / "config.yaml", ns=(mtime, mtime))
    comm.Barrier()
    bbio.stage_out(comm, data, project / "data", config=config)
    assert files_under(project / "data") == {
        "config.yaml": b"lr: 0.2\n",
        "results.txt": b"loss 0.3",
    }


@pytest.mark.mpi(min_size=2)
def test_a_file_edited_on_the_pfs_since_the_last_stage_out_is_not_replaced(comm, shared_tmp):
    """The destination's manifest records what stage-out wrote: a result edited on the PFS
    since is refused, whether the job changed its own copy or not; what the job changed
    and the PFS did not is copied."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    write_on_every_node(comm, shared_tmp, "out", "notes.txt", b"notes v1", 10**18)
    write_on_every_node(comm, shared_tmp, "out", "log.txt", b"epoch 1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    if comm.Get_rank() == 0:
        (pfs / "notes.txt").write_bytes(b"notes v1, annotated on the PFS")
    write_on_every_node(comm, shared_tmp, "out", "log.txt", b"epoch 1\nepoch 2", 2 * 10**18)
    for notes in (b"notes v1", b"notes v2 of the job"):
        write_on_every_node(comm, shared_tmp, "out", "notes.txt", notes, 3 * 10**18)
        with pytest.raises(bbio.AlreadyExistsError, match="1 path") as refused:
            bbio.stage_out(comm, bb, pfs, config=config)
        assert "there: notes.txt. Move aside" in str(refused.value)
    assert (pfs / "log.txt").read_bytes() == b"epoch 1"
    bbio.stage_out(comm, bb, pfs, config=config, exclude=["notes.txt"])
    assert (pfs / "log.txt").read_bytes() == b"epoch 1\nepoch 2"
    assert (pfs / "notes.txt").read_bytes() == b"notes v1, annotated on the PFS"


@contextlib.contextmanager
def second_round_fails(comm, bb, pfs, config, name: str) -> Iterator[None]:
    """Collective: a stage-out of ``bb`` to ``pfs`` (one file per round) that fails on
    ``name``, whose rename into place on the PFS fails with an I/O error; then the block.
    (A directory in its way no longer serves: stage-out refuses it before copying.)"""
    replace = os.replace

    def failing_on_name(source, target, *args, **kwargs):
        if os.fspath(target) == os.fspath(pfs / name):
            raise OSError(errno.EIO, "Input/output error", os.fspath(target))
        return replace(source, target, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "replace", failing_on_name)
        with pytest.raises(bbio.IOFailure, match=re.escape(name)):
            bbio.stage_out(comm, bb, pfs, config=config)
    yield


@pytest.mark.mpi(min_size=2)
def test_what_an_interrupted_stage_out_wrote_is_bbios_for_the_rerun(comm, shared_tmp):
    """A stage-out that fails after committing model.txt leaves no manifest: its pending
    record tells the rerun that the PFS's model.txt is bbio's (not the user's edit of the
    staged-in version), so the job's newer version replaces it."""
    config = two_nodes(comm, shared_tmp, stage_round_bytes=1)  # one file per round
    pfs, bb = stage_in_a_model_then_change_it(comm, shared_tmp, "run", config)
    write_on_every_node(comm, shared_tmp, "run", "z.txt", b"last in path order", 10**18)
    with second_round_fails(comm, bb, pfs, config, "z.txt"):
        assert (pfs / "model.txt").read_bytes() == b"model v2"
        assert (pfs / PENDING).exists()
    write_on_every_node(comm, shared_tmp, "run", "model.txt", b"model v3", 2 * 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    assert files_under(pfs) == {"model.txt": b"model v3", "z.txt": b"last in path order"}
    assert not (pfs / PENDING).exists()


@pytest.mark.mpi(min_size=2)
def test_existing_pfs_directories_and_symlinks_to_directories_are_left_alone(comm, shared_tmp):
    """A shared setgid directory keeps its mode and mtime, a symlink to a directory on
    another file system (more quota) is written through, not replaced; a directory the
    run makes gets the burst buffer's mode and mtime."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "outputs", shared_tmp / "pfs" / "outputs"
    big = shared_tmp / "lustre-bigquota" / "ckpt"
    write_on_every_node(comm, shared_tmp, "outputs", "shared/metrics.csv", b"a,b\n", 10**18)
    write_on_every_node(comm, shared_tmp, "outputs", "ckpt/step1/w.bin", b"\1" * 100, 10**18)
    write_on_every_node(comm, shared_tmp, "outputs", "new/log.txt", b"log", 10**18)
    node = node_leader(comm)
    if node is not None:
        for name in ("shared", "new"):
            directory = shared_tmp / "bb" / str(node) / "outputs" / name
            directory.chmod(0o750)
            os.utime(directory, ns=(10**18, 10**18))
    if comm.Get_rank() == 0:
        (pfs / "shared").mkdir(parents=True)
        (pfs / "shared").chmod(0o2775)
        os.utime(pfs / "shared", ns=(5 * 10**17, 5 * 10**17))
        big.mkdir(parents=True)
        (pfs / "ckpt").symlink_to(big)
    comm.Barrier()
    summary = bbio.stage_out(comm, bb, pfs, config=config)
    assert summary.files == 3
    shared = (pfs / "shared").stat()
    assert stat.S_IMODE(shared.st_mode) == 0o2775 and shared.st_mtime_ns != 10**18
    assert (pfs / "ckpt").is_symlink() and os.readlink(pfs / "ckpt") == str(big)
    assert (big / "step1" / "w.bin").read_bytes() == b"\1" * 100
    new = (pfs / "new").stat()
    assert stat.S_IMODE(new.st_mode) == 0o750 and new.st_mtime_ns == 10**18
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 0  # up to date, through it


@pytest.mark.mpi(min_size=2)
def test_a_symlink_within_the_pfs_tree_where_the_job_has_a_directory(comm, shared_tmp):
    """The user's symlink to another directory of the destination: writing through it
    would mix two directories, replacing it would drop the user's link: refused, unless
    overwrite (then replaced by a directory)."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "res", shared_tmp / "pfs" / "res"
    write_on_every_node(comm, shared_tmp, "res", "latest/out.txt", b"run 4", 10**18)
    if comm.Get_rank() == 0:
        (pfs / "run3").mkdir(parents=True)
        (pfs / "run3" / "out.txt").write_bytes(b"run 3")
        (pfs / "latest").symlink_to("run3")
    comm.Barrier()
    with pytest.raises(
        bbio.AlreadyExistsError, match=r"1 symlink\(s\) of yours .*: latest -> run3"
    ):
        bbio.stage_out(comm, bb, pfs, config=config)
    assert (pfs / "run3" / "out.txt").read_bytes() == b"run 3"
    bbio.stage_out(comm, bb, pfs, config=config, overwrite=True)
    assert not (pfs / "latest").is_symlink()
    assert files_under(pfs) == {"run3/out.txt": b"run 3", "latest/out.txt": b"run 4"}


@pytest.mark.mpi(min_size=2)
def test_the_rerun_of_an_interrupted_stage_out_knows_the_versions_it_was_replacing(
    comm, shared_tmp
):
    """Stage-out B withdraws a.txt and y.txt v1 from the manifest, then fails before it
    copies y.txt: the PFS's y.txt v1 is still bbio's (its pending record keeps the
    versions it replaces), so the rerun copies v2 over it."""
    config = two_nodes(comm, shared_tmp, stage_round_bytes=1)  # one file per round
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    for name in ("a.txt", "y.txt"):
        write_on_every_node(comm, shared_tmp, "out", name, name.encode() + b" v1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    for name in ("a.txt", "b.txt", "y.txt"):
        write_on_every_node(comm, shared_tmp, "out", name, name.encode() + b" v2", 2 * 10**18)
    with second_round_fails(comm, bb, pfs, config, "b.txt"):
        assert (pfs / "y.txt").read_bytes() == b"y.txt v1"
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 2
    assert files_under(pfs) == {"a.txt": b"a.txt v2", "b.txt": b"b.txt v2", "y.txt": b"y.txt v2"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_pfs_file_where_the_job_has_a_directory_is_refused_before_copying(
    comm, shared_tmp, overwrite
):
    """A file of the PFS where the job made a directory fails the stage-out on every rank
    before anything changes (even with overwrite): no pending record, the manifest still
    whole, nothing copied."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v2", 2 * 10**18)
    write_on_every_node(comm, shared_tmp, "out", "x/f.txt", b"f", 10**18)
    if comm.Get_rank() == 0:
        (pfs / "x").write_bytes(b"the user's file")
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_out(comm, bb, pfs, config=config, overwrite=overwrite)
    message = str(refused.value)
    assert f"cannot make, in {pfs}, 1 directory(ies) of the source where a file is: x" in message
    assert same_on_all_ranks(comm, message)
    assert not (pfs / PENDING).exists()
    assert "unfinished" not in files.read_manifest(pfs).attrs
    assert files_under(pfs) == {"a.txt": b"a v1", "x": b"the user's file"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_pfs_directory_where_the_job_has_a_file_or_symlink_is_refused_before_copying(
    comm, shared_tmp, overwrite
):
    """Before, the stage-out copied and committed other files, then failed renaming the
    file onto the directory, and every rerun failed the same way."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    write_on_every_node(comm, shared_tmp, "out", "a/big.bin", b"b" * 4096, 10**18)
    write_on_every_node(comm, shared_tmp, "out", "a/res", b"result", 10**18)
    node = node_leader(comm)
    if node is not None:
        (shared_tmp / "bb" / str(node) / "out" / "a" / "link").symlink_to("big.bin")
    if comm.Get_rank() == 0:
        (pfs / "a" / "res").mkdir(parents=True)  # the user's directories
        (pfs / "a" / "link").mkdir()
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_out(comm, bb, pfs, config=config, overwrite=overwrite)
    message = str(refused.value)
    assert same_on_all_ranks(comm, message)
    expected = "2 file(s) or symlink(s) of the source where a directory is: a/link; a/res"
    assert f"cannot make, in {pfs}, {expected}" in message, message
    assert "--overwrite replaces neither" in message
    assert sorted(os.listdir(pfs)) == ["a"] and sorted(os.listdir(pfs / "a")) == ["link", "res"]


@pytest.mark.mpi(min_size=2)
def test_a_users_symlink_where_the_job_has_a_file_is_replaced_only_with_overwrite(comm, shared_tmp):
    """``data.bin`` on the PFS is the user's symlink to a file elsewhere: the job's file of
    that name does not silently replace it; overwrite does, leaving its target alone."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    elsewhere = shared_tmp / "elsewhere.bin"
    write_on_every_node(comm, shared_tmp, "out", "data.bin", b"the job's", 10**18)
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a", 10**18)
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True)
        elsewhere.write_bytes(b"the user's big file")
        (pfs / "data.bin").symlink_to(elsewhere)
    comm.Barrier()
    with pytest.raises(
        bbio.AlreadyExistsError, match=rf"1 symlink\(s\) of yours .*: data\.bin -> {elsewhere}"
    ):
        bbio.stage_out(comm, bb, pfs, config=config)
    assert (pfs / "data.bin").is_symlink() and not (pfs / "a.txt").exists()
    assert bbio.stage_out(comm, bb, pfs, config=config, overwrite=True).files == 2
    assert files_under(pfs) == {"a.txt": b"a", "data.bin": b"the job's"}
    assert elsewhere.read_bytes() == b"the user's big file"


@pytest.mark.mpi(min_size=2)
def test_a_damaged_stage_in_manifest_in_the_burst_buffer_is_no_record(comm, shared_tmp):
    """The burst-buffer tree's own stage-in manifest is only an extra record: one that is
    not valid JSON is ignored (with a warning), and the stage-out goes on."""
    config = two_nodes(comm, shared_tmp)
    pfs, bb = stage_in_a_model_then_change_it(comm, shared_tmp, "data", config)
    node = node_leader(comm)
    if node is not None:
        files.manifest_path(shared_tmp / "bb" / str(node) / "data").write_text("{damaged")
    comm.Barrier()
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 1
    assert files_under(pfs) == {"model.txt": b"model v2"}


@pytest.mark.mpi(min_size=2)
def test_a_pfs_file_of_mtime_0_is_bbios_damaged_copy_only_if_stage_out_wrote_it(comm, shared_tmp):
    """Verify marks a damaged copy with mtime 0 and keeps its size: a PFS file of mtime 0
    (a reproducible archive's) is the user's when bbio only read that path (stage-in), or
    when stage-out wrote another size there."""
    config = two_nodes(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "proj"
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True)
        (pfs / "tool.txt").write_bytes(b"tool 1.0")
        os.utime(pfs / "tool.txt", ns=(10**18, 10**18))
    comm.Barrier()
    bb = shared_tmp / "bb" / "{node}" / "proj"
    bbio.stage_in(comm, pfs, bb, config=config)
    write_on_every_node(comm, shared_tmp, "proj", "r.txt", b"abc", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config, exclude=["tool.txt"])
    if comm.Get_rank() == 0:  # the user unpacks a reproducible archive over both
        for name, data in (("tool.txt", b"tool 2.0"), ("r.txt", b"hello")):
            (pfs / name).write_bytes(data)
            os.utime(pfs / name, ns=(0, 0))
    write_on_every_node(comm, shared_tmp, "proj", "tool.txt", b"tool 1.1", 2 * 10**18)
    write_on_every_node(comm, shared_tmp, "proj", "r.txt", b"xyz", 2 * 10**18)
    with pytest.raises(bbio.AlreadyExistsError, match=r"2 path\(s\) changed .*: r\.txt; tool"):
        bbio.stage_out(comm, bb, pfs, config=config)
    assert files_under(pfs) == {"tool.txt": b"tool 2.0", "r.txt": b"hello"}


@pytest.mark.mpi(min_size=2)
def test_a_pending_record_left_after_the_manifest_was_written_is_spent(comm, shared_tmp):
    """A stage-out stopped between writing its manifest and removing its pending record
    leaves a record that the manifest names: the next run does not take the directories
    it lists for ones it made, and leaves the user's mode and mtime on them."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    write_on_every_node(comm, shared_tmp, "out", "new/log.txt", b"log", 10**18)
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    if comm.Get_rank() == 0:  # what the run left had it stopped before removing its record
        manifest = files.read_manifest(pfs)
        token = {"token": manifest.attrs.get("pending")}
        files.write_manifest(pfs, Manifest("stage-out", manifest.entries, token), PENDING.stem)
        (pfs / "new").chmod(0o2775)  # the user's, since
        os.utime(pfs / "new", ns=(5 * 10**17, 5 * 10**17))
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v2", 2 * 10**18)
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 1
    new = (pfs / "new").stat()
    assert (stat.S_IMODE(new.st_mode), new.st_mtime_ns) == (0o2775, 5 * 10**17)
    assert not (pfs / PENDING).exists()


# ------------------------------------------------- as a user who may not chmod others' files


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temporary directory under /tmp that the unprivileged command may use."""
    path = Path(tempfile.mkdtemp(prefix="bbio-test-", dir="/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path)


# Root without the capabilities to bypass permission checks and to chmod/utime others' files.
DROP = "-dac_override,-dac_read_search,-fowner"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a colleague's directory needs root")
def test_a_colleagues_directory_in_the_destination_blocks_nothing(open_tmp):
    """``outputs/shared`` belongs to a colleague (mode 2777): chmod and utime of it fail
    with EPERM, so stage-out must not try them, and writes its manifest.  A file edited
    on the PFS since is then refused, and replaced with ``--overwrite``."""
    for node in ("0", "1"):
        (open_tmp / "bb" / node / "outputs" / "shared").mkdir(parents=True)
        (open_tmp / "bb" / node / "outputs" / "shared" / "r.txt").write_bytes(b"node " + b"x")
        os.utime(open_tmp / "bb" / node / "outputs" / "shared" / "r.txt", ns=(10**18, 10**18))
    pfs = open_tmp / "pfs" / "outputs"
    (pfs / "shared").mkdir(parents=True)
    os.chown(pfs / "shared", 65534, 65534)
    (pfs / "shared").chmod(0o2777)
    env = {**os.environ, **MPI_ENV, "BBIO_RANKS_PER_NODE": "1", "BBIO_PROGRESS": "never"}
    command = ["setpriv", f"--bounding-set={DROP}", f"--inh-caps={DROP}", "--"]
    command += ["mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-out"]
    command += [str(open_tmp / "bb" / "{node}" / "outputs"), str(pfs)]

    def stage_out(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, *options], capture_output=True, text=True, env=env, timeout=120, cwd=open_tmp
        )

    done = stage_out()
    assert done.returncode == 0, done.stdout + done.stderr
    shared = (pfs / "shared").stat()
    assert (shared.st_uid, stat.S_IMODE(shared.st_mode)) == (65534, 0o2777)
    assert files.read_manifest(pfs) is not None
    (pfs / "shared" / "r.txt").write_bytes(b"edited on the PFS")
    refused = stage_out()
    assert refused.returncode == 1
    assert "1 path(s) changed since bbio last wrote or read" in refused.stderr
    assert "shared/r.txt" in refused.stderr and "Traceback" not in refused.stderr
    done = stage_out("--overwrite")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (pfs / "shared" / "r.txt").read_bytes() == b"node x"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the capabilities needs root")
def test_a_read_only_directory_copy_that_became_a_file_is_replaced_without_privileges(open_tmp):
    """Stage-in copies a 0555 directory as 0555; when the source's directory becomes a
    file, the rerun must delete the copy (before, rmtree failed: Permission denied)."""
    src = open_tmp / "src"
    (src / "d" / "sub").mkdir(parents=True)
    (src / "d" / "sub" / "h").write_bytes(b"old")
    for directory in (src / "d" / "sub", src / "d"):
        directory.chmod(0o555)
    env = {**os.environ, **MPI_ENV, "BBIO_RANKS_PER_NODE": "1", "BBIO_PROGRESS": "never"}
    command = ["setpriv", f"--bounding-set={DROP}", f"--inh-caps={DROP}", "--"]
    command += ["mpirun", "-n", "2", sys.executable, "-m", "bbio", "stage-in"]
    command += [str(src), str(open_tmp / "bb" / "{node}" / "x")]

    def stage_in() -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    done = stage_in()
    assert done.returncode == 0, done.stdout + done.stderr
    copy = open_tmp / "bb" / "0" / "x"
    assert stat.S_IMODE((copy / "d" / "sub").stat().st_mode) == 0o555
    for directory in (src / "d", src / "d" / "sub"):
        directory.chmod(0o755)
    shutil.rmtree(src / "d")
    (src / "d").write_bytes(b"now a file")
    done = stage_in()
    assert done.returncode == 0, done.stdout + done.stderr
    assert (copy / "d").read_bytes() == b"now a file"
    assert [e.path for e in files.read_manifest(copy).entries if e.kind != "dir"] == ["d"]
