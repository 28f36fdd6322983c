"""Collective reads on 2 or 4 ranks in 2 virtual nodes: each sample identical to a plain read."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import bbio
from bbio import _native
from bbio.config import Config

pytestmark = pytest.mark.mpi(min_size=2)

SAMPLES = 120


def config_for(comm, tmp: Path, **settings) -> Config:
    return Config(
        bb_root=str(tmp / "bb" / "{node}"),
        ranks_per_node=comm.Get_size() // 2,
        progress="never",
        **settings,
    )


def sample_bytes(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def datasets(comm, shared_tmp):
    """The same samples in all four layouts; sample i is sample_bytes(i, size_i)."""
    root = shared_tmp / "pfs"
    sizes = [100 + (i * 37) % 900 for i in range(SAMPLES)]
    if comm.Get_rank() == 0:
        (root / "files").mkdir(parents=True)
        for i, size in enumerate(sizes):
            (root / "files" / f"s{i:04d}.bin").write_bytes(sample_bytes(i, size))
        fixed = np.stack(
            [np.frombuffer(sample_bytes(i, 256), np.uint8).view(np.float32) for i in range(SAMPLES)]
        )
        with h5py.File(root / "fixed.h5", "w") as f:
            f.create_dataset("x", data=fixed)
        with open(root / "fixed.raw", "wb") as f:
            f.write(b"HEADER!!")
            f.write(fixed.tobytes())
    comm.Barrier()
    config = config_for(comm, shared_tmp)
    bbio.pack(comm, root / "files", root / "packed", shard_size=20_000, config=config)
    return root, sizes, config


def expected_variable(i, sizes):
    return sample_bytes(i, sizes[i])


def expected_fixed(i):
    return np.frombuffer(sample_bytes(i, 256), np.uint8).view(np.float32)


def my_ids(comm, seed=0, count=9):
    rng = np.random.default_rng(seed + comm.Get_rank())
    ids = rng.integers(0, SAMPLES, count)
    ids[-1] = ids[0]  # a duplicate
    return ids


MODES = {  # always aggregate; each rank reads its own after planning; or with no exchange at all
    "aggregated": {"read_min_saving": 0, "read_direct_bytes": 0},
    "direct": {"read_min_saving": 100, "read_direct_bytes": 0},
    "alone": {"read_direct_bytes": 1},  # every sample is "large"
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["packed", "files"])
def test_variable_size_layouts(comm, datasets, kind, mode):
    root, sizes, config = datasets
    config = dataclasses.replace(config, **MODES[mode])
    with bbio.open_dataset(comm, root / kind, config=config) as ds:
        assert len(ds) == SAMPLES and not ds.fixed_size
        ids = my_ids(comm)
        got = ds.read(ids)
        assert [g.tobytes() for g in got] == [expected_variable(i, sizes) for i in ids]
        assert ds.reads_alone == (mode == "alone")
        assert ds.stats.direct_calls == (mode != "aggregated")
        if mode == "aggregated":  # the same samples asked twice are read once
            assert ds.stats.requests < comm.Get_size() * len(ids)
        else:
            assert ds.stats.requests == comm.Get_size() * len(ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["hdf5", "raw"])
def test_fixed_size_layouts(comm, datasets, kind, mode):
    root, _, config = datasets
    config = dataclasses.replace(config, **MODES[mode])
    if kind == "hdf5":
        ds = bbio.open_dataset(comm, root / "fixed.h5", config=config)
    else:
        ds = bbio.open_dataset(
            comm,
            root / "fixed.raw",
            sample_shape=(64,),
            dtype="float32",
            header_bytes=8,
            config=config,
        )
    with ds:
        ids = my_ids(comm, seed=3)
        got = ds.read(ids)
        assert got.shape == (len(ids), 64) and got.dtype == np.float32
        assert got.tobytes() == np.stack([expected_fixed(i) for i in ids]).tobytes()  # NaNs too
        assert ds.stats.direct_calls == (mode != "aggregated")
        assert ds.stats.samples == comm.Get_size() * len(ids)
        if mode != "aggregated":  # one request per sample
            assert ds.stats.requests == ds.stats.samples
        mine = set(ids.tolist())  # read alone, a sample asked by two ranks is read twice
        needed = (
            comm.allreduce(len(mine))
            if mode == "alone"
            else len(set().union(*comm.allgather(mine)))
        )
        assert ds.stats.bytes_needed == needed * 256


@pytest.mark.parametrize("mode", ["aggregated", "alone"])
def test_reads_bypassing_the_page_cache_give_the_same_bytes(comm, datasets, mode):
    root, sizes, config = datasets
    config = dataclasses.replace(config, read_odirect_bytes=1, **MODES[mode])
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        ids = my_ids(comm, seed=5)
        got = ds.read(ids)
        assert [g.tobytes() for g in got] == [expected_variable(i, sizes) for i in ids]
        direct = comm.allreduce(sum(aligned for _, aligned in ds._descriptors.held.values()))
        probe = _native.open_direct(ds._path(0), os.O_RDONLY)  # None: the fs refuses O_DIRECT
        if probe is not None:
            os.close(probe)
            assert direct, "no read was sent through an O_DIRECT descriptor"


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_with_nothing_to_read_and_samples_larger_than_the_buffer(comm, datasets, mode):
    root, sizes, _ = datasets
    config = config_for(comm, root.parent, read_max_bytes=64, read_max_hole=0, **MODES[mode])
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        ids = [] if comm.Get_rank() == 1 else my_ids(comm, seed=7)
        got = ds.read(ids)
        assert [g.tobytes() for g in got] == [expected_variable(i, sizes) for i in ids]
        empty = ds.read([])
        assert empty == []


@pytest.mark.parametrize("mode", ["aggregated", "alone"])
def test_out_of_range_and_missing_paths_are_the_same_error_everywhere(comm, datasets, mode):
    root, _, config = datasets
    config = dataclasses.replace(config, **MODES[mode])
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        ids = [SAMPLES + 5] if comm.Get_rank() == comm.Get_size() - 1 else [0]
        with pytest.raises(bbio.UsageError) as info:
            ds.read(ids)
        message = str(info.value)
        assert f"sample id {SAMPLES + 5} (asked by rank {comm.Get_size() - 1}) is out of range" in (
            message
        )
        assert comm.allgather(message) == [message] * comm.Get_size()
        assert len(ds.read([1])) == 1  # still usable afterwards
    with pytest.raises(bbio.NotFoundError, match="the dataset does not exist"):
        bbio.open_dataset(comm, root / "nowhere", config=config)


@pytest.mark.parametrize("mode", MODES)
def test_a_file_that_vanished_after_opening_is_reported_on_every_rank(comm, datasets, mode):
    root, _, config = datasets
    config = dataclasses.replace(config, **MODES[mode])
    with bbio.open_dataset(comm, root / "files", config=config) as ds:
        comm.Barrier()
        if comm.Get_rank() == 0:
            os.rename(root / "files" / "s0003.bin", root / "s0003.moved")
        comm.Barrier()
        with pytest.raises(bbio.NotFoundError) as info:
            ds.read([3])
        assert "s0003.bin" in str(info.value)
        assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()


@pytest.mark.parametrize("kind", ["packed", "files", "hdf5"])
def test_reads_in_many_rounds_give_the_same_bytes(comm, datasets, kind):
    root, sizes, _ = datasets
    config = config_for(comm, root.parent, read_round_bytes=512)  # up to 8 rounds per read
    path = root / ("fixed.h5" if kind == "hdf5" else kind)
    with bbio.open_dataset(comm, path, config=config) as ds:
        assert_reads_back(comm, ds, kind, sizes, seed=11, count=30)


def assert_reads_back(comm, ds, kind: str, sizes, seed: int, count: int) -> None:
    """This rank's ``count`` random samples of ``ds`` read back as written."""
    ids = my_ids(comm, seed=seed, count=count)
    got = ds.read(ids)
    if kind == "hdf5":
        assert got.tobytes() == np.stack([expected_fixed(i) for i in ids]).tobytes()
    else:
        assert [g.tobytes() for g in got] == [expected_variable(i, sizes) for i in ids]


@pytest.mark.parametrize("kind", ["packed", "hdf5"])
def test_samples_longer_than_an_mpi_block_are_handed_out_in_pieces(
    comm, datasets, kind, monkeypatch
):
    """Samples of 2 GiB or more overflow an MPI datatype's block length: they go in blocks
    of at most that.  Here the limit is 7 bytes, so every sample is cut."""
    monkeypatch.setattr(bbio.read.datasets, "MPI_BLOCK_BYTES", 7)
    root, sizes, _ = datasets
    path = root / ("fixed.h5" if kind == "hdf5" else "packed")
    with bbio.open_dataset(comm, path, config=config_for(comm, root.parent)) as ds:
        assert_reads_back(comm, ds, kind, sizes, seed=12, count=20)


def test_a_read_failing_in_a_later_round_is_reported_on_every_rank(comm, datasets):
    root, _, _ = datasets
    config = config_for(comm, root.parent, read_round_bytes=256)
    with bbio.open_dataset(comm, root / "files", config=config) as ds:
        comm.Barrier()
        if comm.Get_rank() == 0:  # the last file: read in its aggregator's last round
            os.rename(root / "files" / f"s{SAMPLES - 1:04d}.bin", root / "last.moved")
        comm.Barrier()
        ids = np.arange(comm.Get_rank(), SAMPLES, comm.Get_size())
        with pytest.raises(bbio.NotFoundError) as info:
            ds.read(ids)
        assert f"s{SAMPLES - 1:04d}.bin" in str(info.value)
        assert comm.allgather(str(info.value)) == [str(info.value)] * comm.Get_size()
        assert len(ds.read([0])) == 1  # still usable afterwards


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_staged_copies_are_read_from_the_burst_buffers(comm, datasets, mode):
    root, sizes, config = datasets
    config = dataclasses.replace(config, read_direct_bytes=1)
    bbio.stage_in(comm, root / "packed", f"{config.bb_root}/packed", mode=mode, config=config)
    comm.Barrier()
    if comm.Get_rank() == 0:  # the PFS copy is gone: only the burst buffers can serve
        shutil.move(root / "packed", root / "packed-away")
        os.mkdir(root / "packed")
        shutil.copy(root / "packed-away" / "bbio-pack.json", root / "packed")
    comm.Barrier()
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        assert ds.local, "this node's burst buffer holds no file of the dataset"
        assert ds.reads_alone == (mode == "replicate")  # shards must travel between nodes
        ids = my_ids(comm, seed=11, count=20)
        got = ds.read(ids)
        assert [g.tobytes() for g in got] == [expected_variable(i, sizes) for i in ids]


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_epoch_delivers_each_sample_once_and_matches_plain_reads(
    comm, datasets, prefetch, drop_last
):
    root, sizes, config = datasets
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        seen = []
        with bbio.Loader(
            comm, ds, batch_size=7, seed=3, epochs=2, drop_last=drop_last, prefetch=prefetch
        ) as loader:
            steps = 0
            for batch in loader:
                ids = loader.indices
                assert [b.tobytes() for b in batch] == [expected_variable(i, sizes) for i in ids]
                seen.append(ids.tolist())
                steps += 1
            assert steps == 2 * len(loader)
        everyone = comm.allgather(seen)
        first_epoch = [i for rank in everyone for step in rank[: len(loader)] for i in step]
        if drop_last:
            per_rank = SAMPLES // comm.Get_size() // 7 * 7
            assert len(first_epoch) == per_rank * comm.Get_size()
            assert len(set(first_epoch)) == len(first_epoch)
        else:
            assert sorted(first_epoch) == list(range(SAMPLES))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_resumed_at_a_step_continues_the_same_shuffle(comm, datasets, prefetch):
    root, _, config = datasets
    with bbio.open_dataset(comm, root / "packed", config=config) as ds:
        with bbio.Loader(comm, ds, batch_size=5, seed=9, epochs=2, prefetch=prefetch) as loader:
            full = [loader.indices.tolist() for _ in loader]
        resume_at = len(full) // 2 + 1  # inside the second epoch
        with bbio.Loader(
            comm, ds, batch_size=5, seed=9, epochs=2, prefetch=prefetch, start_step=resume_at
        ) as loader:
            rest = [loader.indices.tolist() for _ in loader]
        assert rest == full[resume_at:]


def test_loader_stopped_early_does_not_hang(comm, datasets):
    root, _, config = datasets
    with bbio.open_dataset(comm, root / "files", config=config) as ds:
        loader = bbio.Loader(comm, ds, batch_size=4, seed=0, epochs=3, prefetch=3)
        for step, _ in enumerate(loader):
            if step == 2:
                break
        loader.close()
        assert len(ds.read([0])) == 1  # the dataset's collectives are still in step


def write_samples(comm, root: Path, names: list[str], size: int) -> None:
    """Collective: rank 0 writes ``root/NAME`` for each of ``names``, sample i of ``size``
    bytes (:func:`sample_bytes`)."""
    if comm.Get_rank() == 0:
        root.mkdir(parents=True)
        for i, name in enumerate(names):
            (root / name).write_bytes(sample_bytes(i, size))
    comm.Barrier()


@pytest.mark.parametrize("count_changed", [False, True])
def test_nodes_whose_complete_copies_differ_read_the_pfs_copy(comm, shared_tmp, count_changed):
    """The PFS directory changed, and only node 0 staged it again.  Before, node 1's ranks
    numbered the samples by their own, older list (wrong bytes), or died with a raw
    IndexError when the counts differed."""
    root = shared_tmp / "pfs" / "changing"
    config = config_for(comm, shared_tmp)
    write_samples(comm, root, [f"f{i}" for i in range(10)], 300)
    bbio.stage_in(comm, root, f"{config.bb_root}/changing", config=config)
    if comm.Get_rank() == 0:
        (root / "f9").unlink()
        (root / "f00").write_bytes(sample_bytes(100, 300))  # sorts before f1
        if count_changed:
            (root / "f0a").write_bytes(sample_bytes(101, 300))
    comm.Barrier()
    node = comm.Get_rank() // (comm.Get_size() // 2)
    node_0 = comm.Split(0 if node == 0 else 1, comm.Get_rank())
    if node == 0:  # stages again on node 0 alone
        bbio.stage_in(node_0, root, f"{config.bb_root}/changing", config=config)
    node_0.Free()
    comm.Barrier()
    names = sorted(p.name for p in root.iterdir())
    with bbio.open_dataset(comm, root, config=config) as ds:
        assert len(ds) == len(names)
        got = ds.read(list(range(len(names))))
    assert [g.tobytes() for g in got] == [(root / name).read_bytes() for name in names]


def test_an_hdf5_file_with_a_user_block_is_read_as_hdf5(comm, shared_tmp):
    """Its signature sits after the user block (at 4096 here), not at byte 0: before, it
    was taken for a raw file and refused."""
    path = shared_tmp / "user-block.h5"
    data = np.arange(200, dtype=np.int64).reshape(50, 4)
    if comm.Get_rank() == 0:
        with h5py.File(path, "w", userblock_size=4096) as f:
            f.create_dataset("a", data=data)
    comm.Barrier()
    with bbio.open_dataset(comm, path, config=config_for(comm, shared_tmp)) as ds:
        assert len(ds) == 50
        got = ds.read([0, 7, 49])
    assert [g.tolist() for g in got] == [data[0].tolist(), data[7].tolist(), data[49].tolist()]


def test_nodes_that_staged_different_packs_read_the_pfs_pack(comm, shared_tmp):
    """The source changed and was packed again (same shard sizes), and only node 1 staged
    the new pack.  Before, every rank took node 0's old index, and node 1's ranks read
    its new shards with it: other bytes for the same sample."""
    src, out = shared_tmp / "pfs" / "src", shared_tmp / "pfs" / "packed"
    config = config_for(comm, shared_tmp)
    write_samples(comm, src, [f"f{i:02d}" for i in range(40)], 5000)
    bbio.pack(comm, src, out, shard_size=50_000, config=config)
    bbio.stage_in(comm, out, f"{config.bb_root}/packed", config=config)
    if comm.Get_rank() == 0:
        (src / "f05").rename(src / "f99")  # the same sizes, another order
    comm.Barrier()
    bbio.pack(comm, src, out, shard_size=50_000, config=config)
    node = comm.Get_rank() // (comm.Get_size() // 2)
    node_1 = comm.Split(int(node == 1), comm.Get_rank())
    if node == 1:  # stages the new pack on node 1 alone
        single = dataclasses.replace(config, bb_root=str(shared_tmp / "bb" / "1"))
        bbio.stage_in(node_1, out, f"{single.bb_root}/packed", config=single)
    node_1.Free()
    comm.Barrier()
    names = sorted(p.name for p in src.iterdir())
    with bbio.open_dataset(comm, out, config=config) as ds:
        got = ds.read(list(range(len(names))))
    assert [g.tobytes() for g in got] == [(src / name).read_bytes() for name in names]
