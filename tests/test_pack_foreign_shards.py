"""``bbio pack`` replaces or removes only the shards an earlier bbio pack into ``OUT``
recorded (its index, or the marker of a pack that did not finish), and refuses an ``OUT``
holding other files named like shards (before, it deleted and overwrote them).  Serial
tests of the records, then MPI tests on 2 or 4 ranks in 2 virtual nodes, with real files."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

import bbio
from bbio.stage import pack as pack_module
from bbio.stage.pack import INDEX_NAME, PENDING_NAME, read_index, shard_name
from tests.test_stage import same_on_all_ranks, two_nodes

# ------------------------------------------------------------ the records (serial)


def test_the_shards_an_earlier_pack_recorded_are_those_its_index_and_marker_list(tmp_path):
    index = {"format": "bbio-pack/1", "shards": [{"file": shard_name(0)}, {"file": shard_name(1)}]}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    (tmp_path / PENDING_NAME).write_text(json.dumps({"time": 1.0, "shards": [shard_name(5)]}))
    assert pack_module.recorded_shards(tmp_path) == {shard_name(i) for i in (0, 1, 5)}
    (tmp_path / INDEX_NAME).write_text("{damaged")  # records nothing
    (tmp_path / PENDING_NAME).write_text(json.dumps({"time": 1.0}))  # an older bbio's marker
    assert pack_module.recorded_shards(tmp_path) == set()


# --------------------------------------------------------------- MPI tests


def _source(comm, root: Path, sizes: dict[str, int]) -> Path:
    """Collective: make the source ``root`` hold exactly the files ``sizes`` names."""
    if comm.Get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            old.unlink()
        for name, size in sizes.items():
            (root / name).write_bytes(name[:1].encode() * size)
    comm.Barrier()
    return root


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


@pytest.mark.mpi(min_size=2)
def test_pack_refuses_an_out_holding_shards_no_pack_recorded(comm, shared_tmp):
    """The user's shard-00000..00003.h5: every rank raises the same error naming OUT and
    the files, and they are left as they were (before, they were deleted and the first
    replaced by a shard of the new pack)."""
    src = _source(comm, shared_tmp / "src", {"a": 10, "b": 20, "c": 30})
    out = shared_tmp / "out"
    mine = {shard_name(i): f"user data {i}".encode() for i in range(4)}
    if comm.Get_rank() == 0:
        out.mkdir()
        for name, data in mine.items():
            (out / name).write_bytes(data)
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError) as refused:
        bbio.pack(comm, src, out, config=two_nodes(comm, shared_tmp))
    message = str(refused.value)
    assert same_on_all_ranks(comm, message)
    assert str(out) in message and "Move those files elsewhere" in message, message
    assert all(name in message for name in mine), message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == mine


@pytest.mark.mpi(min_size=2)
def test_pack_refuses_a_file_of_yours_beside_an_earlier_pack_and_keeps_that_pack(comm, shared_tmp):
    src = _source(comm, shared_tmp / "src", {"a": 1000, "b": 1000})
    out = shared_tmp / "out"
    config = two_nodes(comm, shared_tmp)
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 2
    if comm.Get_rank() == 0:
        (out / shard_name(7)).write_bytes(b"not a bbio shard")
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError, match=shard_name(7)) as refused:
        bbio.pack(comm, src, out, shard_size=1000, config=config)
    assert same_on_all_ranks(comm, str(refused.value))
    assert shard_name(0) not in str(refused.value)  # the earlier pack's are bbio's
    assert [s.file for s in read_index(out)] == [shard_name(0), shard_name(1)]
    assert (out / shard_name(7)).read_bytes() == b"not a bbio shard"
    comm.Barrier()
    if comm.Get_rank() == 0:
        (out / shard_name(7)).rename(shared_tmp / "moved-aside.h5")
    comm.Barrier()
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 2  # a rerun
    assert _names(out) == [INDEX_NAME, shard_name(0), shard_name(1)]


@pytest.mark.mpi(min_size=2)
def test_a_repack_after_a_pack_failed_midway_removes_every_shard_of_both(comm, shared_tmp):
    """A pack of 4 shards; a second one fails writing its shard 1 (larger than the files
    the process may write) after deleting the old shard 1; a third, of 1 shard, leaves
    exactly its own.  Before, shards 2 and 3, beyond the gap, were left forever."""
    src, out = shared_tmp / "src", shared_tmp / "out"
    config = two_nodes(comm, shared_tmp)
    _source(comm, src, {f"f{i}": 1000 for i in range(4)})
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 4
    _source(comm, src, {"f0": 1000, "f1": 4 << 20, "f2": 1000, "f3": 1000})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limits[1]))
    try:
        with pytest.raises(bbio.BBIOError, match=shard_name(1)) as failed:
            bbio.pack(comm, src, out, shard_size=1000, config=config)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert same_on_all_ranks(comm, str(failed.value))
    assert not (out / INDEX_NAME).exists() and (out / PENDING_NAME).exists()
    assert not (out / shard_name(1)).exists() and (out / shard_name(3)).exists()
    comm.Barrier()
    _source(comm, src, {"f0": 1000})
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 1
    assert _names(out) == [INDEX_NAME, shard_name(0)]
