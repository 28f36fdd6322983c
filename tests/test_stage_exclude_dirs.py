"""``--exclude DIR`` leaves out the directory and everything under it, as rsync does (before,
only a glob ending in ``*`` did: ``--exclude logs`` copied all of ``logs/``).  The rule
serially, then stage-in, stage-out and pack on 2 or 4 ranks in 2 virtual nodes, with real
files."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest

import bbio
from bbio.stage.pack import read_index
from bbio.stage.walk import excluded_dir, selected
from tests.test_stage import files_under, same_on_all_ranks, two_nodes
from tests.test_stage_out import write_on_every_node

MTIME_NS = 1_700_000_000_000_000_000


# ------------------------------------------------------------ the rule (serial)


def test_an_exclude_glob_matching_a_directory_leaves_it_out_with_what_it_holds():
    """(directory, exclude globs, left out); files are matched by ``selected`` alone."""
    cases = [
        ("logs", ["logs"], True),  # before: False, and all of logs/ was copied
        ("a/logs", ["*/logs"], True),
        ("a/logs", ["a/log?"], True),
        ("logs", ["logs/"], True),  # a trailing slash: directories only
        ("logs", ["logs/*"], True),
        ("logs", ["logs*"], True),
        ("logs/deep", ["logs"], False),  # the walk never gets there: logs is left out
        ("a/logs", ["logs"], False),  # globs match the whole path relative to the source
        ("logs", ["logs/*.txt"], False),  # not everything under it
        ("logs", ["logs?"], False),  # one more character, not the slash
        ("logs", [], False),
    ]
    assert [excluded_dir(d, exclude) for d, exclude, _ in cases] == [c[2] for c in cases]
    assert selected("logs", [], ["logs/"])  # a file named logs: not a directory
    assert not selected("logs", [], ["logs"])


# --------------------------------------------------------------- MPI tests


@pytest.fixture
def src(comm, shared_tmp) -> Path:
    """A source with logs/ (files, a deeper directory and an empty one) beside data."""
    root = shared_tmp / "pfs" / "src"
    if comm.Get_rank() == 0:
        for rel in ("keep.bin", "logs/a.log", "logs/deep/b.log", "data/x.bin", "data/logs/c.log"):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(rel.encode())
        (root / "logs" / "empty").mkdir()
    comm.Barrier()
    return root


def _tree(root: Path) -> list[str]:
    """Every path under ``root`` (directories too), but bbio's own metadata."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if not p.relative_to(root).as_posix().startswith(".bbio")
    )


@pytest.mark.mpi(min_size=2)
def test_stage_in_leaves_out_an_excluded_directory_with_everything_under_it(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "a", exclude=["logs"], config=config)
    bbio.stage_in(
        comm,
        src,
        shared_tmp / "bb" / "{node}" / "b",
        include=["*.log"],
        exclude=["data/logs/"],
        config=config,
    )
    comm.Barrier()
    for node in ("0", "1"):
        assert _tree(shared_tmp / "bb" / node / "a") == [
            "data",
            "data/logs",
            "data/logs/c.log",
            "data/x.bin",
            "keep.bin",
        ]
        assert _tree(shared_tmp / "bb" / node / "b") == [
            "logs",
            "logs/a.log",
            "logs/deep",
            "logs/deep/b.log",
            "logs/empty",  # empty in the source, and no exclude glob matches it
        ]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("glob", ["logs", "logs/"])
def test_stage_out_leaves_out_an_excluded_directory_where_the_pfs_has_a_file(
    comm, shared_tmp, glob
):
    """The hint of stage-out's refusal (a directory of the source where the PFS has a file)
    says to leave the path out with --exclude: that works now."""
    config = two_nodes(comm, shared_tmp)
    pfs = shared_tmp / "pfs" / "out"
    if comm.Get_rank() == 0:
        pfs.mkdir(parents=True)
        (pfs / "logs").write_bytes(b"the user's file")
    write_on_every_node(comm, shared_tmp, "outputs", "logs/a.log", b"log", MTIME_NS)
    write_on_every_node(comm, shared_tmp, "outputs", "keep", b"result", MTIME_NS)
    with pytest.raises(bbio.AlreadyExistsError, match="--exclude") as refused:
        bbio.stage_out(comm, shared_tmp / "bb" / "{node}" / "outputs", pfs, config=config)
    assert same_on_all_ranks(comm, str(refused.value))
    summary = bbio.stage_out(
        comm, shared_tmp / "bb" / "{node}" / "outputs", pfs, exclude=[glob], config=config
    )
    assert summary.files == 1
    assert files_under(pfs) == {"logs": b"the user's file", "keep": b"result"}


@pytest.mark.mpi(min_size=2)
def test_pack_leaves_out_an_excluded_directory(comm, shared_tmp, src):
    out = shared_tmp / "packed"
    config = two_nodes(comm, shared_tmp)
    summary = bbio.pack(comm, src, out, exclude=["logs"], config=config)
    names = []
    for shard in read_index(out):
        with h5py.File(out / shard.file, "r") as f:
            names.extend(f["names"].asstr()[:])
    assert summary.samples == 3
    assert names == ["data/logs/c.log", "data/x.bin", "keep.bin"]
