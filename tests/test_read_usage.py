"""Bad or differing arguments to ``open_dataset``, ``Dataset.read`` and ``Loader``: one clear
error on every rank (never a hang, silently wrong data or a raw error from h5py or NumPy),
and a filtered stage-in that must not shrink the dataset.  On 2 or 4 ranks in 2 virtual
nodes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

import bbio
from bbio.stage import registry
from bbio.transfer.files import manifest_path
from tests.test_read import MODES, config_for

pytestmark = pytest.mark.mpi(min_size=2)

NESTED = ["a/b/t0.bin", "a/b/t1.bin", "a/b/t2.bin"]
NAMES = sorted([f"s{i:02d}.bin" for i in range(20)] + NESTED)  # the dataset's sample order
RECORDS = 100  # int32 records of x.raw: record i holds i


def content(name: str) -> bytes:
    return f"<{name}>".encode() * (3 + len(name) + NAMES.index(name))


def same_everywhere(comm, error: BaseException) -> str:
    message = str(error)
    assert comm.allgather(message) == [message] * comm.Get_size()
    return message


@pytest.fixture
def data(comm, shared_tmp):
    """A directory of 23 files (3 of them in a/b), a raw file of int32 records 0..99, an
    HDF5 file with a dataset, a group and a variable-length string dataset, and one with
    datasets that are not contiguous in the file (chunked, external, never written)."""
    root = shared_tmp / "pfs"
    if comm.Get_rank() == 0:
        (root / "files" / "a" / "b").mkdir(parents=True)
        for name in NAMES:
            (root / "files" / name).write_bytes(content(name))
        np.arange(RECORDS, dtype=np.int32).tofile(root / "x.raw")
        with h5py.File(root / "several.h5", "w") as f:
            f.create_dataset("x", data=np.arange(40, dtype=np.float32).reshape(10, 4))
            f.create_group("g").create_dataset("y", data=np.arange(6, dtype=np.int16))
            f.create_dataset("names", data=["a", "bb", "ccc"], dtype=h5py.string_dtype())
        with h5py.File(root / "elsewhere.h5", "w") as f:
            f.create_dataset("chunked", data=np.arange(8).reshape(4, 2), chunks=(2, 2))
            f.create_dataset("later", shape=(4, 2), dtype="<i4")
            f.create_dataset("external", shape=(4, 2), dtype="<i4", external=[("x.bin", 0, 32)])
        (root / "bad.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\xff" * 200)
    comm.Barrier()
    return root, config_for(comm, shared_tmp)


def last_rank(comm) -> bool:
    return comm.Get_rank() == comm.Get_size() - 1


# ------------------------------------------------------------ arguments that differ


DIFFERENT = {
    "batch_size": {"batch_size": 4},
    "seed": {"seed": 8},
    "epochs": {"epochs": 3},
    "shuffle": {"shuffle": False},
    "drop_last": {"drop_last": True},
    "prefetch": {"prefetch": 1},
    "start_step": {"start_step": 2},
}


@pytest.mark.timeout(60)  # before the fix some of these hung
@pytest.mark.parametrize("name", DIFFERENT)
def test_loader_arguments_that_differ_between_ranks_are_one_usage_error(comm, data, name):
    root, config = data
    with bbio.open_dataset(comm, root / "files", config=config) as ds:
        arguments = {"batch_size": 3, "seed": 7, "epochs": 2, "prefetch": 2}
        if last_rank(comm):
            arguments.update(DIFFERENT[name])
        with pytest.raises(bbio.UsageError) as info, bbio.Loader(comm, ds, **arguments) as loader:
            for _ in loader:
                pass
        message = same_everywhere(comm, info.value)
        assert f"the ranks passed different arguments ({name}: rank 0" in message, message
        assert str(root / "files") in message, message
        assert len(ds.read([0])) == 1  # the dataset's collectives are still in step


@pytest.mark.timeout(60)  # before the fix this hung
def test_ranks_that_pass_different_datasets_to_a_loader_get_one_usage_error(comm, data):
    root, config = data
    with (
        bbio.open_dataset(comm, root / "files", config=config) as files,
        bbio.open_dataset(comm, root / "files", config=config) as again,
    ):
        mine = again if last_rank(comm) else files
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(comm, mine, batch_size=3, seed=0, prefetch=0)
        message = same_everywhere(comm, info.value)
        assert "Loader: the ranks passed different arguments (dataset: rank 0 " in message
        assert f"{root / 'files'} opened as " in message, message
        assert len(files.read([0])) == len(again.read([1])) == 1  # still in step


@pytest.mark.timeout(60)  # before the fix this hung
def test_a_dataset_closed_on_some_ranks_is_one_usage_error_not_a_hang(comm, data):
    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        with pytest.raises(bbio.UsageError) as info:
            ds.close() if last_rank(comm) else ds.read([comm.Get_rank()])
        message = same_everywhere(comm, info.value)
        assert (
            f"the ranks are in different collective calls: rank 0 in read of {root / 'x.raw'}, "
            f"rank {comm.Get_size() - 1} in close of {root / 'x.raw'}" in message
        ), message
        assert not ds.closed
        assert ds.read([3]).tolist() == [[3, 0, 0, 0]]  # still open, and in step
    assert ds.closed


@pytest.mark.timeout(60)  # before the fix the dataset freed its communicator under the reads
def test_closing_a_dataset_closes_its_prefetching_loader_first(comm, data):
    root, config = data
    ds = bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config)
    loader = bbio.Loader(comm, ds, batch_size=2, seed=3, prefetch=2)
    batches = iter(loader)
    first = next(batches)  # the background thread reads the next two steps meanwhile
    ds.close()
    assert ds.closed and loader._thread is not None and not loader._thread.is_alive()
    with pytest.raises(bbio.UsageError, match="the Loader is closed"):
        next(batches)
    assert first.view(np.int32).ravel().tolist() == loader.indices.tolist()  # record i holds i


@pytest.mark.timeout(60)
def test_a_loader_on_a_reordered_communicator_is_refused(comm, data):
    root, config = data
    reordered = comm.Split(0, -comm.Get_rank())  # the same ranks, numbered backwards
    try:
        with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
            with pytest.raises(bbio.UsageError) as info:
                bbio.Loader(reordered, ds, batch_size=3, seed=0, prefetch=0)
            message = same_everywhere(comm, info.value)
            assert "communicator holds the dataset's ranks in another order" in message
            with bbio.Loader(comm, ds, batch_size=3, seed=0, prefetch=0) as loader:
                for batch in loader:  # the communicator the dataset was opened with
                    assert batch.view(np.int32).ravel().tolist() == loader.indices.tolist()
    finally:
        reordered.Free()


OPEN_DIFFERENT = {  # (path, keyword arguments) of rank 0, then of the last rank
    "path": (("files", {}), ("files/a", {})),
    "dataset": (("several.h5", {"dataset": "x"}), ("several.h5", {"dataset": "g/y"})),
    "record_bytes": (("x.raw", {"record_bytes": 4}), ("x.raw", {"record_bytes": 8})),
    "config.read_max_hole": (("files", {}), ("files", {"read_max_hole": 0})),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", OPEN_DIFFERENT)
def test_open_dataset_arguments_that_differ_between_ranks_are_one_usage_error(comm, data, name):
    root, config = data
    path, arguments = OPEN_DIFFERENT[name][1 if last_rank(comm) else 0]
    if "read_max_hole" in arguments:
        config = dataclasses.replace(config, **arguments)
        arguments = {}
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, root / path, config=config, **arguments).close()
    message = same_everywhere(comm, info.value)
    assert f"open_dataset: the ranks passed different arguments ({name}: rank 0" in message


# ------------------------------------------------------------ a filtered stage-in


@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_filtered_stage_in_does_not_shrink_the_dataset(comm, data, mode):
    """Only a/b/* is staged: the other 20 files are read from the PFS; a staged file whose
    PFS copy changed size since is read from the PFS too."""
    root, config = data
    config = dataclasses.replace(config, read_min_saving=0)  # aggregate: nodes serve nodes
    bbio.stage_in(
        comm, root / "files", f"{config.bb_root}/part", mode=mode, include=["a/b/*"], config=config
    )
    comm.Barrier()
    if comm.Get_rank() == 0:
        (root / "files" / "a" / "b" / "t1.bin").write_bytes(b"changed after staging")
    comm.Barrier()
    expected = [(root / "files" / name).read_bytes() for name in NAMES]
    with bbio.open_dataset(comm, root / "files", config=config) as ds:
        assert len(ds) == len(NAMES)
        ids = np.arange(comm.Get_rank(), len(NAMES), comm.Get_size())
        assert [g.tobytes() for g in ds.read(ids)] == [expected[i] for i in ids]
        staged = set().union(*comm.allgather(set(ds.local)))
        assert staged == {NAMES.index("a/b/t0.bin"), NAMES.index("a/b/t2.bin")}
        with bbio.Loader(comm, ds, batch_size=4, seed=1, prefetch=0) as loader:
            for batch in loader:
                assert [b.tobytes() for b in batch] == [expected[i] for i in loader.indices]


def test_a_complete_staged_copy_is_listed_from_its_manifest_not_the_pfs(comm, data):
    """A whole directory staged: open_dataset lists it from the manifest, so it opens and
    reads from the burst buffers with the PFS directory gone.  A FIFO and a symlink out
    of the directory, never copied (nor samples), do not make the copy incomplete."""
    root, config = data
    if comm.Get_rank() == 0:
        os.mkfifo(root / "files" / "pipe")
        (root / "files" / "elsewhere").symlink_to(root / "x.raw")
    comm.Barrier()
    summary = bbio.stage_in(comm, root / "files", f"{config.bb_root}/all", config=config)
    assert sorted(s.path for s in summary.skipped) == ["elsewhere", "pipe"]
    expected = [content(name) for name in NAMES]
    comm.Barrier()
    if comm.Get_rank() == 0:
        (root / "files").rename(root / "files-away")
    comm.Barrier()
    try:
        with bbio.open_dataset(comm, root / "files", config=config) as ds:
            assert len(ds) == len(NAMES) and len(ds.local) == len(NAMES)
            ids = np.arange(comm.Get_rank(), len(NAMES), comm.Get_size())
            assert [g.tobytes() for g in ds.read(ids)] == [expected[i] for i in ids]
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            (root / "files-away").rename(root / "files")
        comm.Barrier()


# ------------------------------------------------------------ files that cannot be read


HDF5_CASES = {  # file, dataset=, error class, what the message says
    "bad superblock": ("bad.h5", None, bbio.BBIOError, "cannot open the HDF5 file"),
    "a group": ("several.h5", "g", bbio.UsageError, "'g' is not a dataset of the HDF5 file"),
    "variable-length": ("several.h5", "names", bbio.UsageError, "variable-length elements"),
    "missing": ("several.h5", "nope", bbio.NotFoundError, "Pass dataset= one of: g/y, names, x"),
    "chunked": ("elsewhere.h5", "chunked", bbio.UsageError, "'chunked' is chunked, not contiguous"),
    "never written": ("elsewhere.h5", "later", bbio.UsageError, "has no data in the file yet"),
    "external storage": (
        "elsewhere.h5",
        "external",
        bbio.UsageError,
        "keeps its data in raw files outside the HDF5 file (external storage, such as 'x.bin')",
    ),
}


@pytest.mark.parametrize("case", HDF5_CASES)
def test_hdf5_files_that_cannot_be_read_are_refused_at_open(comm, data, case):
    root, config = data
    name, dataset, error, text = HDF5_CASES[case]
    with pytest.raises(error) as info:
        bbio.open_dataset(comm, root / name, dataset=dataset, config=config).close()
    message = same_everywhere(comm, info.value)
    assert text in message and str(root / name) in message, message


def damage_missing_shard(pack):
    os.remove(pack / "shard-00001.h5")


def damage_truncated_shard(pack):
    shard = pack / "shard-00001.h5"
    os.truncate(shard, shard.stat().st_size // 2)


def damage_index_without_shards(pack):
    index = json.loads((pack / "bbio-pack.json").read_text())
    del index["shards"]
    (pack / "bbio-pack.json").write_text(json.dumps(index))


def damage_index_a_list(pack):
    (pack / "bbio-pack.json").write_text("[]")


def damaging_shard_entry(name: str, value: int):
    """A damage: the first sample of shard 1 gets ``value`` as its ``name`` (offsets or sizes)."""

    def damage(pack):
        with h5py.File(pack / "shard-00001.h5", "r+") as f:
            listed = f[name][:]
            listed[0] = value
            f[name][...] = listed

    return damage


PACK_DAMAGE = {
    "missing shard": (damage_missing_shard, bbio.NotFoundError, "shard-00001.h5"),
    "truncated shard": (damage_truncated_shard, bbio.BBIOError, "shard-00001.h5"),
    "index without shards": (damage_index_without_shards, bbio.IntegrityError, "bbio-pack.json"),
    "index a list": (damage_index_a_list, bbio.IntegrityError, "bbio-pack.json"),
}
SAMPLE_OUTSIDE = {  # before, these opened: their reads hung or failed unlike on other ranks
    "negative size": damaging_shard_entry("sizes", -5),
    "size past the end": damaging_shard_entry("sizes", 10**11),
    "negative offset": damaging_shard_entry("offsets", -1),
    "offset past the end": damaging_shard_entry("offsets", 2**62),
}
PACK_DAMAGE |= {
    case: (damage, bbio.IntegrityError, "shard-00001.h5") for case, damage in SAMPLE_OUTSIDE.items()
}


@pytest.mark.parametrize("case", PACK_DAMAGE)
def test_a_damaged_pack_is_one_clear_error(comm, data, case):
    root, config = data
    damage, error, culprit = PACK_DAMAGE[case]
    bbio.pack(comm, root / "files", root / "packed", shard_size=300, config=config)
    if comm.Get_rank() == 0:
        assert (root / "packed" / "shard-00001.h5").exists()
        damage(root / "packed")
    comm.Barrier()
    with pytest.raises(error) as info:
        bbio.open_dataset(comm, root / "packed", config=config).close()
    message = same_everywhere(comm, info.value)
    assert culprit in message and "bbio pack" in message, message
    if case in SAMPLE_OUTSIDE:
        assert "the pack shard lists its sample 0 at offset" in message, message


RAW_CASES = {  # arguments, what the message says
    "negative record": ({"record_bytes": -3}, "record_bytes must be at least 1, not -3"),
    "float record": ({"record_bytes": 2.5}, "record_bytes must be an integer, not 2.5"),
    "header past the end": (
        {"record_bytes": 4, "header_bytes": 10_000},
        "header_bytes=10000 is beyond the end of the file (400 bytes)",
    ),
    "negative header": (
        {"record_bytes": 4, "header_bytes": -7},
        "header_bytes must be at least 0, not -7",
    ),
    "partial record": (
        {"record_bytes": 4, "header_bytes": 2},
        "398 bytes after a header of 2 are not a whole number of 4-byte records "
        "(99 records and 2 bytes over)",
    ),
    "bogus dtype": ({"sample_shape": (2,), "dtype": "bogus"}, "dtype='bogus' is not a NumPy"),
    "empty sample": ({"sample_shape": (0,), "dtype": "u1"}, "sample_shape must be at least 1"),
    "object dtype": ({"sample_shape": (2,), "dtype": object}, "has no fixed size in bytes"),
    "both": ({"record_bytes": 4, "sample_shape": (1,)}, "record_bytes= or sample_shape="),
}


@pytest.mark.parametrize("case", RAW_CASES)
def test_raw_file_arguments_are_checked_up_front(comm, data, case):
    root, config = data
    arguments, text = RAW_CASES[case]
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, root / "x.raw", config=config, **arguments).close()
    message = same_everywhere(comm, info.value)
    assert text in message and str(root / "x.raw") in message, message


def test_arguments_of_another_layout_are_refused(comm, data):
    root, config = data
    with pytest.raises(bbio.UsageError) as info:
        bbio.open_dataset(comm, root / "files", record_bytes=4, config=config).close()
    assert "are for raw files; this is a directory of files" in same_everywhere(comm, info.value)


# ------------------------------------------------------------ loader and read inputs


WRONG_TYPES = {
    "batch_size": ({"batch_size": 2.5}, "batch_size must be an integer, not 2.5"),
    "seed": ({"seed": None}, "seed must be an integer, not None"),
    "boolean batch_size": ({"batch_size": True}, "batch_size must be an integer, not True"),
    "negative seed": ({"seed": -1}, "seed must be at least 0"),
    "shuffle": ({"shuffle": "yes"}, "shuffle must be True or False"),
}


@pytest.mark.parametrize("case", WRONG_TYPES)
def test_loader_arguments_of_the_wrong_type_are_usage_errors(comm, data, case):
    root, config = data
    wrong, text = WRONG_TYPES[case]
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(comm, ds, **{"batch_size": 2, "seed": 0, **wrong})
        message = same_everywhere(comm, info.value)
        assert text in message and str(root / "x.raw") in message, message


@pytest.mark.parametrize("mode", ["aggregated", "alone"])
@pytest.mark.parametrize("ids", ["mask", "floats"])
def test_ids_that_are_not_integers_are_refused_on_every_rank(comm, data, mode, ids):
    root, config = data
    config = dataclasses.replace(config, **MODES[mode])
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        wrong = np.ones(RECORDS, dtype=bool) if ids == "mask" else np.array([1.0, 2.5])
        with pytest.raises(bbio.UsageError) as info:
            ds.read(wrong if last_rank(comm) else [3])
        message = same_everywhere(comm, info.value)
        assert f"the sample ids of rank {comm.Get_size() - 1} must be integers" in message
        assert str(root / "x.raw") in message, message
        assert ("np.flatnonzero(mask)" in message) == (ids == "mask"), message
        got = ds.read(np.flatnonzero(wrong) if ids == "mask" else [3])
        assert got.view(np.int32).ravel().tolist() == (
            list(range(RECORDS)) if ids == "mask" else [3]
        )


@pytest.mark.parametrize("prefetch", [0, 2])
def test_closed_loaders_and_datasets_say_so(comm, data, prefetch):
    root, config = data
    ds = bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config)
    loader = bbio.Loader(comm, ds, batch_size=5, seed=0, epochs=2, prefetch=prefetch)
    batches = iter(loader)
    next(batches)
    loader.close()
    with pytest.raises(bbio.UsageError, match="the Loader is closed"):
        next(batches)
    with pytest.raises(bbio.UsageError, match="the Loader is closed"):
        iter(loader)
    ds.close()
    ds.close()  # again: nothing
    with pytest.raises(bbio.UsageError, match="the dataset is closed") as info:
        ds.read([0])
    assert str(root / "x.raw") in str(info.value)
    with pytest.raises(bbio.UsageError, match="the dataset is closed"):
        bbio.Loader(comm, ds, batch_size=5, seed=0)


# ------------------------------------------------------ read_planned, Loader edges


@pytest.mark.timeout(60)  # before the fix one case hung and the other read wrong samples
@pytest.mark.parametrize("case", ["swapped", "short"])
def test_read_planned_with_lists_that_differ_between_ranks_is_one_usage_error(comm, data, case):
    root, config = data
    size = comm.Get_size()
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        requests = [[r] for r in range(size)]
        if last_rank(comm):
            requests = requests[::-1] if case == "swapped" else requests[:-1]
        with pytest.raises(bbio.UsageError) as info:
            ds.read_planned(requests)
        message = same_everywhere(comm, info.value)
        expected = "passed different lists of ids" if case == "swapped" else "one list of ids per"
        assert expected in message and str(root / "x.raw") in message, message
        mine = ds.read_planned([[r] for r in range(size)])  # still in step, and right
        assert mine.view(np.int32).ravel().tolist() == [comm.Get_rank()]


@pytest.mark.timeout(60)  # before the fix the other ranks hung
def test_a_loader_given_no_dataset_on_one_rank_is_one_usage_error(comm, data):
    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        mine = str(root / "x.raw") if last_rank(comm) else ds
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(comm, mine, batch_size=3, seed=0, prefetch=0)
        message = same_everywhere(comm, info.value)
        assert "Loader needs a dataset opened with open_dataset, not str" in message, message
        assert len(ds.read([0])) == 1  # still in step


def test_a_prefetching_loader_is_iterated_once(comm, data):
    root, config = data
    with (
        bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds,
        bbio.Loader(comm, ds, batch_size=2, seed=0, prefetch=2) as loader,
    ):
        first = iter(loader)
        with pytest.raises(bbio.UsageError, match="can be iterated once"):
            iter(loader)  # before the fix: a second thread sharing the first one's queue
        assert sum(1 for _ in first) == len(loader)


def test_structured_samples_keep_their_fields(comm, data, shared_tmp):
    root, config = data
    record = np.dtype([("id", "<i4"), ("value", "<f8")])
    if comm.Get_rank() == 0:
        table = np.zeros(6, dtype=record)
        table["id"], table["value"] = np.arange(6), np.arange(6) / 2
        table.tofile(root / "table.raw")
        with h5py.File(root / "table.h5", "w") as f:
            f.create_dataset("rows", data=table)
    comm.Barrier()
    opened = [
        bbio.open_dataset(comm, root / "table.raw", sample_shape=(1,), dtype=record, config=config),
        bbio.open_dataset(comm, root / "table.h5", dataset="rows", config=config),
    ]
    for ds in opened:
        with ds:
            got = ds.read([4, 1])
            assert got.dtype.names == ("id", "value"), got.dtype
            assert got["id"].ravel().tolist() == [4, 1]
            assert got["value"].ravel().tolist() == [2.0, 0.5]


# ------------------------------------------------------------ review findings


LINKED = np.arange(64, dtype="<i8").reshape(16, 4) + 1000  # other.h5's dataset
PADDING = np.full((128, 4), -7, dtype="<i8")  # main.h5's own dataset


@pytest.mark.parametrize("link", ["external", "external, staged", "soft"])
def test_a_dataset_reached_through_a_link_is_read_from_the_file_holding_it(comm, shared_tmp, link):
    """Before, a dataset in another file was read at its offset in the opened file."""
    root = shared_tmp / "pfs" / "linked"
    if comm.Get_rank() == 0:
        root.mkdir(parents=True)
        with h5py.File(root / "other.h5", "w") as f:
            f.create_dataset("data", data=LINKED)
        with h5py.File(root / "main.h5", "w") as f:
            f.create_dataset("pad", data=PADDING)  # something else where other.h5's data sits
            f["x"] = h5py.ExternalLink("other.h5", "/data")
            f["s"] = h5py.SoftLink("/pad")
    comm.Barrier()
    config = config_for(comm, shared_tmp)
    if link == "external, staged":
        bbio.stage_in(comm, root, f"{config.bb_root}/linked", config=config)
        if comm.Get_rank() == 0:  # only the burst buffers' copies are left to read
            (root / "other.h5").rename(shared_tmp / "other.h5")
        comm.Barrier()
    name, expected = ("s", PADDING) if link == "soft" else ("x", LINKED)
    with bbio.open_dataset(comm, root / "main.h5", dataset=name, config=config) as ds:
        assert len(ds) == len(expected)
        ids = [comm.Get_rank(), len(ds) - 1 - comm.Get_rank()]
        assert ds.read(ids).tolist() == expected[ids].tolist()
        held = "main.h5" if link == "soft" else "other.h5"
        assert ds.layout.files == [str(root / held)]
        assert bool(ds.local) == (link == "external, staged")


@pytest.mark.timeout(60)  # before the fix the other node's ranks hung
@pytest.mark.parametrize("damaged", ["registry", "manifest"])
def test_a_damaged_staging_record_on_one_node_is_one_error_everywhere(comm, data, damaged):
    root, config = data
    bbio.stage_in(comm, root, f"{config.bb_root}/pfs", config=config)
    node_1 = Path(config.bb_root.replace("{node}", "1"))
    staged = {"registry": registry.registry_path(node_1), "manifest": manifest_path(node_1 / "pfs")}
    record = staged[damaged]
    if comm.Get_rank() == 0:
        record.write_text('{"format": ')
    comm.Barrier()
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config).close()
    message = same_everywhere(comm, info.value)
    assert f"failed on rank {comm.Get_size() // 2}" in message, message
    assert "the file is damaged: not valid JSON" in message and str(record) in message, message


@pytest.mark.parametrize("mode", ["aggregated", "alone"])
@pytest.mark.parametrize("ids", ["uint64", "python int", "python int beside a negative"])
def test_ids_beyond_int64_are_named_as_passed(comm, data, mode, ids):
    """Before, a uint64 id wrapped to a negative one in the message, a Python int beyond
    64 bits was "not an integer", and one beside a negative id (NumPy makes the list
    float64) was named as a float."""
    root, config = data
    config = dataclasses.replace(config, **MODES[mode])
    big = {"uint64": 2**63 + 5, "python int": 2**70, "python int beside a negative": 2**64 - 1}[ids]
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        wrong = {
            "uint64": [3, big],
            "python int": [3, big],
            "python int beside a negative": [3, big, -1],
        }[ids]
        wrong = np.array(wrong, dtype=np.uint64) if ids == "uint64" else wrong
        with pytest.raises(bbio.UsageError) as info:
            ds.read(wrong if last_rank(comm) else [3])
        message = same_everywhere(comm, info.value)
        assert f"sample id {big} (asked by rank {comm.Get_size() - 1}) is out of range" in message


def test_an_empty_hdf5_dataset_opens_with_no_samples(comm, data):
    """Before, it was refused as "chunked, compressed or not yet written"."""
    root, config = data
    if comm.Get_rank() == 0:
        with h5py.File(root / "empty.h5", "w") as f:
            f.create_dataset("x", data=np.zeros((0, 4), dtype="<i4"))
    comm.Barrier()
    with bbio.open_dataset(comm, root / "empty.h5", config=config) as ds:
        assert len(ds) == 0
        assert ds.read([]).shape == (0, 4)
        with bbio.Loader(comm, ds, batch_size=2, seed=0) as loader:
            assert list(loader) == []


@pytest.mark.timeout(60)  # before the fix: raw MPI errors, or hangs
def test_a_second_loader_while_the_first_prefetches_is_one_usage_error(comm, data):
    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        first = bbio.Loader(comm, ds, batch_size=2, seed=0, prefetch=3)
        batches = iter(first)
        next(batches)  # its thread now reads ahead
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(comm, ds, batch_size=3, seed=1, prefetch=0)
        message = same_everywhere(comm, info.value)
        assert "another Loader of this dataset is still iterating" in message, message
        assert "close it" in message, message
        rest = list(batches)  # the first is undisturbed and runs to its end
        assert len(rest) == len(first) - 1
        with bbio.Loader(comm, ds, batch_size=3, seed=1, prefetch=2) as second:  # now allowed
            for batch in second:
                assert batch.view(np.int32).ravel().tolist() == second.indices.tolist()
        first.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given", ["None", "MPI.COMM_NULL"])
def test_a_loader_given_no_communicator_on_every_rank_is_one_usage_error(comm, data, given):
    """The documented choice: the first agreement is over ``comm``, which every rank must
    pass; only when no rank does, it is over the dataset's communicator."""
    from mpi4py import MPI

    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(None if given == "None" else MPI.COMM_NULL, ds, batch_size=3, seed=0)
        message = same_everywhere(comm, info.value)
        name = "NoneType" if given == "None" else "a freed communicator"
        assert f"Loader needs the communicator the dataset was opened with, not {name}" in message
        assert len(ds.read([0])) == 1  # still in step


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mode, link",
    [("shard", "inside"), ("replicate", "leaving"), ("replicate", "leaving, target staged")],
)
def test_an_external_link_in_a_staged_file_is_resolved_on_the_pfs(comm, shared_tmp, mode, link):
    """Before, rank 0 resolved the link against its node's staged copy: in shard mode, or
    for a link leaving the staged tree, the target was not found; in replicate mode every
    node read node 0's burst buffer."""
    pfs = shared_tmp / "pfs"
    tree = pfs / "tree"
    if comm.Get_rank() == 0:
        (pfs / "other").mkdir(parents=True)
        tree.mkdir()
        with h5py.File(tree / "target.h5", "w") as f:
            f.create_dataset("data", data=LINKED)
        with h5py.File(pfs / "other" / "outside.h5", "w") as f:
            f.create_dataset("pad", data=PADDING)  # the data at another offset than target.h5's
            f.create_dataset("data", data=LINKED)
        with h5py.File(tree / "main.h5", "w") as f:
            f.create_dataset("pad", data=PADDING)
            f["inside"] = h5py.ExternalLink("target.h5", "/data")
            f["leaving"] = h5py.ExternalLink("../other/outside.h5", "/data")
    comm.Barrier()
    config = config_for(comm, shared_tmp)
    bbio.stage_in(comm, tree, f"{config.bb_root}/tree", mode=mode, config=config)
    if link == "leaving, target staged":
        bbio.stage_in(comm, pfs / "other", f"{config.bb_root}/other", mode=mode, config=config)
    name = link.split(",")[0]
    with bbio.open_dataset(comm, tree / "main.h5", dataset=name, config=config) as ds:
        ids = [comm.Get_rank(), len(ds) - 1 - comm.Get_rank()]
        assert ds.read(ids).tolist() == LINKED[ids].tolist()
        held = tree / "target.h5" if name == "inside" else pfs / "other" / "outside.h5"
        assert ds.layout.files == [os.path.realpath(held)]
        own_bb = config.bb_root.replace("{node}", str(ds.node))
        read = ds._path(0)
        assert read == ds.layout.files[0] or read.startswith(own_bb + "/"), (read, own_bb)
        if link == "leaving, target staged":
            assert read == os.path.realpath(f"{own_bb}/other/outside.h5")


@pytest.mark.timeout(60)  # before the fix: refused although the first loader had ended
def test_a_loader_whose_steps_were_all_taken_by_next_does_not_block_another(comm, data):
    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        first = bbio.Loader(comm, ds, batch_size=3, seed=0, epochs=2, start_step=1)
        batches = iter(first)
        for _ in range(2 * len(first) - 1):  # every step, never asking for the end marker
            next(batches)
        with bbio.Loader(comm, ds, batch_size=4, seed=1) as second:
            for batch in second:
                assert batch.view(np.int32).ravel().tolist() == second.indices.tolist()
        first.close()


@pytest.mark.timeout(60)  # before the fix: accepted, then raw MPI errors or wrong batches
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_is_refused_while_one_without_prefetch_is_mid_iteration(comm, data, prefetch):
    root, config = data
    with bbio.open_dataset(comm, root / "x.raw", record_bytes=4, config=config) as ds:
        first = bbio.Loader(comm, ds, batch_size=3, seed=0, prefetch=0)
        batches = iter(first)
        next(batches)
        with pytest.raises(bbio.UsageError) as info:
            bbio.Loader(comm, ds, batch_size=4, seed=1, prefetch=prefetch)
        message = same_everywhere(comm, info.value)
        assert "another Loader of this dataset is still iterating" in message, message
        rest = list(batches)  # undisturbed, to its end; then another is allowed
        assert len(rest) == len(first) - 1
        with bbio.Loader(comm, ds, batch_size=4, seed=1, prefetch=prefetch) as second:
            for batch in second:
                assert batch.view(np.int32).ravel().tolist() == second.indices.tolist()
        first.close()
