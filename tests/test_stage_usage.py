"""Staging and pack given arguments or paths they cannot work with, or meeting a full or
damaged device: the same clear error on every rank, never a hang, a raw traceback, a
copy of the copies or advice that does not work.  On 2 or 4 ranks in 2 virtual nodes."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading
from pathlib import Path

import h5py
import pytest

import bbio
from bbio.stage import pack as pack_module
from bbio.transfer import files
from tests.test_stage import _keep_changing, files_under, same_on_all_ranks, two_nodes

pytestmark = pytest.mark.mpi(min_size=2)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def same_everywhere(comm, error: BaseException) -> str:
    message = str(error)
    assert same_on_all_ranks(comm, message), message
    return message


@pytest.fixture
def src(comm, shared_tmp) -> Path:
    """A small source tree on the shared 'PFS'."""
    root = shared_tmp / "pfs" / "src"
    if comm.Get_rank() == 0:
        for i in range(6):
            (root / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
            (root / f"d{i % 2}" / f"f{i}.bin").write_bytes(bytes([i]) * (1000 * (i + 1)))
    comm.Barrier()
    return root


@contextlib.contextmanager
def tmpfs(comm, where: Path, size: str, *options: str):
    """Rank 0 mounts a tmpfs of ``size`` at ``where`` for the block (every rank waits)."""
    if comm.Get_rank() == 0:
        where.mkdir(parents=True, exist_ok=True)
        spec = ",".join([f"size={size}", *options])
        subprocess.run(["mount", "-t", "tmpfs", "-o", spec, "tmpfs", str(where)], check=True)
    comm.Barrier()
    try:
        yield where
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            subprocess.run(["umount", str(where)], check=True)


def damage(comm, victim: Path) -> None:
    """Rank 0 flips one byte of ``victim``, keeping its size and mtime (a failing device)."""
    comm.Barrier()
    if comm.Get_rank() == 0:
        st = victim.stat()
        with open(victim, "r+b") as f:
            f.seek(10)
            byte = f.read(1)[0]
            f.seek(10)
            f.write(bytes([byte ^ 0xFF]))
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    comm.Barrier()


def grow_f5_after_the_walk(monkeypatch) -> None:
    """The next walks of a source (really done) are followed by 100 bytes appended to its
    d1/f5.bin by the first rank of the walk's communicator: a file that changes between
    the walk and its copy."""
    from bbio.stage import run

    real_walk = run.walk

    def walk_then_grow(comm_, root, *args):
        tree = real_walk(comm_, root, *args)
        comm_.Barrier()
        if comm_.Get_rank() == 0:
            with open(Path(root) / "d1" / "f5.bin", "ab") as f:
                f.write(b"+" * 100)
        comm_.Barrier()
        return tree

    monkeypatch.setattr(run, "walk", walk_then_grow)


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob("*bbio-part"))


# ------------------------------------------------------------ 1. a source missing on one node


def test_stage_out_with_a_source_missing_on_one_node_fails_alike_everywhere(comm, shared_tmp):
    if comm.Get_rank() == 0:
        (shared_tmp / "bb" / "0" / "only").mkdir(parents=True)
        (shared_tmp / "bb" / "0" / "only" / "a.txt").write_bytes(b"node 0's output")
    comm.Barrier()
    with pytest.raises(bbio.NotFoundError) as info:
        bbio.stage_out(
            comm,
            shared_tmp / "bb" / "{node}" / "only",
            shared_tmp / "pfs" / "out",
            config=two_nodes(comm, shared_tmp),
        )
    message = same_everywhere(comm, info.value)
    assert "node 1: the source does not exist" in message, message
    assert str(shared_tmp / "bb" / "1" / "only") in message, message
    assert not (shared_tmp / "pfs" / "out").exists()


# ------------------------------------------------- 2. different arguments on one rank


@pytest.mark.parametrize(
    ("call", "on_rank_1", "named"),
    [
        ("stage_in", {"verify": True}, "verify"),
        ("stage_in", {"mode": "shard"}, "mode"),
        ("stage_in", {"include": ["d0/*"]}, "include"),
        ("stage_in", {"src": "elsewhere"}, "src"),
        ("stage_out", {"verify": True}, "verify"),
        ("pack", {"shard_size": 1000}, "shard_size"),
        ("verify", {"dst": "elsewhere"}, "dst"),
    ],
    ids=[
        "stage-in-verify",
        "stage-in-mode",
        "stage-in-include",
        "stage-in-src",
        "stage-out",
        "pack",
        "verify",
    ],
)
def test_different_arguments_on_one_rank_are_one_usage_error(
    comm, shared_tmp, src, call, on_rank_1, named
):
    config = two_nodes(comm, shared_tmp)
    if call == "stage_in":
        arguments = {"src": src, "dst": shared_tmp / "bb" / "{node}" / "a"}
    elif call == "stage_out":
        arguments = {"src": shared_tmp / "bb" / "{node}" / "a", "dst": shared_tmp / "out"}
    elif call == "verify":
        arguments = {"src": src, "dst": shared_tmp / "bb" / "{node}" / "a"}
    else:
        arguments = {"src": src, "out": shared_tmp / "packed"}
    if comm.Get_rank() == 1:
        arguments.update(on_rank_1)
    with pytest.raises(bbio.UsageError) as info:
        getattr(bbio, call)(comm, config=config, **arguments)
    message = same_everywhere(comm, info.value)
    assert "the ranks passed different arguments" in message, message
    assert f"({named}: rank 0 " in message, message
    assert not (shared_tmp / "bb").exists() and not (shared_tmp / "packed").exists()


def test_verify_of_a_source_that_does_not_exist_says_so(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "w"
    bbio.stage_in(comm, src, dst, config=config)
    with pytest.raises(bbio.NotFoundError) as info:
        bbio.verify(comm, shared_tmp / "pfs" / "gone", dst, config=config)
    assert "the source does not exist" in same_everywhere(comm, info.value)


# -------------------------------------------------- 3. a destination inside the source


def test_a_destination_inside_the_source_is_refused(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    with pytest.raises(bbio.UsageError) as info:
        bbio.stage_in(comm, src, src / "copy" / "{node}", config=config)
    message = same_everywhere(comm, info.value)
    assert f"the destination {src / 'copy' / '0'} is inside the source {src}" in message
    with pytest.raises(bbio.UsageError) as info:
        bbio.pack(comm, src, src / "packed", config=config)
    message = same_everywhere(comm, info.value)
    assert f"the destination {src / 'packed'} is inside the source {src}" in message
    assert not (src / "copy").exists() and not (src / "packed").exists()

    out = shared_tmp / "bb" / "1" / "out"
    if comm.Get_rank() == 0:
        for node in (0, 1):
            (shared_tmp / "bb" / str(node) / "out").mkdir(parents=True)
            (shared_tmp / "bb" / str(node) / "out" / f"n{node}.txt").write_bytes(b"result")
    comm.Barrier()
    with pytest.raises(bbio.UsageError) as info:
        bbio.stage_out(comm, shared_tmp / "bb" / "{node}" / "out", out / "merged", config=config)
    message = same_everywhere(comm, info.value)
    assert f"node 1: the destination {out / 'merged'} is inside the source {out}" in message
    assert not (out / "merged").exists()


# ----------------------------------- 4. a damaged copy: the advice to rerun must work


def test_a_copy_found_damaged_is_copied_again_by_the_next_run(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "v"
    bbio.stage_in(comm, src, dst, config=config)
    victim = shared_tmp / "bb" / "1" / "v" / "d1" / "f3.bin"
    damage(comm, victim)
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.stage_in(comm, src, dst, verify=True, config=config)
    message = same_everywhere(comm, info.value)
    assert str(victim) in message and "rerun the command" in message, message
    assert "were deleted" in message and not victim.exists()
    left = files.read_manifest(shared_tmp / "bb" / "1" / "v")  # no longer lists the victim
    assert "d1/f3.bin" not in {e.path for e in left.entries} and not left.attrs["complete"]
    again = bbio.stage_in(comm, src, dst, verify=True, config=config)
    assert again.verified and again.files == 1  # the damaged copy, on node 1
    assert victim.read_bytes() == (src / "d1" / "f3.bin").read_bytes()
    assert files_under(shared_tmp / "bb" / "1" / "v") == files_under(src)


# ------------------------------------------------ 5. destinations that cannot be used


def test_a_destination_that_is_not_a_directory_is_named(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    if comm.Get_rank() == 0:
        for node in (0, 1):
            (shared_tmp / "files" / str(node)).parent.mkdir(exist_ok=True)
            (shared_tmp / "files" / str(node)).write_bytes(b"a file, not a directory")
        (shared_tmp / "a-file").write_bytes(b"a file, not a directory")
    comm.Barrier()
    with pytest.raises(bbio.NotDirectoryError) as info:
        bbio.stage_in(comm, src, shared_tmp / "files" / "{node}", config=config)
    message = same_everywhere(comm, info.value)
    assert "node 0: the destination is not a directory" in message, message
    assert str(shared_tmp / "files" / "0") in message and "move that file away" in message
    with pytest.raises(bbio.NotDirectoryError) as info:
        bbio.stage_in(comm, src, shared_tmp / "a-file" / "{node}" / "x", config=config)
    message = same_everywhere(comm, info.value)
    assert f"{shared_tmp / 'a-file'}, in the destination, is not a directory" in message
    with pytest.raises(bbio.NotDirectoryError) as info:
        bbio.pack(comm, src, shared_tmp / "a-file", config=config)
    assert "the destination is not a directory" in same_everywhere(comm, info.value)
    if comm.Get_rank() == 0:
        (shared_tmp / "bb" / "0" / "o").mkdir(parents=True)
        (shared_tmp / "bb" / "1" / "o").mkdir(parents=True)
    comm.Barrier()
    with pytest.raises(bbio.NotDirectoryError) as info:
        bbio.stage_out(
            comm, shared_tmp / "bb" / "{node}" / "o", shared_tmp / "a-file", config=config
        )
    assert "the destination is not a directory" in same_everywhere(comm, info.value)
    assert (shared_tmp / "a-file").read_bytes() == b"a file, not a directory"


@needs_root
def test_a_read_only_destination_is_named(comm, shared_tmp, src):
    with tmpfs(comm, shared_tmp / "ro", "1m", "ro") as ro:
        with pytest.raises(bbio.PermissionDeniedError) as info:
            bbio.stage_in(comm, src, ro / "{node}" / "x", config=two_nodes(comm, shared_tmp))
        message = same_everywhere(comm, info.value)
        assert f"node 0: {ro}, in the destination, may not be written" in message, message
        assert "Choose a destination you may write to" in message, message


# --------------------------------------------------------------- 6. full devices


@needs_root
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_burst_buffer_that_fills_up_during_the_copy(comm, shared_tmp, mode):
    """600 files of 100 bytes pass the capacity check of a 1 MiB tmpfs (60 kB), but take
    a 4 KiB page each: node 1's burst buffer fills up midway through the copy."""
    src = shared_tmp / "pfs" / "tiny"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for i in range(600):
            (src / f"t{i:03d}.bin").write_bytes(bytes([i % 256]) * 100)
    config = two_nodes(comm, shared_tmp, replicate_round_bytes=8 << 10)
    with tmpfs(comm, shared_tmp / "bb" / "1", "1m") as small:
        with pytest.raises(bbio.NoSpaceError) as info:
            bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "t", mode=mode, config=config)
        message = same_everywhere(comm, info.value)
        assert "node 1: cannot write" in message and "No space left on device" in message
        assert "filled up during the copy" in message, message
        assert temp_files(small) == [] and temp_files(shared_tmp / "bb" / "0") == []


@needs_root
def test_stage_out_capacity_advice_fits_stage_out(comm, shared_tmp):
    if comm.Get_rank() == 0:
        for node in (0, 1):
            (shared_tmp / "bb" / str(node) / "o").mkdir(parents=True)
            (shared_tmp / "bb" / str(node) / "o" / f"n{node}").write_bytes(b"x" * (1 << 20))
    comm.Barrier()
    with tmpfs(comm, shared_tmp / "small", "1m") as small:
        with pytest.raises(bbio.NoSpaceError) as info:
            bbio.stage_out(
                comm, shared_tmp / "bb" / "{node}" / "o", small, config=two_nodes(comm, shared_tmp)
            )
        message = same_everywhere(comm, info.value)
        assert "needs 2.0 MiB" in message and "stage out fewer files" in message, message
        assert "--mode" not in message


@needs_root
@pytest.mark.parametrize("checked", [True, False], ids=["refused-first", "full-while-writing"])
def test_pack_into_a_full_device(comm, shared_tmp, src, monkeypatch, checked):
    if not checked:  # as if the space had gone between the check and the writes
        monkeypatch.setattr(pack_module, "_check_capacity", lambda out, shards: None)
    big = shared_tmp / "pfs" / "big"
    if comm.Get_rank() == 0:
        big.mkdir(parents=True)
        for i in range(4):
            (big / f"b{i}.bin").write_bytes(bytes([i]) * (600 << 10))
    comm.Barrier()
    with tmpfs(comm, shared_tmp / "small", "1m") as small:
        with pytest.raises(bbio.NoSpaceError) as info:
            bbio.pack(
                comm, big, small / "p", shard_size=700 << 10, config=two_nodes(comm, shared_tmp)
            )
        message = same_everywhere(comm, info.value)
        assert "pack fewer files" in message, message
        assert ("needs about" if checked else "cannot write the shard") in message, message
        assert temp_files(small) == []


@needs_root
def test_packing_again_onto_a_nearly_full_device_replaces_the_shards(comm, shared_tmp):
    """Before, the capacity check counted the old shard as free, but the new one was written
    beside it: the device filled up, and the earlier pack was gone too."""
    src = shared_tmp / "pfs" / "big"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for i in range(5):
            (src / f"f{i}").write_bytes(os.urandom(500_000))
    comm.Barrier()
    config = two_nodes(comm, shared_tmp)
    with tmpfs(comm, shared_tmp / "small", "4m") as small:
        bbio.pack(comm, src, small / "p", config=config)
        if comm.Get_rank() == 0:
            (src / "f0").write_bytes(os.urandom(500_000))
        comm.Barrier()
        again = bbio.pack(comm, src, small / "p", config=config)
        assert (again.samples, again.shards) == (5, 1)
        with h5py.File(small / "p" / pack_module.shard_name(0)) as shard:
            assert bytes(shard["data"][:500_000]) == (src / "f0").read_bytes()
        assert temp_files(small) == []


# ------------------------------------------------------------- 7. {node} and filters


def test_node_where_it_does_not_apply_is_refused(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    calls = [
        (bbio.pack, src, shared_tmp / "pn" / "{node}", "pack: output directory"),
        (bbio.pack, shared_tmp / "{node}", shared_tmp / "pn", "pack: source"),
        (bbio.stage_out, shared_tmp / "bb" / "{node}", shared_tmp / "so" / "{node}", "stage-out"),
        (bbio.stage_in, shared_tmp / "{node}", shared_tmp / "bb" / "{node}", "stage-in: source"),
    ]
    for call, first, second, expected in calls:
        with pytest.raises(bbio.UsageError) as info:
            call(comm, first, second, config=config)
        message = same_everywhere(comm, info.value)
        assert expected in message and "contains {node}" in message, message
    assert not list(shared_tmp.rglob("{node}"))


def test_a_path_that_is_not_one_is_a_usage_error_everywhere(comm, shared_tmp, src):
    """Before, None or a number for a path was a raw TypeError from os.fspath."""
    config = two_nodes(comm, shared_tmp)
    bb = shared_tmp / "bb" / "{node}"
    calls = [
        (bbio.stage_in, None, bb, "stage-in: the source must be a str or a path, not NoneType"),
        (bbio.stage_out, bb, 7, "stage-out: the destination must be a str or a path, not int"),
        (bbio.pack, src, b"out", "pack: the output directory must be a str or a path, not bytes"),
        (bbio.verify, src, None, "verify: the destination must be a str or a path, not NoneType"),
    ]
    for call, first, second, expected in calls:
        with pytest.raises(bbio.UsageError) as info:
            call(comm, first, second, config=config)
        assert expected in same_everywhere(comm, info.value), info.value


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"include": "a.jpg"}, "pack: include must be a list of globs, not the string 'a.jpg'"),
        ({"exclude": "*.tmp"}, "pack: exclude must be a list of globs, not the string '*.tmp'"),
        ({"shard_size": "1G"}, "shard_size must be an integer, not '1G' (str)"),
        ({"shard_size": None}, "shard_size must be an integer, not None (NoneType)"),
        ({"shard_size": 0}, "shard_size must be at least 1, not 0"),
    ],
    ids=["include", "exclude", "size-str", "size-none", "size-0"],
)
def test_pack_arguments_it_cannot_use_are_one_usage_error_that_keeps_the_earlier_pack(
    comm, shared_tmp, src, arguments, expected
):
    """Before, a string filter was matched character by character: it selected nothing and
    replaced the earlier pack by an empty one; a shard size not an int was a raw
    TypeError, and 0 made a shard of every file."""
    config = two_nodes(comm, shared_tmp)
    out = shared_tmp / "packed"
    bbio.pack(comm, src, out, config=config)
    with pytest.raises(bbio.UsageError) as info:
        bbio.pack(comm, src, out, config=config, **arguments)
    assert expected in same_everywhere(comm, info.value), info.value
    assert [shard.samples for shard in pack_module.read_index(out)] == [6]


def test_a_file_as_the_source_says_how_to_stage_it(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    one = src / "d1" / "f1.bin"
    with pytest.raises(bbio.NotDirectoryError) as info:
        bbio.stage_in(comm, one, shared_tmp / "bb" / "{node}" / "one", config=config)
    message = same_everywhere(comm, info.value)
    assert f"pass {src / 'd1'} and --include 'f1.bin'" in message, message
    bbio.stage_in(
        comm, src / "d1", shared_tmp / "bb" / "{node}" / "one", include=["f1.bin"], config=config
    )
    node = comm.Get_rank() * 2 // comm.Get_size()
    copied = shared_tmp / "bb" / str(node) / "one"
    assert files_under(copied) == {"f1.bin": one.read_bytes()}


def test_filters_that_select_nothing_say_so(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    summary = bbio.stage_in(
        comm, src, shared_tmp / "bb" / "{node}" / "f", include=["*.jpg"], config=config
    )
    assert summary.files == 0
    assert "warning: --include/--exclude selected no file of the source" in summary.report()
    everything = bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "g", config=config)
    assert everything.warnings == [] and "warning" not in everything.report()
    packed = bbio.pack(comm, src, shared_tmp / "p", exclude=["*"], config=config)
    assert packed.samples == 0 and "selected no file" in packed.report()


@pytest.mark.parametrize("direction", ["stage-in", "stage-out"])
def test_a_file_that_changed_before_its_copy_is_verified_as_copied(
    comm, shared_tmp, src, monkeypatch, direction
):
    """The walk saw f5 at 6000 bytes; it grew before the copy, which copied it again at its
    new size: --verify compares with that, keeps the copy, and the manifest records it."""
    from bbio.transfer import files

    config = two_nodes(comm, shared_tmp)
    if direction == "stage-in":
        source, dst = src, shared_tmp / "bb" / "{node}" / "grown"
    else:
        bbio.stage_in(comm, src, shared_tmp / "bb" / "{node}" / "results", config=config)
        source, dst = shared_tmp / "bb" / "{node}" / "results", shared_tmp / "out"
    grow_f5_after_the_walk(monkeypatch)
    call = bbio.stage_in if direction == "stage-in" else bbio.stage_out
    summary = call(comm, source, dst, verify=True, config=config)
    assert summary.verified
    copy_root = Path(str(dst).replace("{node}", "1"))
    assert (copy_root / "d1" / "f5.bin").stat().st_size == 6100
    sizes = {e.path: e.size for e in files.read_manifest(copy_root).entries}
    assert sizes["d1/f5.bin"] == 6100


def test_a_damaged_stage_out_copy_is_kept_marked_and_copied_again(comm, shared_tmp, src):
    config = two_nodes(comm, shared_tmp)
    results, out = shared_tmp / "bb" / "{node}" / "results", shared_tmp / "out"
    bbio.stage_in(comm, src, results, config=config)
    bbio.stage_out(comm, results, out, config=config)
    victim = out / "d1" / "f3.bin"
    damage(comm, victim)
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.stage_out(comm, results, out, verify=True, config=config)
    assert "marked (mtime 0 or 4 s)" in same_everywhere(comm, info.value)
    assert victim.stat().st_mtime_ns == 0 and victim.stat().st_size == 4000  # bytes kept
    again = bbio.stage_out(comm, results, out, verify=True, config=config)
    assert again.verified and again.files == 1
    assert victim.read_bytes() == (src / "d1" / "f3.bin").read_bytes()


def test_each_node_records_its_own_copy_when_the_source_changed_between_runs(
    comm, shared_tmp, src, monkeypatch
):
    """Node 0 lost its copy of f5; the source grew after the rerun's walk: node 0 copies
    the new version, node 1 keeps the old one.  Each manifest describes its own file, so
    a later --verify finds nothing wrong."""
    from bbio.transfer import files

    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "mixed"
    bbio.stage_in(comm, src, dst, config=config)
    comm.Barrier()
    if comm.Get_rank() == 0:
        (shared_tmp / "bb" / "0" / "mixed" / "d1" / "f5.bin").unlink()
    grow_f5_after_the_walk(monkeypatch)
    bbio.stage_in(comm, src, dst, verify=True, config=config)
    monkeypatch.undo()
    for node in (0, 1):
        root = shared_tmp / "bb" / str(node) / "mixed"
        entry = files.read_manifest(root).by_path()["d1/f5.bin"]
        assert (entry.size, entry.crc32c) == files.checksum_file(root / "d1" / "f5.bin")
    comm.Barrier()
    assert bbio.stage_in(comm, src, dst, verify=True, config=config).verified


def test_a_rank_that_cannot_allocate_a_replicate_round_fails_every_rank(comm, shared_tmp):
    """Rank 1 may map only a little more memory than it holds: its buffers for a round
    of two 48 MiB reads cannot be allocated.  Every rank raises; none waits in the
    exchange for it."""
    import resource

    src = shared_tmp / "pfs" / "large"
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        for i in range(2):
            (src / f"l{i}.bin").write_bytes(bytes([i]) * (48 << 20))
    comm.Barrier()
    config = two_nodes(comm, shared_tmp, replicate_round_bytes=128 << 20)
    limits = resource.getrlimit(resource.RLIMIT_AS)
    if comm.Get_rank() == 1:
        status = Path("/proc/self/status").read_text()
        mapped_kib = int(
            next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1]
        )
        resource.setrlimit(resource.RLIMIT_AS, ((mapped_kib << 10) + (32 << 20), limits[1]))
    try:
        with pytest.raises(bbio.BBIOError) as info:
            bbio.stage_in(
                comm, src, shared_tmp / "bb" / "{node}" / "l", mode="replicate", config=config
            )
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    message = same_everywhere(comm, info.value)
    assert ": MemoryError: " in message, message
    assert "failed on rank 1 " in message or "node 1: " in message, message  # who failed


# ------------------------------------------------------------ 8. verify of partial copies


def test_verify_reports_a_copy_a_failed_rerun_left_incomplete(comm, shared_tmp, src):
    """A rerun withdraws d1/f5.bin (changed on the source) from each node's manifest, then
    fails copying it on node 1: every entry left still matches, but verify must not pass."""
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "partial"
    bbio.stage_in(comm, src, dst, config=config)
    assert not bbio.verify(comm, src, dst, config=config).problems
    blocker = shared_tmp / "bb" / "1" / "partial" / "d1" / ".f5.bin.bbio-part"
    if comm.Get_rank() == 0:
        with open(src / "d1" / "f5.bin", "ab") as f:
            f.write(b"+" * 100)
        blocker.mkdir()  # node 1 cannot create f5's temporary copy
    comm.Barrier()
    with pytest.raises(bbio.BBIOError, match=r"f5\.bin"):
        bbio.stage_in(comm, src, dst, config=config)
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.verify(comm, src, dst, config=config)
    message = same_everywhere(comm, info.value)
    for node in ("0", "1"):
        manifest = files.manifest_path(shared_tmp / "bb" / node / "partial")
        assert f"{manifest}: the copy is not complete" in message, message
    assert "Rerun the transfer until it succeeds" in message, message
    comm.Barrier()
    if comm.Get_rank() == 0:
        blocker.rmdir()
    comm.Barrier()
    bbio.stage_in(comm, src, dst, config=config)
    assert not bbio.verify(comm, src, dst, config=config).problems
    filtered = shared_tmp / "bb" / "{node}" / "filtered"
    bbio.stage_in(comm, src, filtered, exclude=["d1/*"], config=config)
    assert not bbio.verify(comm, src, filtered, config=config).problems  # finished, filtered


def test_verify_tells_a_file_without_a_crc_from_a_damaged_one(comm, shared_tmp, src, monkeypatch):
    """A first run killed before its manifest; the rerun finds the copies up to date, but
    d1/f5.bin grows before the rerun reads its CRC32C: the manifest records none for it.
    Verify says so (not a CRC mismatch against 00000000) and names a damaged file apart."""
    config = two_nodes(comm, shared_tmp)
    dst = shared_tmp / "bb" / "{node}" / "nocrc"
    bbio.stage_in(comm, src, dst, config=config)
    comm.Barrier()
    if comm.Get_rank() == 0:
        for node in ("0", "1"):
            files.manifest_path(shared_tmp / "bb" / node / "nocrc").unlink()
    comm.Barrier()
    grow_f5_after_the_walk(monkeypatch)
    bbio.stage_in(comm, src, dst, config=config)
    monkeypatch.undo()
    for node in ("0", "1"):
        entry = files.read_manifest(shared_tmp / "bb" / node / "nocrc").by_path()["d1/f5.bin"]
        assert entry.crc32c is None
    damage(comm, shared_tmp / "bb" / "0" / "nocrc" / "d0" / "f4.bin")
    with pytest.raises(bbio.IntegrityError) as info:
        bbio.verify(comm, src, dst, config=config)
    message = same_everywhere(comm, info.value)
    assert message.startswith("3 problem(s): "), message
    for node in ("0", "1"):
        copy = shared_tmp / "bb" / node / "nocrc" / "d1" / "f5.bin"
        assert f"destination {copy}: no CRC32C recorded" in message, message
    assert "00000000" not in message and "source " not in message, message
    damaged = shared_tmp / "bb" / "0" / "nocrc" / "d0" / "f4.bin"
    assert f"destination {damaged}: 5000 bytes, CRC32C" in message, message
    assert "Rerun the transfer until it succeeds" in message, message
    assert "delete the differing destination copies" in message, message


@pytest.mark.timeout(120)
def test_a_changing_files_copy_that_cannot_be_removed_is_one_error_everywhere(
    comm, shared_tmp, monkeypatch
):
    """After the last attempt, the copies of files that kept changing are removed.  Before,
    a rank that could not remove one raised alone, and with --skip-unreadable the others
    went on into the next collective: a hang."""
    from bbio.stage import run

    monkeypatch.setattr(run, "RETRY_BACKOFF_SECONDS", 0.01)
    src, config = shared_tmp / "pfs" / "hot", two_nodes(comm, shared_tmp)
    if comm.Get_rank() == comm.Get_size() // 2:  # node 1's leader
        unlink = os.unlink

        def refusing(path, *args, **kwargs):
            if os.fspath(path).endswith(".hot.log.bbio-part"):
                raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))
            return unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", refusing)
    stop, writer = threading.Event(), None
    if comm.Get_rank() == 0:
        src.mkdir(parents=True)
        (src / "calm.bin").write_bytes(b"calm")
        (src / "hot.log").write_bytes(b"start")
        writer = threading.Thread(target=_keep_changing, args=(src / "hot.log", stop, None))
        writer.start()
    comm.Barrier()
    try:
        with pytest.raises(bbio.PermissionDeniedError) as info:
            bbio.stage_in(
                comm, src, shared_tmp / "bb" / "{node}" / "hot", skip_unreadable=True, config=config
            )
    finally:
        stop.set()
        if writer:
            writer.join()
    message = same_everywhere(comm, info.value)
    assert "node 1: cannot remove the temporary copy of a file that kept changing" in message
    assert ".hot.log.bbio-part" in message, message
