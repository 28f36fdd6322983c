"""Stage-in, stage-out, verify and pack on 2 or 4 ranks in 2 virtual nodes (real MPI and files)."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import crc32c as crc32c_package
import h5py
import numpy as np
import pytest

import bbio
from bbio.config import Config
from bbio.report import format_bytes
from bbio.stage import registry as stage_registry
from bbio.stage import run as stage_run
from bbio.stage.pack import INDEX_NAME, read_index
from bbio.stage.walk import walk
from bbio.transfer.files import read_manifest
from bbio.transfer.manifest import Entry

pytestmark = pytest.mark.mpi(min_size=2)


def two_nodes(comm, tmp: Path, **settings) -> Config:
    """Config that splits the ranks into 2 virtual nodes with BBs under ``tmp``."""
    return Config(
        bb_root=str(tmp / "bb" / "{node}"),
        ranks_per_node=comm.Get_size() // 2,
        progress="never",
        **settings,
    )


def make_tree(root: Path, seed: int = 0) -> dict[str, bytes]:
    """A source tree with small, empty, chunked and oddly named files; returns {path: bytes}."""
    rng = np.random.default_rng(seed)
    contents = {
        "empty.bin": b"",
        "one.bin": b"x",
        "dir a/naïve file é.txt": b"non-ASCII and spaces\n",
        "deep/er/still/leaf.dat": rng.bytes(4097),
        "big/large.bin": rng.bytes(3 * 1024 * 1024 + 17),
    }
    for i in range(40):
        contents[f"many/s{i:03d}.bin"] = rng.bytes(int(rng.integers(0, 20_000)))
    for path, data in contents.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    (root / "empty dir").mkdir()
    os.chmod(root / "one.bin", 0o600)
    os.utime(root / "one.bin", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    os.symlink("big/large.bin", root / "link-inside")
    os.symlink(str(root / "one.bin"), root / "abs-link-inside")
    os.symlink("/etc/hostname", root / "link-outside")
    os.mkfifo(root / "a-fifo")
    return contents


@pytest.fixture
def tree(comm, shared_tmp):
    src = shared_tmp / "pfs" / "data"
    contents = None
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        contents = make_tree(src)
    return src, comm.bcast(contents, root=0)


def files_under(root: Path) -> dict[str, bytes]:
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".bbio") or path.is_symlink() or not path.is_file():
            continue
        found[rel] = path.read_bytes()
    return found


def same_on_all_ranks(comm, value) -> bool:
    return comm.allgather(value) == [value] * comm.Get_size()


def test_walk_lists_alike_one_or_many_directories_at_a_time(comm, tree):
    src, contents = tree
    one, many = walk(comm, src, listers=1), walk(comm, src, listers=4)
    assert (one.entries, one.skipped) == (many.entries, many.skipped)
    assert same_on_all_ranks(comm, [e.path for e in many.entries])
    assert {e.path for e in many.files} == set(contents)


def test_replicate_gives_every_node_the_whole_tree_reading_each_byte_once(comm, shared_tmp, tree):
    src, contents = tree
    config = two_nodes(comm, shared_tmp, chunk_size=1 << 20, replicate_round_bytes=1 << 20)
    summary = bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "data", config=config)
    dataset = sum(len(b) for b in contents.values())
    assert summary.nodes == 2
    assert summary.dataset_bytes == dataset
    assert summary.source_bytes_read == dataset
    assert summary.bytes_written == 2 * dataset
    assert same_on_all_ranks(comm, dataclasses.astuple(summary)[:-1])
    assert sorted(s.path for s in summary.skipped) == ["a-fifo", "link-outside"]
    for node in (0, 1):
        dst = shared_tmp / "bb" / str(node) / "data"
        assert files_under(dst) == contents
        assert os.readlink(dst / "link-inside") == "big/large.bin"
        assert os.readlink(dst / "abs-link-inside") == "one.bin"
        assert not (dst / "link-outside").exists() and not (dst / "a-fifo").exists()
        assert (dst / "empty dir").is_dir()
        st = os.stat(dst / "one.bin")
        assert (st.st_mode & 0o777, st.st_mtime_ns) == (0o600, 1_600_000_000_123_456_789)
        manifest = read_manifest(dst)
        assert manifest.attrs["mode"] == "replicate" and manifest.attrs["node"] == node
        for entry in manifest.entries:
            if entry.kind == "file":
                assert entry.crc32c == crc32c_package.crc32c(contents[entry.path])
        assert not [p for p in dst.rglob("*bbio-part")]


def test_rerun_copies_only_what_changed(comm, shared_tmp, tree):
    src, _ = tree
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "data"
    first = bbio.stage_in(comm, src, dst, config=config)
    second = bbio.stage_in(comm, src, dst, config=config)
    assert second.files == 0 and second.bytes_written == 0
    assert second.unchanged == first.files - 2 * 2  # two symlinks per node are not files
    comm.Barrier()
    if comm.Get_rank() == 0:
        (src / "many" / "s007.bin").write_bytes(b"new content")
    comm.Barrier()
    third = bbio.stage_in(comm, src, dst, config=config)
    assert third.files == 2  # one file, on each node
    assert third.bytes_written == 2 * len(b"new content")
    for node in (0, 1):
        assert (shared_tmp / "bb" / str(node) / "data/many/s007.bin").read_bytes() == b"new content"


def test_leftovers_of_an_interrupted_run_are_removed(comm, shared_tmp, tree):
    src, contents = tree
    config = two_nodes(comm, shared_tmp)
    stale = [shared_tmp / "bb" / str(n) / "l" / "many" / ".gone.bin.bbio-part" for n in (0, 1)]
    stale += [  # a manifest's, written under a unique temporary name
        shared_tmp / "bb" / str(n) / "l" / ".bbio" / ".manifest.json.123-0123abcd-bbio-part"
        for n in (0, 1)
    ]
    if comm.Get_rank() == 0:
        for path in stale:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"half of a file that is no longer wanted")
    comm.Barrier()
    bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "l", config=config)
    assert not any(path.exists() for path in stale)
    assert files_under(shared_tmp / "bb" / "1" / "l") == contents


@pytest.mark.parametrize("round_bytes", [4 << 30, 1 << 20])  # one round; several
def test_shard_puts_each_file_on_one_node(comm, shared_tmp, tree, round_bytes):
    src, contents = tree
    config = two_nodes(comm, shared_tmp, stage_round_bytes=round_bytes)
    name = f"s{round_bytes}"
    summary = bbio.stage_in(
        comm, src, shared_tmp / "bb" / "{node}" / name, mode="shard", verify=True, config=config
    )
    assert summary.verified
    on_node = [files_under(shared_tmp / "bb" / str(n) / name) for n in (0, 1)]
    assert not set(on_node[0]) & set(on_node[1])
    assert {**on_node[0], **on_node[1]} == contents
    assert on_node[0] and on_node[1]
    for node in (0, 1):
        manifest = read_manifest(shared_tmp / "bb" / str(node) / name)
        holders = {e.path: e.node for e in manifest.entries if e.kind == "file"}
        assert set(holders) == set(contents)
        assert {p for p, n in holders.items() if n == node} == set(on_node[node])


def test_filters_and_an_empty_tree(comm, shared_tmp, tree):
    src, contents = tree
    config = two_nodes(comm, shared_tmp)
    bbio.stage_in(
        comm,
        src,
        shared_tmp / "bb" / "{node}" / "f",
        include=["many/*", "*.txt"],
        exclude=["many/s00*"],
        config=config,
    )
    expected = {
        p: b
        for p, b in contents.items()
        if (p.startswith("many/") or p.endswith(".txt")) and not p.startswith("many/s00")
    }
    assert files_under(shared_tmp / "bb" / "0" / "f") == expected
    assert not (shared_tmp / "bb" / "0" / "f" / "deep").exists()
    empty = shared_tmp / "pfs" / "empty"
    if comm.Get_rank() == 0:
        empty.mkdir()
    comm.Barrier()
    summary = bbio.stage_in(comm, empty, shared_tmp / "bb" / "{node}" / "e", config=config)
    assert (summary.files, summary.dataset_bytes) == (0, 0)
    assert read_manifest(shared_tmp / "bb" / "1" / "e").entries == []


def test_missing_source_is_the_same_clear_error_on_every_rank(comm, shared_tmp):
    with pytest.raises(bbio.NotFoundError) as info:
        bbio.stage_in(
            comm,
            shared_tmp / "nope",
            shared_tmp / "bb" / "{node}",
            config=two_nodes(comm, shared_tmp),
        )
    assert "the source does not exist" in str(info.value)
    assert same_on_all_ranks(comm, str(info.value))


def test_virtual_nodes_sharing_one_destination_are_refused_on_every_rank(comm, shared_tmp, tree):
    src, _ = tree
    with pytest.raises(bbio.ConfigError, match="virtual nodes") as info:
        bbio.stage_in(comm, src, shared_tmp / "bb" / "shared", config=two_nodes(comm, shared_tmp))
    assert same_on_all_ranks(comm, str(info.value))
    assert not (shared_tmp / "bb" / "shared").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_full_burst_buffer_is_refused_before_any_copy(comm, shared_tmp, tree):
    src, contents = tree
    small = shared_tmp / "small"
    if comm.Get_rank() == 0:
        small.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    comm.Barrier()
    try:
        config = dataclasses.replace(two_nodes(comm, shared_tmp), bb_root=str(small / "{node}"))
        with pytest.raises(bbio.NoSpaceError) as info:
            bbio.stage_in(comm, src, small / "{node}", config=config)
        message = str(info.value)
        needed = sum(len(b) for b in contents.values())
        assert f"needs {format_bytes(needed)} ({needed} bytes)" in message
        assert "free" in message and "node 0" in message
        assert same_on_all_ranks(comm, message)
        assert not [p for p in small.rglob("*") if p.is_file()]
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", str(small)], check=True)


def _keep_changing(path: Path, stop: threading.Event, seconds: float | None) -> None:
    end = None if seconds is None else time.monotonic() + seconds
    counter = 0
    while not stop.is_set() and (end is None or time.monotonic() < end):
        counter += 1
        with open(path, "ab") as f:
            f.write(b"+")
        os.utime(path, ns=(counter, counter))
        time.sleep(0.0005)


@pytest.mark.parametrize("writer_seconds", [0.3, None], ids=["changes-then-stops", "never-stops"])
def test_a_file_that_changes_during_the_copy(comm, shared_tmp, writer_seconds):
    src = shared_tmp / "pfs" / "hot"
    config = two_nodes(comm, shared_tmp)
    stop = threading.Event()
    writer = None
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        (src / "calm.bin").write_bytes(b"calm")
        (src / "hot.log").write_bytes(b"start")
        writer = threading.Thread(
            target=_keep_changing, args=(src / "hot.log", stop, writer_seconds)
        )
        writer.start()
    comm.Barrier()
    try:
        dst = shared_tmp / "bb" / "{node}" / "hot"
        if writer_seconds is not None:
            summary = bbio.stage_in(comm, src, dst, config=config)
            assert summary.files == 4
            comm.Barrier()
            final = (src / "hot.log").read_bytes()
            assert (shared_tmp / "bb" / "1" / "hot" / "hot.log").read_bytes() == final
        else:
            with pytest.raises(
                bbio.IntegrityError, match=r"kept changing while being copied: hot\.log"
            ):
                bbio.stage_in(comm, src, dst, config=config)
            comm.Barrier()
            for node in ("0", "1"):  # before, a full-size temporary copy stayed on each node
                assert not list((shared_tmp / "bb" / node / "hot").glob("*bbio-part"))
            summary = bbio.stage_in(comm, src, dst, skip_unreadable=True, config=config)
            assert [s.path for s in summary.skipped] == ["hot.log"]
            assert not (shared_tmp / "bb" / "0" / "hot" / "hot.log").exists()
            assert (shared_tmp / "bb" / "0" / "hot" / "calm.bin").read_bytes() == b"calm"
            assert "hot.log" not in {e.path for e in read_manifest(shared_tmp / "bb/0/hot").entries}
            assert read_manifest(shared_tmp / "bb/0/hot").attrs["complete"] is False
    finally:
        stop.set()
        if writer:
            writer.join()


def change_until_copied(hot: Path, copies: list[Path], stop: threading.Event) -> None:
    """Change ``hot`` (its size and mtime) until one of ``copies`` (its temporary or final
    copy) exists, or ``stop``."""
    counter = 0
    while not stop.is_set() and not any(c.exists() for c in copies):
        counter += 1
        with open(hot, "ab") as f:
            f.write(b"+")
        os.utime(hot, ns=(counter, counter))
        time.sleep(0.0005)


def _change_until_copied(hot: Path, copies: list[Path], stop: threading.Event) -> None:
    """Change ``hot`` until a copy of it exists, then replace its directory with a file:
    the copy saw it change, its retry finds it gone."""
    change_until_copied(hot, copies, stop)
    shutil.rmtree(hot.parent)
    hot.parent.write_bytes(b"a file where the directory was")


def stage_in_while_changing(comm, change, args: tuple, src: Path, name: str, config: Config):
    """Collective: stage ``src`` into each node's ``bb/NODE/name`` (shard mode) while rank
    0 runs ``change(*args, stop)`` in a thread, stopped once the stage-in ends."""
    stop, writer = threading.Event(), None
    if comm.Get_rank() == 0:
        writer = threading.Thread(target=change, args=(*args, stop))
        writer.start()
    comm.Barrier()
    try:
        dst = Path(config.bb_root) / name  # bb_root holds {node}
        return bbio.stage_in(comm, src, dst, mode="shard", config=config)
    finally:
        stop.set()
        if writer:
            writer.join()


def assert_removed_during_the_copy(comm, summary, path: str) -> None:
    """Every rank's summary skips exactly ``path``, as removed during the copy."""
    skips = comm.allgather([(s.path, s.reason) for s in summary.skipped])
    assert skips == [[(path, "removed during the copy")]] * comm.Get_size()


@pytest.mark.timeout(120)
def test_a_file_gone_during_the_copy_is_skipped_alike_on_every_node(comm, shared_tmp):
    """Shard mode: one node copies a/hot.log, sees it change, and finds its directory
    replaced by a file when it tries again.  Every rank reports the same skip, and no
    node's manifest lists the file or calls the copy complete."""
    src = shared_tmp / "pfs" / "going"
    config = two_nodes(comm, shared_tmp)
    copies = [
        shared_tmp / "bb" / node / "going" / "a" / name
        for node in ("0", "1")
        for name in ("hot.log", ".hot.log.bbio-part")
    ]
    if comm.Get_rank() == 0:
        (src / "a").mkdir(parents=True)
        (src / "a" / "hot.log").write_bytes(b"start")
        (src / "calm.bin").write_bytes(b"calm")
    summary = stage_in_while_changing(
        comm, _change_until_copied, (src / "a" / "hot.log", copies), src, "going", config
    )
    assert_removed_during_the_copy(comm, summary, "a/hot.log")
    for node in ("0", "1"):
        left = read_manifest(shared_tmp / "bb" / node / "going")
        assert "a/hot.log" not in {e.path for e in left.entries}
        assert left.attrs["complete"] is False


def test_a_file_gone_since_the_walk_gets_no_checksum(comm, shared_tmp):
    """Files found up to date whose CRC32C is unknown are read from the source: one
    removed since the walk is left without a CRC32C (copied again by the next run), not
    an error at the end of the stage-in."""
    src = shared_tmp / "pfs" / "gone"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        (src / "kept").write_bytes(b"kept")
    comm.Barrier()
    kept, gone = (
        Entry(name, "file", size=4, mtime_ns=(src / "kept").stat().st_mtime_ns)
        for name in ("kept", "gone")
    )
    crcs = stage_run._crcs_of_unchanged(comm, src, [kept, gone], None, granularity_ns=1)
    assert crcs == {"kept": crc32c_package.crc32c(b"kept")}


def test_stage_out_merges_nodes_and_refuses_conflicts(comm, shared_tmp):
    config = two_nodes(comm, shared_tmp)
    topo_node = comm.Get_rank() // (comm.Get_size() // 2)
    out_src = shared_tmp / "bb" / str(topo_node) / "out"
    if comm.Get_rank() % (comm.Get_size() // 2) == 0:
        (out_src / "results").mkdir(parents=True)
        (out_src / "results" / f"node{topo_node}.npy").write_bytes(bytes([topo_node]) * 1000)
        (out_src / "same.txt").write_bytes(b"identical")
        os.utime(out_src / "same.txt", ns=(5, 5))
    comm.Barrier()
    dst = shared_tmp / "pfs" / "results"
    summary = bbio.stage_out(
        comm, shared_tmp / "bb" / "{node}" / "out", dst, verify=True, config=config
    )
    assert summary.files == 3
    assert files_under(dst) == {
        "results/node0.npy": b"\0" * 1000,
        "results/node1.npy": b"\1" * 1000,
        "same.txt": b"identical",
    }
    nodes = {e.path: e.node for e in read_manifest(dst).entries if e.kind == "file"}
    assert nodes == {"results/node0.npy": 0, "results/node1.npy": 1, "same.txt": 0}
    report = bbio.verify(comm, shared_tmp / "bb" / "{node}" / "out", dst, config=config)
    assert not report.problems
    comm.Barrier()
    if comm.Get_rank() == comm.Get_size() - 1:
        (shared_tmp / "bb" / "1" / "out" / "same.txt").write_bytes(b"different")
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError, match=r"same.txt \(nodes 0, 1\)"):
        bbio.stage_out(
            comm, shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "r2", config=config
        )
    comm.Barrier()
    if comm.Get_rank() == comm.Get_size() - 1:  # same size and mtime, other bytes: one tick
        os.utime(shared_tmp / "bb" / "1" / "out" / "same.txt", ns=(5, 5))
    comm.Barrier()
    with pytest.raises(bbio.AlreadyExistsError, match=r"same.txt \(nodes 0, 1\)"):
        bbio.stage_out(
            comm, shared_tmp / "bb" / "{node}" / "out", shared_tmp / "pfs" / "r3", config=config
        )


def test_verify_finds_a_corrupted_copy(comm, shared_tmp, tree):
    src, _ = tree
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "v"
    bbio.stage_in(comm, src, dst, config=config)
    assert not bbio.verify(comm, src, dst, config=config).problems
    victim = shared_tmp / "bb" / "1" / "v" / "deep/er/still/leaf.dat"
    comm.Barrier()
    if comm.Get_rank() == 0:
        st = victim.stat()
        with open(victim, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    comm.Barrier()
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.verify(comm, src, dst, config=config)
    assert str(victim) in str(info.value)
    assert same_on_all_ranks(comm, str(info.value))


def test_pack_and_read_back_with_plain_h5py(comm, shared_tmp, tree):
    src, contents = tree
    out = shared_tmp / "packed"
    summary = bbio.pack(comm, src, out, shard_size=64 << 10, config=two_nodes(comm, shared_tmp))
    assert summary.samples == len(contents)
    shards = read_index(out)
    assert summary.shards == len(shards) > 2
    names = sorted(contents)
    seen = []
    for info in shards:
        with h5py.File(out / info.file, "r") as f:
            assert f.attrs["first_sample"] == len(seen)
            for i, name in enumerate(f["names"].asstr()[:]):
                start, size = int(f["offsets"][i]), int(f["sizes"][i])
                data = bytes(f["data"][start : start + size])
                assert data == contents[name]
                assert int(f["crc32c"][i]) == crc32c_package.crc32c(data)
                seen.append(name)
        with open(out / info.file, "rb") as raw:  # the data offset allows plain preads
            raw.seek(info.data_offset)
            assert raw.read(8) == contents[seen[info.first_sample]][:8]
    assert seen == names
    staged = bbio.stage_in(
        comm, out, shared_tmp / "bb" / "{node}" / "p", config=two_nodes(comm, shared_tmp)
    )
    assert staged.files == 2 * (len(shards) + 1)  # shards and the index, on each node
    assert (shared_tmp / "bb" / "1" / "p" / INDEX_NAME).exists()


def test_packing_again_withdraws_the_old_index_first(comm, shared_tmp):
    """A pack into the directory of an earlier one replaces its shards: one that fails
    midway leaves no index (never the old one, naming shards that now hold other
    samples); one that succeeds removes the shards its index no longer lists."""
    src, out = shared_tmp / "pfs" / "repack", shared_tmp / "pfs" / "repacked"
    config = two_nodes(comm, shared_tmp)
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for name in "bcde":
            (src / name).write_bytes(name.encode() * 1000)
    comm.Barrier()
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 4
    if comm.Get_rank() == 0:
        (src / "a").write_bytes(b"a" * 1000)  # every sample moves one place on
        (out / "shard-00001.h5").unlink()
        (out / "shard-00001.h5").mkdir()  # the new shard 1 cannot be renamed into place
        (out / ".shard-00009.h5.bbio-part").write_bytes(b"a killed pack's")
    comm.Barrier()
    with pytest.raises(bbio.BBIOError, match=r"shard-00001\.h5"):
        bbio.pack(comm, src, out, shard_size=1000, config=config)
    with pytest.raises(bbio.NotFoundError, match="no index"):
        read_index(out)
    assert not (out / ".shard-00009.h5.bbio-part").exists()
    comm.Barrier()
    if comm.Get_rank() == 0:
        (out / "shard-00001.h5").rmdir()
        for name in "ab":
            (src / name).unlink()
    comm.Barrier()
    assert bbio.pack(comm, src, out, shard_size=1000, config=config).shards == 3
    assert sorted(p.name for p in out.iterdir()) == [INDEX_NAME] + [
        f"shard-0000{i}.h5" for i in range(3)
    ]


def test_module_level_api_matches_stage_run():
    assert bbio.stage_in is stage_run.stage_in and bbio.stage_out is stage_run.stage_out


def test_a_registry_that_cannot_be_written_fails_no_stage_in(comm, shared_tmp, tree, caplog):
    """A stage-in to a destination of its own, with bb_root where the job cannot write:
    before, it copied everything and then failed writing the registry of staged copies."""
    src, contents = tree
    unwritable = shared_tmp / "not-a-directory"
    if comm.Get_rank() == 0:
        unwritable.write_bytes(b"")
    comm.Barrier()
    config = Config(
        bb_root=str(unwritable / "{node}"), ranks_per_node=comm.Get_size() // 2, progress="never"
    )
    dst = shared_tmp / "dst" / "{node}"
    with caplog.at_level("WARNING", logger="bbio"):
        bbio.stage_in(comm, src, dst, config=config)
    node = comm.Get_rank() // (comm.Get_size() // 2)
    assert files_under(shared_tmp / "dst" / str(node)) == contents
    if comm.Get_rank() % (comm.Get_size() // 2) == 0:  # a node's leader writes its registry
        assert "could not be written" in caplog.text and str(unwritable) in caplog.text
        assert "reads the PFS" in caplog.text


def test_a_registry_that_cannot_be_written_and_names_another_copy_fails_the_stage_in(
    comm, shared_tmp, monkeypatch, caplog
):
    """The registry still sends readers of the source to an earlier copy (d1) when it cannot
    record the new one (d2): before, a warning said they read the PFS, and open_dataset
    served d1's stale bytes.  Staged again into d1, the copy the registry names, only a
    warning says the registry could not be written."""
    config = two_nodes(comm, shared_tmp)
    src = shared_tmp / "pfs" / "ds"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        (src / "s0.bin").write_bytes(b"OLD sample bytes")
    comm.Barrier()
    d1 = shared_tmp / "bb" / "{node}" / "d1"
    bbio.stage_in(comm, src, d1, config=config)
    if comm.Get_rank() == 0:
        (src / "s0.bin").write_bytes(b"NEW sample bytes")
    comm.Barrier()

    def read_only(*args) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(stage_registry, "record", read_only)
    with pytest.raises(bbio.PermissionDeniedError) as info:
        bbio.stage_in(comm, src, shared_tmp / "d2" / "{node}", config=config)
    message = str(info.value)
    assert same_on_all_ranks(comm, message)
    registry_of_node_0 = stage_registry.registry_path(shared_tmp / "bb" / "0")
    assert str(registry_of_node_0) in message
    assert str((shared_tmp / "bb" / "0" / "d1").resolve()) in message and "Stage in to" in message
    with caplog.at_level("WARNING", logger="bbio"):
        again = bbio.stage_in(comm, src, d1, config=config)
    assert again.files == 2  # s0.bin on each node
    if comm.Get_rank() % (comm.Get_size() // 2) == 0:  # a node's leader writes its registry
        assert "could not be written" in caplog.text and "already names" in caplog.text
