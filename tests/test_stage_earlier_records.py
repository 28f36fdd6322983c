"""A stage-out keeps the records of what earlier stage-outs wrote at paths it did not
write (left out by its filters, skipped, gone from the burst buffers, another job's), so
a later stage-out still refuses to replace a PFS edit of those files.  Before, the new
manifest listed only its own tree, and the next full stage-out silently reverted the
edit.  Pure tests of the merge, then MPI tests on 2 or 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import bbio
from bbio.errors import IntegrityError
from bbio.stage import plan
from bbio.transfer import files
from bbio.transfer.manifest import DIR, FILE, SYMLINK, Entry, Manifest
from tests.test_stage import files_under, same_on_all_ranks, two_nodes
from tests.test_stage_out import PENDING, node_leader, write_on_every_node

LATER = 2 * 10**18


def f(path: str, size: int, mtime: int = 1, crc: int | None = None) -> Entry:
    return Entry(path, FILE, size=size, mtime_ns=mtime, crc32c=crc)


# ------------------------------------------------------------------ pure merge


def test_the_versions_a_run_did_not_write_are_carried_in_path_order_once_each():
    manifest = [Entry("ckpt", DIR), f("ckpt/c1", 3, crc=7), f("config.yaml", 8, crc=9)]
    earlier = [f("gone.txt", 2), Entry("latest", SYMLINK, target="ckpt/c1")]
    pending = [f("config.yaml", 8, crc=9), f("config.yaml", 12, mtime=5), Entry("new", DIR)]
    carried = plan.carried_versions([*manifest, *earlier, *pending], {"ckpt", "ckpt/c1"})
    assert carried == [
        f("config.yaml", 8, crc=9),
        f("config.yaml", 12, mtime=5),
        f("gone.txt", 2),
        Entry("latest", SYMLINK, target="ckpt/c1"),
    ]
    assert plan.carried_versions(manifest, {e.path for e in manifest}) == []


def test_earlier_versions_survive_the_manifests_json_and_a_damaged_list_is_named():
    kept = [f("config.yaml", 8, crc=9), Entry("latest", SYMLINK, target="a")]
    document = Manifest("stage-out", [f("a", 1)], {plan.EARLIER: [e.to_json() for e in kept]})
    back = Manifest.from_json(document.to_json(), "here")
    assert plan.earlier_versions(back) == kept
    assert plan.earlier_versions(Manifest("stage-out", [f("a", 1)])) == []
    assert plan.earlier_versions(None) == []
    for damaged in ({"path": "x"}, [{"kind": FILE}], ["config.yaml"]):
        manifest = Manifest("stage-out", [], {plan.EARLIER: damaged})
        with pytest.raises(IntegrityError, match="damaged manifest: its 'earlier'") as caught:
            plan.earlier_versions(manifest, "/pfs/out/.bbio/manifest.json")
        assert caught.value.path == "/pfs/out/.bbio/manifest.json"


# ------------------------------------------------------------------ under MPI


def refused_paths(comm, bb, pfs, config) -> str:
    """Collective: the stage-out of ``bb`` to ``pfs``, which must refuse what changed on
    the PFS; the part of its message (the same on every rank) that names the paths."""
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.stage_out(comm, bb, pfs, config=config)
    message = str(refused.value)
    assert same_on_all_ranks(comm, message)
    named = message.split("changed since bbio last wrote or read them there: ")[1]
    return named.split(". Move aside")[0]


def edit_on_the_pfs(comm, path: Path, data: bytes) -> None:
    """Collective: the user rewrites ``path`` on the PFS."""
    if comm.Get_rank() == 0:
        path.write_bytes(data)
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_filtered_stage_out_keeps_the_records_of_what_it_left_out(comm, shared_tmp):
    """The reviewer's case: stage out everything, then only ckpt/*, edit config.yaml on
    the PFS, stage out everything: the edit is refused, as without the filtered run;
    ``bbio verify`` checks only what the filtered run listed."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "run", shared_tmp / "pfs" / "run"
    write_on_every_node(comm, shared_tmp, "run", "config.yaml", b"lr: 0.1\n", 10**18)
    write_on_every_node(comm, shared_tmp, "run", "ckpt/c1", b"c1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    write_on_every_node(comm, shared_tmp, "run", "ckpt/c2", b"c2", LATER)
    write_on_every_node(comm, shared_tmp, "run", "config.yaml", b"lr: 0.2\n", LATER)
    assert bbio.stage_out(comm, bb, pfs, config=config, include=["ckpt/*"]).files == 1
    edit_on_the_pfs(comm, pfs / "config.yaml", b"lr: 0.05  # tuned by hand\n")
    assert refused_paths(comm, bb, pfs, config) == "config.yaml"
    assert (pfs / "config.yaml").read_bytes() == b"lr: 0.05  # tuned by hand\n"
    manifest = files.read_manifest(pfs)
    assert "config.yaml" not in manifest.by_path()
    assert [e.path for e in plan.earlier_versions(manifest)] == ["config.yaml"]
    assert bbio.verify(comm, bb, pfs, config=config).problems == []  # what it lists only
    bbio.stage_out(comm, bb, pfs, config=config, overwrite=True)
    assert files_under(pfs) == {"config.yaml": b"lr: 0.2\n", "ckpt/c1": b"c1", "ckpt/c2": b"c2"}
    assert plan.earlier_versions(files.read_manifest(pfs)) == []


@pytest.mark.mpi(min_size=2)
def test_two_jobs_staging_out_disjoint_files_into_one_directory_keep_each_others(comm, shared_tmp):
    """Job A writes a/, job B then b/ into one results directory: A's next stage-out still
    refuses an edit of a/ made on the PFS, and replaces what it wrote there unchanged."""
    config = two_nodes(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "results"
    job_a, job_b = (shared_tmp / "bb" / "{node}" / name for name in ("job-a", "job-b"))
    write_on_every_node(comm, shared_tmp, "job-a", "a/loss.csv", b"a 1", 10**18)
    write_on_every_node(comm, shared_tmp, "job-a", "a/notes.txt", b"notes a", 10**18)
    write_on_every_node(comm, shared_tmp, "job-b", "b/loss.csv", b"b 1", 10**18)
    bbio.stage_out(comm, job_a, pfs, config=config)
    bbio.stage_out(comm, job_b, pfs, config=config)
    edit_on_the_pfs(comm, pfs / "a" / "notes.txt", b"notes a, annotated on the PFS")
    write_on_every_node(comm, shared_tmp, "job-a", "a/loss.csv", b"a 1 2", LATER)
    write_on_every_node(comm, shared_tmp, "job-a", "a/notes.txt", b"notes a 2", LATER)
    assert refused_paths(comm, job_a, pfs, config) == "a/notes.txt"
    assert bbio.stage_out(comm, job_a, pfs, config=config, exclude=["a/notes.txt"]).files == 1
    assert files_under(pfs) == {
        "a/loss.csv": b"a 1 2",
        "a/notes.txt": b"notes a, annotated on the PFS",
        "b/loss.csv": b"b 1",
    }


@pytest.mark.mpi(min_size=2)
def test_a_file_gone_from_the_burst_buffer_for_a_run_keeps_its_record(comm, shared_tmp):
    """The job removes log.txt, stages out, then writes log.txt again: its PFS copy,
    edited since, is still refused."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    write_on_every_node(comm, shared_tmp, "out", "log.txt", b"epoch 1", 10**18)
    write_on_every_node(comm, shared_tmp, "out", "w.bin", b"w1", 10**18)
    bbio.stage_out(comm, bb, pfs, config=config)
    node = node_leader(comm)
    if node is not None:
        (shared_tmp / "bb" / str(node) / "out" / "log.txt").unlink()
    comm.Barrier()
    write_on_every_node(comm, shared_tmp, "out", "w.bin", b"w2", LATER)
    assert bbio.stage_out(comm, bb, pfs, config=config).files == 1
    edit_on_the_pfs(comm, pfs / "log.txt", b"epoch 1, annotated")
    write_on_every_node(comm, shared_tmp, "out", "log.txt", b"epoch 1\nepoch 2", LATER)
    assert refused_paths(comm, bb, pfs, config) == "log.txt"
    assert files_under(pfs) == {"log.txt": b"epoch 1, annotated", "w.bin": b"w2"}


KEEP_CHANGING = """
import os, sys
path, counter = sys.argv[1], 0
while True:
    counter += 1
    with open(path, "ab") as f:
        f.write(b"+")
    os.utime(path, ns=(counter, counter))
"""


def while_changing(comm, hot: Path, call) -> None:
    """Collective: run ``call()`` while a process of rank 0's keeps changing ``hot``
    (size and mtime) as fast as it can: every copy of it sees a change (a thread of the
    rank's, slowed by its interpreter lock, left some copies whole)."""
    writer = None
    if comm.Get_rank() == 0:
        writer = subprocess.Popen([sys.executable, "-c", KEEP_CHANGING, str(hot)])
        started = hot.stat().st_mtime_ns
        while hot.stat().st_mtime_ns == started:  # it runs
            time.sleep(0.001)
    comm.Barrier()
    try:
        call()
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_file_a_stage_out_skipped_keeps_its_record(comm, shared_tmp):
    """hot.log keeps changing during a stage-out with skip_unreadable: it is skipped, and
    its PFS copy, edited since, is refused by the next stage-out."""
    config = two_nodes(comm, shared_tmp)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    hot = shared_tmp / "bb" / "0" / "out" / "hot.log"
    write_on_every_node(comm, shared_tmp, "out", "calm.txt", b"calm", 10**18)
    if comm.Get_rank() == 0:  # on node 0 only
        hot.write_bytes(b"start")
    comm.Barrier()
    bbio.stage_out(comm, bb, pfs, config=config)

    def skipping() -> None:
        summary = bbio.stage_out(comm, bb, pfs, config=config, skip_unreadable=True)
        assert [s.path for s in summary.skipped] == ["hot.log"]

    while_changing(comm, hot, skipping)
    assert "hot.log" not in files.read_manifest(pfs).by_path()
    edit_on_the_pfs(comm, pfs / "hot.log", b"start, annotated")
    assert refused_paths(comm, bb, pfs, config) == "hot.log"
    assert (pfs / "hot.log").read_bytes() == b"start, annotated"


@pytest.mark.mpi(min_size=2)
def test_what_a_failed_stage_out_was_replacing_is_kept_by_a_filtered_one(comm, shared_tmp):
    """A stage-out fails on a file that keeps changing after committing a.txt v2 (one file
    per round): its pending record knows a.txt v1 and v2.  A filtered stage-out then
    finishes and removes that record: the manifest keeps those versions, so the full
    stage-out after a PFS edit of a.txt refuses it, and replaces hot.log, bbio's."""
    config = two_nodes(comm, shared_tmp, stage_round_bytes=1)
    bb, pfs = shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "out"
    hot = shared_tmp / "bb" / "0" / "out" / "hot.log"
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v1", 10**18)
    if comm.Get_rank() == 0:
        hot.write_bytes(b"start")
    comm.Barrier()
    bbio.stage_out(comm, bb, pfs, config=config)
    write_on_every_node(comm, shared_tmp, "out", "a.txt", b"a v2", LATER)

    def failing() -> None:
        with pytest.raises(bbio.IntegrityError, match=r"kept changing .*: hot\.log"):
            bbio.stage_out(comm, bb, pfs, config=config)

    while_changing(comm, hot, failing)
    assert (pfs / PENDING).exists() and (pfs / "a.txt").read_bytes() == b"a v2"
    write_on_every_node(comm, shared_tmp, "out", "new/n.txt", b"n", LATER)
    assert bbio.stage_out(comm, bb, pfs, config=config, include=["new/*"]).files == 1
    assert not (pfs / PENDING).exists()
    edit_on_the_pfs(comm, pfs / "a.txt", b"a v2, annotated")
    assert refused_paths(comm, bb, pfs, config) == "a.txt"
    assert bbio.stage_out(comm, bb, pfs, config=config, exclude=["a.txt"]).files == 1
    assert files_under(pfs) == {
        "a.txt": b"a v2, annotated",
        "hot.log": hot.read_bytes(),
        "new/n.txt": b"n",
    }
