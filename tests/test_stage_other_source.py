"""A stage-in into a copy of another source copies everything anew: files of the same
names, sizes and mtimes hold other bytes.  Before, they were taken as up to date, kept
the other source's CRC32C, and ``--verify`` passed on the wrong bytes.  Pure tests of the
rule, then MPI tests on 2 or 4 ranks in 2 virtual nodes (one on a single node)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import bbio
from bbio.config import Config
from bbio.stage import plan, registry
from bbio.transfer import files
from bbio.transfer.manifest import FILE, Entry, Manifest
from tests.test_stage import files_under, two_nodes
from tests.test_stage_earlier_records import while_changing

MTIME = 315_532_800 * 10**9  # 1980-01-01, as a reproducible archive unpacks them
NAMES = ("a.bin", "b.bin", "z.bin")


def test_only_a_stage_in_of_the_same_source_vouches_for_the_copy():
    entries = [Entry("a.bin", FILE, size=4, mtime_ns=MTIME, crc32c=1)]
    assert plan.copy_of(None, "/pfs/v2")  # a first run, or one killed before its manifest
    assert plan.copy_of(Manifest("stage-in", entries, {"source": "/pfs/v2"}), "/pfs/v2")
    assert not plan.copy_of(Manifest("stage-in", entries, {"source": "/pfs/v1"}), "/pfs/v2")
    assert not plan.copy_of(Manifest("stage-in", entries), "/pfs/v2")
    assert not plan.copy_of(Manifest("stage-out", entries, {"source": "/pfs/v2"}), "/pfs/v2")
    mixed = {"source": "/pfs/v1", plan.MIXED_SOURCES: True}  # a switch to v2 that failed
    assert not plan.copy_of(Manifest("stage-in", entries, mixed), "/pfs/v1")


def make_version(comm, root: Path, byte: int, names=NAMES) -> None:
    """Collective: rank 0 writes ``names`` under ``root``, 4 KiB of ``byte`` each, all with
    the same mtime (every version has the same names, sizes and mtimes)."""
    if comm.Get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for name in names:
            (root / name).write_bytes(bytes([byte]) * 4096)
            os.utime(root / name, ns=(MTIME, MTIME))
    comm.Barrier()


def node_copies(tmp: Path, name: str) -> dict[str, dict[str, bytes]]:
    return {node: files_under(tmp / "bb" / node / name) for node in ("0", "1")}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_stage_in_of_another_source_into_a_copy_copies_it_anew(comm, shared_tmp, mode):
    """The reviewer's case: stage in v1 (bytes 1), then v2 (bytes 2, same names, sizes and
    mtimes) into the same directories with verify: every file is copied again, the
    manifest, the registry and ``bbio verify`` say v2; then the rerun of v2 copies
    nothing."""
    config = two_nodes(comm, shared_tmp)
    v1, v2 = shared_tmp / "pfs" / "v1", shared_tmp / "pfs" / "v2"
    make_version(comm, v1, 1)
    make_version(comm, v2, 2)
    dst = shared_tmp / "bb" / "{node}" / "data"
    first = bbio.stage_in(comm, v1, dst, mode=mode, config=config)
    summary = bbio.stage_in(comm, v2, dst, mode=mode, verify=True, config=config)
    assert (summary.files, summary.unchanged) == (first.files, 0)
    assert summary.verified
    for copy in node_copies(shared_tmp, "data").values():
        assert set(copy.values()) == {bytes([2]) * 4096}
    node = comm.Get_rank() * 2 // comm.Get_size()
    here = shared_tmp / "bb" / str(node)
    assert files.read_manifest(here / "data").attrs["source"] == str(v2.resolve())
    assert registry.lookup(here, v2 / "a.bin") == (v2.resolve(), (here / "data").resolve())
    assert registry.lookup(here, v1 / "a.bin") is None
    assert bbio.verify(comm, v2, dst, config=config).problems == []
    rerun = bbio.stage_in(comm, v2, dst, mode=mode, verify=True, config=config)
    assert (rerun.files, rerun.unchanged) == (0, first.files)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("back_to_the_first", [False, True], ids=["v2-again", "v1-again"])
def test_the_rerun_of_a_failed_stage_in_of_another_source_copies_it_anew(
    comm, shared_tmp, back_to_the_first
):
    """The stage-in of v2 fails on hot.log (it keeps changing) after committing a.bin and
    before z.bin (one file per round): z.bin still holds v1's bytes, so a rerun of v2 may
    not take it for v2's, nor a rerun of v1 take a.bin, now v2's, for v1's (before, the
    manifest left still named v1, and vouched for it)."""
    config = two_nodes(comm, shared_tmp, stage_round_bytes=1)
    v1, v2 = shared_tmp / "pfs" / "v1", shared_tmp / "pfs" / "v2"
    names = ("a.bin", "hot.log", "z.bin")
    make_version(comm, v1, 1, names)
    make_version(comm, v2, 2, names)
    dst = shared_tmp / "bb" / "{node}" / "data"
    bbio.stage_in(comm, v1, dst, config=config)

    def failing() -> None:
        with pytest.raises(bbio.IntegrityError, match=r"kept changing .*: hot\.log"):
            bbio.stage_in(comm, v2, dst, config=config)

    while_changing(comm, v2 / "hot.log", failing)
    for copy in node_copies(shared_tmp, "data").values():
        assert copy["a.bin"] == bytes([2]) * 4096 and copy["z.bin"] == bytes([1]) * 4096
    return_to = v1 if back_to_the_first else v2
    bbio.stage_in(comm, return_to, dst, config=config)
    expected = {name: (return_to / name).read_bytes() for name in names}
    assert node_copies(shared_tmp, "data") == {"0": expected, "1": expected}
    assert bbio.verify(comm, return_to, dst, config=config).problems == []


@pytest.mark.mpi(min_size=2)
def test_a_stage_in_into_a_stage_outs_destination_copies_it_anew(comm, shared_tmp):
    """The directory holds a stage-out's manifest (of the files it wrote there): it does
    not vouch for a stage-in of a source whose files have those names, sizes and mtimes."""
    config = Config(
        bb_root=str(shared_tmp / "bb" / "{node}"),
        ranks_per_node=comm.Get_size(),  # one node: its destination may be a shared one
        progress="never",
    )
    results = shared_tmp / "pfs" / "results"
    make_version(comm, shared_tmp / "bb" / "0" / "out", 1)
    bbio.stage_out(comm, shared_tmp / "bb" / "{node}" / "out", results, config=config)
    v2 = shared_tmp / "pfs" / "v2"
    make_version(comm, v2, 2)
    summary = bbio.stage_in(comm, v2, results, verify=True, config=config)
    assert (summary.files, summary.unchanged) == (len(NAMES), 0)
    assert set(files_under(results).values()) == {bytes([2]) * 4096}
    assert files.read_manifest(results).kind == "stage-in"
