"""The walk's exclusion of whole directories, and what ``bbio pack`` refuses or leaves out:
files changed since the walk (torn, replaced by a symlink or a FIFO) and paths that are
not regular files.  MPI tests on 2 or 4 ranks in 2 virtual nodes, with real files."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

import bbio
from bbio.stage import pack as pack_module
from bbio.stage import walk as walk_module
from bbio.stage.pack import INDEX_NAME
from bbio.stage.walk import excluded_dir, walk
from bbio.transfer.manifest import FILE, Entry
from tests.test_stage import same_on_all_ranks, two_nodes

OLD_MTIME_NS = 1_600_000_000_000_000_000  # older than any write the test makes


# ------------------------------------------------------------ the rule (serial)


@pytest.mark.parametrize(
    ("directory", "exclude", "left_out"),
    [
        ("private", ["private/*"], True),
        ("private", ["priv*"], True),
        ("a/cache", ["*/cache/*"], True),
        ("private", ["*"], True),
        ("private/secret", ["private/*"], True),
        ("private", ["private/*.bin"], False),  # not everything under it
        ("private", ["private/?*"], False),  # everything, but not "private/": not left out
        ("a/private", ["private/*"], False),
        ("private", [], False),
    ],
)
def test_excluded_dir_leaves_out_exactly_directories_a_glob_covers(directory, exclude, left_out):
    assert excluded_dir(directory, exclude) is left_out
    if left_out:  # then the glob matches whatever lies under the directory
        under = ["x", ".hidden", "deep/er/f.bin", "a b/é"]
        assert all(
            any(fnmatch.fnmatchcase(f"{directory}/{rel}", p) for p in exclude) for rel in under
        )


def test_a_repack_needs_room_for_each_shard_beyond_the_one_it_replaces(tmp_path, monkeypatch):
    """Shards are written in any order, each once the earlier pack's shard of its name is
    deleted: one that grows needs its growth free even where another shrinks more (before,
    only the total was checked, and the growing shard could fill the device)."""
    (tmp_path / pack_module.shard_name(0)).write_bytes(b"\0" * 1000)
    (tmp_path / pack_module.shard_name(1)).write_bytes(b"\0" * 900_000)
    shards = [[Entry("grows", FILE, size=600_000)], [Entry("shrinks", FILE, size=1000)]]
    growth = pack_module.shard_bytes(shards[0]) - 1000
    monkeypatch.setattr(pack_module.files, "free_bytes", lambda path: growth - 1)
    with pytest.raises(bbio.NoSpaceError, match=f"needs about .* [(]{growth} bytes[)]"):
        pack_module._check_capacity(tmp_path, shards)
    monkeypatch.setattr(pack_module.files, "free_bytes", lambda path: growth)
    pack_module._check_capacity(tmp_path, shards)


# --------------------------------------------------------------- MPI tests


@pytest.fixture
def src(comm, shared_tmp) -> Path:
    """Six files of 1000 to 6000 bytes in two directories, with an mtime in the past."""
    root = shared_tmp / "pfs" / "src"
    if comm.Get_rank() == 0:
        for i in range(6):
            path = root / f"d{i % 2}" / f"f{i}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes([i]) * (1000 * (i + 1)))
            os.utime(path, ns=(OLD_MTIME_NS, OLD_MTIME_NS))
    comm.Barrier()
    return root


@pytest.mark.mpi(min_size=2)
def test_a_walk_leaves_out_excluded_directories_with_what_they_hold(comm, src, monkeypatch):
    everything = walk(comm, src)
    listing = walk_module._list_and_stat
    listed: list[str] = []

    def recording(root, rel, include, exclude):  # the real listing, and which directory
        listed.append(rel)
        return listing(root, rel, include, exclude)

    monkeypatch.setattr(walk_module, "_list_and_stat", recording)
    pruned = walk(comm, src, exclude=["d1/*"])
    assert [e.path for e in pruned.entries] == [
        e.path for e in everything.entries if not e.path.startswith("d1")
    ]
    assert same_on_all_ranks(comm, [e.path for e in pruned.entries])
    entered = sorted(set().union(*comm.allgather(set(listed))))
    assert entered and not [rel for rel in entered if rel.startswith("d1")], entered


def _replace(path: Path, how: str) -> None:
    """Change ``path`` (a file of the source) the way ``how`` says."""
    if how == "rewritten":  # in place, same size, other bytes: only its mtime tells
        path.write_bytes(b"\xee" * path.stat().st_size)
    elif how == "grown":
        with open(path, "ab") as f:
            f.write(b"+" * 100)
    elif how == "symlink":  # to a file of its size, outside the source
        elsewhere = path.parents[2] / "elsewhere.bin"
        elsewhere.write_bytes(b"\xee" * path.stat().st_size)
        path.unlink()
        path.symlink_to(elsewhere)
    else:
        path.unlink()
        os.mkfifo(path)  # opened without O_NONBLOCK, it would block the pack forever


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("slab", [None, 1000])
@pytest.mark.parametrize("how", ["rewritten", "grown", "symlink", "fifo"])
def test_pack_refuses_a_file_changed_since_the_walk(comm, shared_tmp, src, monkeypatch, how, slab):
    """d1/f3.bin changes between the (real) walk and its read: every rank raises the same
    IntegrityError naming it, and OUT holds no index and no temporary shard.  With
    ``slab`` 1000, its 4000 bytes are read a slab at a time, as a file over 64 MiB is."""
    if slab is not None:
        monkeypatch.setattr(pack_module, "_SLAB", slab)
    real_walk = pack_module.walk

    def walk_then_change(comm_, root, *args, **kwargs):
        tree = real_walk(comm_, root, *args, **kwargs)
        comm_.Barrier()
        if comm_.Get_rank() == 0:
            _replace(Path(root) / "d1" / "f3.bin", how)
        comm_.Barrier()
        return tree

    monkeypatch.setattr(pack_module, "walk", walk_then_change)
    out = shared_tmp / "packed"
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.pack(comm, src, out, shard_size=4000, config=two_nodes(comm, shared_tmp))
    message = str(info.value)
    assert same_on_all_ranks(comm, message), message
    assert "d1/f3.bin" in message and "run bbio pack again" in message, message
    expected = {
        "rewritten": "modified since the source was walked",
        "grown": "4000 bytes when the source was walked, 4100 now",
        "symlink": "is a symlink now",
        "fifo": "no longer a regular file",
    }[how]
    assert expected in message, message
    assert not (out / INDEX_NAME).exists()
    assert [p.name for p in out.iterdir() if "bbio-part" in p.name] == []


@pytest.mark.mpi(min_size=2)
def test_pack_names_what_it_does_not_pack(comm, shared_tmp, src):
    """Symlinks (inside or outside the source) and special files are not packed: the
    summary counts them and warns, naming the first five, on every rank alike."""
    links = [f"d0/link{i}" for i in range(6)]
    if comm.Get_rank() == 0:
        for link in links:
            (src / link).symlink_to("f0.bin")
        (src / "outside").symlink_to("/etc/hostname")
        os.mkfifo(src / "d1" / "a-fifo")
    comm.Barrier()
    summary = bbio.pack(comm, src, shared_tmp / "packed", config=two_nodes(comm, shared_tmp))
    assert summary.samples == 6
    assert summary.not_packed == sorted([*links, "outside", "d1/a-fifo"])
    assert len(summary.warnings) == 1, summary.warnings
    warning = summary.warnings[0]
    assert warning.startswith("8 path(s) of the source were not packed"), warning
    assert "d0/link0, d0/link1, d0/link2, d0/link3, d0/link4 (and 3 more)" in warning, warning
    assert same_on_all_ranks(comm, summary.warnings)
    report = summary.report()
    assert f"warning: {warning}" in report
    assert any(
        line.startswith("not packed (not regular files)") and line.split()[-1] == "8"
        for line in report.splitlines()
    ), report
    regular_only = bbio.pack(
        comm,
        src,
        shared_tmp / "filtered",
        exclude=["d0/link*", "outside", "*fifo"],
        config=two_nodes(comm, shared_tmp),
    )
    assert (regular_only.not_packed, regular_only.warnings) == ([], [])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_pack_reads_a_file_larger_than_a_slab_a_slab_at_a_time(comm, shared_tmp, monkeypatch):
    """Files of 1 to 4 slabs and more beside small ones: the large ones are read a slab at
    a time (before, each was read whole, so a rank needed memory for the largest file it
    packed), and every sample reads back byte for byte with its CRC32C."""
    import crc32c
    import h5py
    import numpy as np

    slab = 4096
    monkeypatch.setattr(pack_module, "_SLAB", slab)
    src, out = shared_tmp / "pfs" / "big", shared_tmp / "packed-big"
    sizes = {"a.bin": 10, "b.bin": slab + 1, "c.bin": 3 * slab, "d.bin": 7, "e.bin": 4 * slab + 5}
    contents = {
        name: np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        for name, size in sizes.items()
    }
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for name, data in contents.items():
            (src / name).write_bytes(data)
    comm.Barrier()
    largest_read = []
    real_read = pack_module._read_files

    def recording(src_, group, threads):
        largest_read.append(max(e.size for e in group))
        return real_read(src_, group, threads)

    monkeypatch.setattr(pack_module, "_read_files", recording)
    bbio.pack(comm, src, out, shard_size=1 << 20, config=two_nodes(comm, shared_tmp))
    assert max(largest_read, default=0) <= slab
    if comm.Get_rank() == 0:
        back = {}
        for info in pack_module.read_index(out):
            with h5py.File(out / info.file, "r") as f:
                for i, name in enumerate(f["names"].asstr()[:]):
                    start, size = int(f["offsets"][i]), int(f["sizes"][i])
                    back[name] = bytes(f["data"][start : start + size])
                    assert int(f["crc32c"][i]) == crc32c.crc32c(back[name]), name
        assert back == contents


@pytest.mark.parametrize(
    "entries", [7, [{"source": 5, "destination": "/bb/x"}], [["/pfs/x", "/bb/x"]], [{}]]
)
def test_a_registry_of_staged_copies_with_entries_of_other_types_is_damaged(tmp_path, entries):
    """Before: an AttributeError or TypeError from deep inside the lookup."""
    from bbio.errors import IntegrityError
    from bbio.stage import registry
    from bbio.transfer import files

    files.write_json_atomic(
        registry.registry_path(tmp_path), {"format": registry.FORMAT, "entries": entries}
    )
    with pytest.raises(IntegrityError, match="registry of staged copies is damaged"):
        registry.lookup(tmp_path, tmp_path / "x")
