"""The native core against its plain-Python references and the crc32c package."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
import time

import crc32c as crc32c_package
import numpy as np
import pytest

from bbio import _native
from bbio.errors import BBIOError, NoSpaceError, NotFoundError, UsageError
from tests import native_reference as ref

SMALL_BUFFER = 4 * 4096  # four pipeline slots of one page each
SIZES = [0, 1, 4095, 4096, 4097, 3 * SMALL_BUFFER + 5, (9 << 20) + 3]


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def write_file(path, data: bytes):
    path.write_bytes(data)
    return path


def test_native_extension_is_loaded():
    assert _native.available(), _native.LOAD_ERROR


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 255, 767, 768, 769, 4095, 4097, 3 * 8192 + 17])
@pytest.mark.parametrize("impl", ["auto", "hw", "sw"])
def test_crc32c_matches_reference_and_package(size, impl):
    data = random_bytes(size, seed=size)
    expected = ref.crc32c(data)
    assert _native.crc32c(data, impl=impl) == expected
    assert crc32c_package.crc32c(data) == expected


def test_crc32c_known_check_value():
    assert _native.crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("impl", ["hw", "sw"])
def test_crc32c_large_buffer_matches_package(impl):
    data = np.random.default_rng(5).integers(0, 256, (3 << 20) + 11, dtype=np.uint8)
    assert _native.crc32c(data, impl=impl) == crc32c_package.crc32c(data.tobytes())


@pytest.mark.parametrize("offset", range(9))
def test_crc32c_unaligned_start(offset):
    data = random_bytes(100_000 + offset, seed=3)[offset:]
    assert _native.crc32c(memoryview(data), impl="hw") == crc32c_package.crc32c(data)


def test_crc32c_continues_across_pieces():
    data = random_bytes(50_000, seed=9)
    crc = 0
    for start in range(0, len(data), 4097):
        crc = _native.crc32c(data[start : start + 4097], crc)
    assert crc == crc32c_package.crc32c(data)


def test_crc32c_rejects_non_contiguous_buffer():
    with pytest.raises(UsageError):
        _native.crc32c(np.arange(100, dtype=np.uint8)[::2])
    with pytest.raises(UsageError):
        _native.crc32c(b"x", impl="fast")


def test_hw_detection_matches_cpu_flags():
    with open("/proc/cpuinfo") as f:
        has_sse42 = " sse4_2" in f.read()
    assert _native.hw_crc32c() == has_sse42


def _copy_both(tmp_path, data, src_offset=0, dst_offset=0, length=-1, **kwargs):
    src = write_file(tmp_path / "src", data)
    results = []
    for name, copier in (("native", "native"), ("reference", "reference")):
        dst = tmp_path / f"dst-{name}"
        dst.write_bytes(b"\xaa" * 10)
        sfd, dfd = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
        try:
            if copier == "native":
                r = _native.copy_range(sfd, dfd, src_offset, dst_offset, length, **kwargs)
                results.append((r.nbytes, r.crc32c, dst.read_bytes()))
            else:
                n, crc = ref.copy_range(sfd, dfd, src_offset, dst_offset, length)
                results.append((n, crc, dst.read_bytes()))
        finally:
            os.close(sfd)
            os.close(dfd)
    return results


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("use_cfr", [True, False])
def test_copy_range_whole_file_matches_reference(tmp_path, size, use_cfr):
    data = random_bytes(size, seed=size)
    native, reference = _copy_both(
        tmp_path, data, buffer_size=SMALL_BUFFER, use_copy_file_range=use_cfr
    )
    assert native == reference
    assert native[0] == size
    assert native[1] == crc32c_package.crc32c(data)


@pytest.mark.parametrize("checksum", [True, False])
def test_copy_range_with_offsets_and_length(tmp_path, checksum):
    data = random_bytes(100_000, seed=1)
    native, reference = _copy_both(
        tmp_path,
        data,
        src_offset=777,
        dst_offset=4,
        length=50_001,
        checksum=checksum,
        buffer_size=SMALL_BUFFER,
    )
    assert native[0] == reference[0] == 50_001
    assert native[2] == reference[2]
    if checksum:
        assert native[1] == reference[1]
    else:
        assert native[1] is None


@pytest.mark.parametrize("size", [4097, (9 << 20) + 3])
def test_copy_range_short_read_at_end_of_file(tmp_path, size):
    data = random_bytes(size, seed=2)
    native, reference = _copy_both(
        tmp_path, data, src_offset=size - 100, length=4096, buffer_size=SMALL_BUFFER
    )
    assert native == reference
    assert native[0] == 100


def test_copy_range_from_beyond_end_copies_nothing(tmp_path):
    native, reference = _copy_both(tmp_path, b"abc", src_offset=10, length=5)
    assert native == reference
    assert native[0] == 0


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("size", [0, 1, 4097, 200_003, 7_000_000, (9 << 20) + 3])
def test_copy_file_direct_and_buffered(tmp_path, size, checksum):
    """Without a checksum the kernel copies (copy_file_range): under O_DIRECT it took the
    aligned part and then refused the file's unaligned tail (EINVAL), failing the copy."""
    data = random_bytes(size, seed=4)
    src = write_file(tmp_path / "src", data)
    for direct in (False, True):
        dst = tmp_path / f"dst-{direct}"
        result = _native.copy_file(src, dst, direct=direct, checksum=checksum)
        assert result.nbytes == size
        assert result.crc32c == (crc32c_package.crc32c(data) if checksum else None)
        assert dst.read_bytes() == data


@pytest.mark.parametrize("direct_side", ["source", "destination"])
def test_a_copy_split_between_threads_at_unaligned_offsets_under_o_direct(tmp_path, direct_side):
    """Both halves of a split copy meet O_DIRECT's EINVAL at an unaligned offset; the
    first thread to turn O_DIRECT off retried, the other then found it off and failed."""
    data = random_bytes((9 << 20) + 3, seed=5)
    src = write_file(tmp_path / "src", data)
    dst = tmp_path / "dst"
    src_offset, dst_offset = (5, 0) if direct_side == "source" else (0, 3)
    for _ in range(8):
        if direct_side == "source":
            sfd = _native.open_direct(src, os.O_RDONLY) or os.open(src, os.O_RDONLY)
            dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            sfd = os.open(src, os.O_RDONLY)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            dfd = _native.open_direct(dst, flags, 0o600) or os.open(dst, flags, 0o600)
        try:
            result = _native.copy_range(
                sfd, dfd, src_offset, dst_offset, -1, checksum=True, src_path=src, dst_path=dst
            )
        finally:
            os.close(sfd)
            os.close(dfd)
        assert result.crc32c == crc32c_package.crc32c(data[src_offset:])
        assert dst.read_bytes()[dst_offset:] == data[src_offset:]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a one-CPU copy never splits")
def test_sequential_copy_writes_in_file_order(tmp_path):
    # Linux's pwrite on an O_APPEND descriptor appends wherever the offset points,
    # so the destination holds the bytes in the order they were written: a copy
    # split between two threads would interleave its halves.
    data = random_bytes((9 << 20) + 3, seed=5)
    src = write_file(tmp_path / "src", data)
    dst = tmp_path / "dst"
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        # a small buffer: many writes per half, so two threads would interleave
        result = _native.copy_range(
            src_fd, dst_fd, checksum=True, buffer_size=8192, sequential=True
        )
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert result.nbytes == len(data)
    assert result.crc32c == crc32c_package.crc32c(data)
    assert dst.read_bytes() == data


def test_copy_file_calls_on_open_once_before_any_byte_is_copied(tmp_path):
    data = random_bytes((9 << 20) + 3, seed=6)
    src = write_file(tmp_path / "src", data)
    dst = tmp_path / "dst"
    dst.write_bytes(data[:4096])  # an older copy: truncated when opened
    seen: list[bytes] = []
    result = _native.copy_file(src, dst, on_open=lambda: seen.append(dst.read_bytes()))
    assert len(seen) == 1 and seen[0].strip(b"\0") == b""  # empty, or reserved as zeros
    assert result.nbytes == len(data) and dst.read_bytes() == data


def test_copy_whole_copies_between_descriptors_it_leaves_open(tmp_path):
    data = random_bytes((9 << 20) + 3, seed=7)
    src = write_file(tmp_path / "src", data)
    dst = tmp_path / "dst"
    seen: list[bytes] = []
    src_fd = os.open(src, os.O_RDONLY)
    dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        result = _native.copy_whole(
            src_fd, dst_fd, dst_path=dst, on_open=lambda: seen.append(dst.read_bytes())
        )
        os.fsync(dst_fd)  # still open: the caller flushes it on the descriptor that wrote it
    finally:
        os.close(src_fd)
        os.close(dst_fd)
    assert len(seen) == 1 and seen[0].strip(b"\0") == b""  # empty, or reserved as zeros
    assert result.nbytes == len(data) and result.crc32c == crc32c_package.crc32c(data)
    assert dst.read_bytes() == data
    src_fd, read_only = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDONLY)
    try:
        with pytest.raises(BBIOError) as info:
            _native.copy_whole(src_fd, read_only, src_path=src, dst_path=dst)
    finally:
        os.close(src_fd)
        os.close(read_only)
    assert str(dst) in str(info.value)


def test_copy_file_missing_source_names_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(NotFoundError) as info:
        _native.copy_file(missing, tmp_path / "dst")
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(missing)
    assert str(missing) in str(info.value)


def test_preallocate_reserves_blocks_and_skips_small_files(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert not _native.preallocate(fd, 1 << 20)  # below PREALLOCATE_MIN_BYTES
        assert os.fstat(fd).st_size == 0
        assert _native.preallocate(fd, 3 << 20, at_least=0)
        st = os.fstat(fd)
        assert st.st_size == 3 << 20 and st.st_blocks * 512 >= 3 << 20
        assert os.pread(fd, 4096, 1 << 20) == bytes(4096)
    finally:
        os.close(fd)


def test_preallocate_keeping_the_size_reserves_blocks_a_truncate_frees(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 100)
        assert _native.preallocate(fd, 3 << 20, at_least=0, keep_size=True)
        st = os.fstat(fd)
        assert st.st_size == 100 and st.st_blocks * 512 >= 3 << 20
        os.ftruncate(fd, 100)
        assert os.fstat(fd).st_blocks * 512 < 1 << 20
    finally:
        os.close(fd)


def test_copy_range_full_device_names_destination(tmp_path):
    src = write_file(tmp_path / "src", random_bytes(100_000))
    sfd = os.open(src, os.O_RDONLY)
    dfd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(NoSpaceError) as info:
            _native.copy_range(sfd, dfd, src_path=src, dst_path="/dev/full")
    finally:
        os.close(sfd)
        os.close(dfd)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == "/dev/full"
    assert isinstance(info.value, OSError)


@pytest.mark.skipif(os.geteuid() != 0, reason="a loop-mounted file system needs root")
def test_a_full_device_is_blamed_on_the_destination_when_the_source_is_o_direct(tmp_path):
    """On the kernel's copy path the side to blame was found by reading one byte of the
    source, which O_DIRECT refuses: a full destination was reported as the source."""
    image, mount = tmp_path / "ext4.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    if made.returncode != 0 or subprocess.run(["mount", "-o", "loop", image, mount]).returncode:
        pytest.skip("no loop-mounted ext4 here")
    try:
        src = write_file(mount / "src", random_bytes(9 << 20, seed=6))
        with pytest.raises(NoSpaceError) as info:
            _native.copy_file(src, mount / "dst", checksum=False, direct=True)
        assert info.value.filename == str(mount / "dst")
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_copy_range_bad_descriptor_names_source(tmp_path):
    dfd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(BBIOError) as info:
            _native.copy_range(9999, dfd, src_path="the-source", checksum=True)
    finally:
        os.close(dfd)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == "the-source"


@pytest.mark.parametrize("size", [0, 1, (256 << 10) - 1, (256 << 10) + 1, (3 << 20) + 7])
def test_pwrite_crc_writes_at_offset_and_checksums(tmp_path, size):
    data = random_bytes(size, seed=size)
    path = write_file(tmp_path / "f", b"x" * 10)
    fd = os.open(path, os.O_WRONLY)
    try:
        crc = _native.pwrite_crc(fd, np.frombuffer(data, np.uint8), 5, path)
    finally:
        os.close(fd)
    assert crc == crc32c_package.crc32c(data)
    expected = b"xxxxx" + data if size >= 5 else b"xxxxx" + data + b"x" * (5 - size)
    assert path.read_bytes() == expected


def test_pwrite_crc_failure_names_the_path():
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(NoSpaceError) as info:
            _native.pwrite_crc(fd, b"data", 0, "/dev/full")
    finally:
        os.close(fd)
    assert info.value.filename == "/dev/full"


def _batch_case(tmp_path):
    data_a = random_bytes(10_000, seed=1)
    data_b = random_bytes(5_000, seed=2)
    fa = os.open(write_file(tmp_path / "a", data_a), os.O_RDONLY)
    fb = os.open(write_file(tmp_path / "b", data_b), os.O_RDONLY)
    fds = [fa, fb, fa, fb, fa, fb]
    offsets = [0, 10, 9_000, 4_900, 5, 6_000]
    lengths = [1, 4097, 4095, 200, 0, 10]  # request 3 is short (100 bytes), 5 is past EOF
    return fds, offsets, lengths


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_pread_batch_matches_reference(tmp_path, threads):
    fds, offsets, lengths = _batch_case(tmp_path)
    out_offsets = list(np.cumsum([0, *lengths[:-1]]))
    native_out = bytearray(sum(lengths))
    ref_out = bytearray(sum(lengths))
    results = _native.pread_batch(fds, offsets, lengths, native_out, threads=threads)
    expected = ref.pread_batch(fds, offsets, lengths, ref_out, out_offsets)
    assert list(results) == expected == [1, 4097, 1000, 100, 0, 0]
    assert native_out == ref_out
    for fd in set(fds):
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 3])
def test_pread_batch_aligned_requests_through_o_direct(tmp_path, threads):
    fds, offsets, lengths = _batch_case(tmp_path)
    direct = {}
    for fd, name in zip(fds[:2], "ab", strict=True):
        opened = _native.open_direct(tmp_path / name, os.O_RDONLY)
        direct[fd] = os.open(tmp_path / name, os.O_RDONLY) if opened is None else opened
    aligned = [True, False, True, True, True, True]
    mixed = [direct[fd] if flag else fd for fd, flag in zip(fds, aligned, strict=True)]
    got = bytearray(sum(lengths))
    expected = bytearray(sum(lengths))
    out_offsets = list(np.cumsum([0, *lengths[:-1]]))
    results = _native.pread_batch(mixed, offsets, lengths, got, threads=threads, aligned=aligned)
    assert list(results) == ref.pread_batch(fds, offsets, lengths, expected, out_offsets)
    assert got == expected
    for fd in {*fds, *direct.values()}:
        os.close(fd)


def test_pread_batch_many_requests_scattered_output(tmp_path):
    data = random_bytes(1 << 20, seed=8)
    fd = os.open(write_file(tmp_path / "big", data), os.O_RDONLY)
    rng = np.random.default_rng(0)
    n = 2000
    offsets = rng.integers(0, len(data) - 4096, n)
    lengths = rng.integers(0, 4096, n)
    out_offsets = np.arange(n) * 4096
    out = np.zeros(n * 4096, dtype=np.uint8)
    results = _native.pread_batch([fd] * n, offsets, lengths, out, out_offsets, threads=8)
    os.close(fd)
    assert (results == lengths).all()
    for i in range(0, n, 97):
        got = out[out_offsets[i] : out_offsets[i] + lengths[i]].tobytes()
        assert got == data[offsets[i] : offsets[i] + lengths[i]]


def test_pread_batch_reports_each_failure(tmp_path):
    fd = os.open(write_file(tmp_path / "a", b"x" * 100), os.O_RDONLY)
    out = bytearray(30)
    results = _native.pread_batch([fd, 9999, fd], [0, 0, 50], [10, 10, 10], out, check=False)
    assert list(results) == [10, -errno.EBADF, 10]
    with pytest.raises(BBIOError) as info:
        _native.pread_batch(
            [fd, 9999], [0, 0], [10, 10], out, paths=["a-file", "b-file"], check=True
        )
    os.close(fd)
    assert info.value.errno == errno.EBADF
    assert info.value.filename == "b-file"
    assert "1 of 2 requests failed" in str(info.value)


def test_pread_batch_rejects_requests_outside_buffer(tmp_path):
    fd = os.open(write_file(tmp_path / "a", b"x" * 100), os.O_RDONLY)
    try:
        with pytest.raises(UsageError):
            _native.pread_batch([fd], [0], [20], bytearray(10))
        with pytest.raises(UsageError):
            _native.pread_batch([fd], [-1], [5], bytearray(10))
        with pytest.raises(UsageError):
            _native.pread_batch([fd], [0], [5], b"read-only!")
    finally:
        os.close(fd)


def test_pread_batch_empty():
    results = _native.pread_batch([], [], [], bytearray(0))
    assert results.size == 0


def test_native_calls_release_the_gil():
    data = np.random.default_rng(0).integers(0, 256, 512 << 20, dtype=np.uint8)
    ticks = []
    running = threading.Event()

    def count():
        running.set()
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    done = threading.Event()
    thread = threading.Thread(target=count)
    thread.start()
    running.wait()
    start = time.perf_counter()
    for _ in range(4):
        _native.crc32c(data, impl="sw")
    end = time.perf_counter()
    done.set()
    thread.join()
    during = [t for t in ticks if start < t < end]
    # With the GIL held for the whole call, the counter thread could not run.
    assert len(during) > 100, f"only {len(during)} ticks in {end - start:.2f} s"


@pytest.mark.parametrize(("len_a", "len_b"), [(0, 0), (1, 0), (0, 1), (1000, 777), (5, 1 << 20)])
def test_crc32c_combine(len_a, len_b):
    a, b = random_bytes(len_a, seed=1), random_bytes(len_b, seed=2)
    combined = _native.crc32c_combine(_native.crc32c(a), _native.crc32c(b), len(b))
    assert combined == crc32c_package.crc32c(a + b)


def _reflect(value: int) -> int:
    return int(f"{value:032b}"[::-1], 2)


def _shifted_by_zero_bytes(crc: int, length: int) -> int:
    """The CRC32C ``crc`` after ``length`` zero bytes, from polynomial arithmetic over
    GF(2): times x^(8 * length) modulo the Castagnoli polynomial (CRCs are reflected)."""
    poly = 0x11EDC6F41

    def times_mod(a: int, b: int) -> int:
        product = 0
        while b:
            if b & 1:
                product ^= a
            b >>= 1
            a <<= 1
            if a >> 32:
                a ^= poly
        return product

    result, power, exponent = _reflect(crc), 2, 8 * length  # power: x
    while exponent:
        if exponent & 1:
            result = times_mod(result, power)
        power = times_mod(power, power)
        exponent >>= 1
    return _reflect(result)


@pytest.mark.parametrize("length", [1000, 1 << 33, (1 << 62) + 12345, (1 << 63) - 1])
def test_crc32c_combine_matches_polynomial_arithmetic(length):
    """Lengths no test can checksum, against an independent computation (checked on a
    length that can be checksummed too)."""
    a, b = 0x12345678, 0x9ABCDEF0
    expected = _shifted_by_zero_bytes(a, length) ^ b
    assert _native.crc32c_combine(a, b, length) == expected
    data = random_bytes(1000, seed=3)
    assert _shifted_by_zero_bytes(_native.crc32c(data), 1000) == crc32c_package.crc32c(
        data + bytes(1000), 0
    ) ^ crc32c_package.crc32c(bytes(1000), 0)


def test_large_copy_on_one_cpu_and_on_two_match(tmp_path):
    data = random_bytes((9 << 20) + 4097, seed=6)
    src = write_file(tmp_path / "src", data)
    allowed = os.sched_getaffinity(0)
    results = []
    for cpus in ({min(allowed)}, allowed):
        os.sched_setaffinity(0, cpus)
        try:
            results.append(_native.copy_file(src, tmp_path / f"dst{len(cpus)}"))
        finally:
            os.sched_setaffinity(0, allowed)
        assert (tmp_path / f"dst{len(cpus)}").read_bytes() == data
    assert results[0] == results[1]
    assert results[0].crc32c == crc32c_package.crc32c(data)


def test_large_copy_asked_beyond_end_of_file_stops_at_the_end(tmp_path):
    data = random_bytes(9 << 20, seed=7)
    native, reference = _copy_both(tmp_path, data, length=20 << 20)
    assert native == reference
    assert native[0] == len(data)


def test_copy_files_matches_reference_reports_errors_and_seals(tmp_path):
    sizes = [0, 1, 4095, 4097, (9 << 20) + 3]
    sources, destinations, datas = [], [], []
    for i, size in enumerate(sizes):
        datas.append(random_bytes(size, seed=i))
        sources.append(write_file(tmp_path / f"src{i}", datas[-1]))
        destinations.append(tmp_path / f"dst{i}")
    sources.append(tmp_path / "missing")
    destinations.append(tmp_path / "dst-missing")
    sources.append(sources[0])
    destinations.append(tmp_path / "no-such-dir" / "dst")
    modes = [0o640] * len(sources)
    mtimes = [1_500_000_000_000_000_007 + i for i in range(len(sources))]
    results = _native.copy_files(sources, destinations, threads=3, modes=modes, mtimes_ns=mtimes)
    for i, data in enumerate(datas):
        assert results[i].error is None
        assert destinations[i].read_bytes() == data
        assert results[i].nbytes == results[i].size_after == len(data)
        assert results[i].crc32c == ref.crc32c(data)
        st = destinations[i].stat()
        assert (st.st_mode & 0o777, st.st_mtime_ns) == (0o640, mtimes[i])
    missing, unwritable = results[-2], results[-1]
    assert missing.error is None and missing.source_not_regular  # gone: looked at again
    assert not destinations[-2].exists()
    assert isinstance(unwritable.error, NotFoundError)
    assert unwritable.error.filename == str(destinations[-1])


def test_batched_calls_from_many_threads_share_the_worker_pool(tmp_path):
    data = random_bytes(1 << 20, seed=11)
    fd = os.open(write_file(tmp_path / "f", data), os.O_RDONLY)
    errors = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(100):
            n = int(rng.integers(1, 40))
            offsets = rng.integers(0, len(data) - 1000, n)
            out = np.zeros(n * 1000, dtype=np.uint8)
            _native.pread_batch([fd] * n, offsets, [1000] * n, out, threads=int(rng.integers(1, 9)))
            for i in range(n):
                if out[i * 1000 : (i + 1) * 1000].tobytes() != data[offsets[i] : offsets[i] + 1000]:
                    errors.append((seed, i))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    os.close(fd)
    assert not any(t.is_alive() for t in threads), "a batched call hung"
    assert errors == []


def test_a_forked_child_gets_its_own_worker_pool(tmp_path):
    """After batched reads on worker threads, a fork (a DataLoader worker) has none of
    those threads: its batched reads must start its own, not wait for the parent's."""
    data = random_bytes(1 << 16, seed=3)
    fd = os.open(write_file(tmp_path / "a", data), os.O_RDONLY)
    try:
        offsets = list(range(0, 1 << 16, 4096))
        _native.pread_batch([fd] * 16, offsets, [4096] * 16, bytearray(1 << 16), threads=4)
        child = os.fork()
        if child == 0:  # the child: exit 0 only if its read finished and is right
            out = bytearray(1 << 16)
            _native.pread_batch([fd] * 16, offsets, [4096] * 16, out, threads=4)
            os._exit(0 if bytes(out) == data else 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(child, 9)
            os.waitpid(child, 0)
            pytest.fail("the forked child's batched read hung")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        os.close(fd)


def test_pread_batch_refuses_an_output_offset_that_would_wrap(tmp_path):
    fd = os.open(write_file(tmp_path / "a", b"x" * 100), os.O_RDONLY)
    try:
        for aligned in (None, [True]):
            with pytest.raises(UsageError, match="fit in the 16-byte output buffer"):
                _native.pread_batch([fd], [0], [1], bytearray(16), [2**63 - 1], aligned=aligned)
        assert _native.pread_batch([fd], [0], [0], bytearray(16), aligned=[True]).tolist() == [0]
    finally:
        os.close(fd)


def test_an_aligned_read_near_the_largest_offset_answers_as_an_unaligned_one(tmp_path):
    """Rounding such a request out to whole pages overflowed a signed 64-bit offset."""
    fd = os.open(write_file(tmp_path / "a", b"x" * 100), os.O_RDONLY)
    try:
        for offset, length in ((2**63 - 100, 50), (2**63 - 4096, 4095), (2**63 - 10, 20)):
            results = [
                _native.pread_batch(
                    [fd], [offset], [length], bytearray(length), aligned=[aligned], check=False
                ).tolist()
                for aligned in (False, True)
            ]
            assert results[0] == results[1], (offset, length, results)
    finally:
        os.close(fd)


def test_copy_files_checks_its_sealing_and_path_arguments(tmp_path):
    sources = [write_file(tmp_path / f"s{i}", b"data") for i in range(3)]
    destinations = [tmp_path / f"d{i}" for i in range(3)]
    with pytest.raises(UsageError, match="one entry per file"):
        _native.copy_files(sources, destinations, modes=[0o640], mtimes_ns=[0])
    with pytest.raises(UsageError, match="both modes and mtimes_ns"):
        _native.copy_files(sources, destinations, modes=[0o640] * 3)
    with pytest.raises(UsageError, match="NUL byte"):
        _native.copy_files(sources[:1], [tmp_path / "nul\0suffix"])
    assert not (tmp_path / "nul").exists()
    before_1970 = -1_500_000_001  # seconds -2, nanoseconds 499999999
    results = _native.copy_files(
        sources, destinations, modes=[0o600] * 3, mtimes_ns=[before_1970] * 3
    )
    assert [r.error for r in results] == [None] * 3
    assert [d.stat().st_mtime_ns for d in destinations] == [before_1970] * 3


def test_copy_errors_name_the_side_that_failed(tmp_path):
    """A source that cannot be read is named as the source, on the kernel's copy path
    (no checksum) too."""
    unreadable = "/proc/self/mem"  # a regular file whose first byte cannot be read (EIO)
    for checksum in (False, True):
        results = _native.copy_files([unreadable], [tmp_path / "d"], checksum=checksum)
        assert results[0].error.filename == unreadable, results[0].error


def test_copy_file_onto_its_own_source_is_refused(tmp_path):
    source = write_file(tmp_path / "f", b"precious" * 100)
    os.link(source, tmp_path / "hard")
    for target in (source, tmp_path / "hard"):
        with pytest.raises(UsageError, match="itself"):
            _native.copy_file(source, target)
    assert source.read_bytes() == b"precious" * 100


_COUNT_QUIET_THREADS = """
import os, signal, sys
from bbio import _native


def blocking_job_signals():
    count = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
        wanted = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
        count += all(mask & (1 << (s - 1)) for s in wanted)
    return count


before = blocking_job_signals()
fd = os.open(sys.argv[1], os.O_RDONLY)
_native.pread_batch([fd] * 16, [0] * 16, [4096] * 16, bytearray(1 << 16), threads=4)
print(before, blocking_job_signals())
"""


def test_the_worker_threads_take_no_signal(tmp_path):
    """A job's signals (Slurm's SIGUSR1 or SIGTERM before its time limit) go to the
    interpreter's threads: the native workers' file calls are never interrupted.  In a
    new process, whose first batched call makes the pool's 3 helper threads."""
    data = write_file(tmp_path / "a", b"x" * (1 << 16))
    result = subprocess.run(
        [sys.executable, "-c", _COUNT_QUIET_THREADS, str(data)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert after == before + 3


def test_copy_files_neither_follows_nor_blocks_on_a_source_that_is_no_longer_a_file(tmp_path):
    """A walk found regular files; since then one became a symlink (to a file outside
    the tree), one a FIFO with no writer, one a directory: none is copied, none blocks."""
    secret = write_file(tmp_path / "outside", b"not yours")
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    kept = write_file(tmp_path / "file", b"data")
    sources = [tmp_path / name for name in ("link", "fifo", "dir", "file")]
    destinations = [tmp_path / f"copy-{s.name}" for s in sources]
    results = _native.copy_files(sources, destinations, threads=4)
    assert [r.source_not_regular for r in results] == [True, True, True, False]
    assert all(r.error is None for r in results)
    assert [d.exists() for d in destinations] == [False, False, False, True]
    assert destinations[-1].read_bytes() == kept.read_bytes()


def test_open_source_and_copy_piece_treat_a_changed_source_as_changed(tmp_path):
    from bbio.transfer.files import copy_piece, open_source

    (tmp_path / "link").symlink_to(write_file(tmp_path / "target", b"x" * 100))
    os.mkfifo(tmp_path / "fifo")
    for name in ("link", "fifo", "missing"):
        assert open_source(tmp_path / name) is None
        temp = write_file(tmp_path / f"temp-{name}", b"")
        piece = copy_piece(tmp_path / name, temp, 0, 100, 100, 0)
        assert (piece.nbytes, piece.changed) == (0, True)
        assert temp.read_bytes() == b""
    fd = open_source(tmp_path / "target")
    assert fd is not None
    os.close(fd)


# Linux before 5.5 (fs/direct-io.c): an O_DIRECT read at an offset or into a buffer off a
# 512-byte boundary is EINVAL, checked before the end of the file.  Preloaded into a child.
PRE_5_5_DIRECT_IO = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>
ssize_t pread64(int fd, void *buf, size_t n, off_t off)
{
    static ssize_t (*real)(int, void *, size_t, off_t);
    if (!real)
        real = (ssize_t (*)(int, void *, size_t, off_t))dlsym(RTLD_NEXT, "pread64");
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0 && (fl & O_DIRECT) && (((uintptr_t)buf | (uintptr_t)off) & 511)) {
        errno = EINVAL;
        return -1;
    }
    return real(fd, buf, n, off);
}
ssize_t pread(int fd, void *buf, size_t n, off_t off) __attribute__((alias("pread64")));
"""

READ_TO_THE_END = """
import fcntl, os, sys
from bbio import _native
fd = _native.open_direct(sys.argv[1], os.O_RDONLY)
if fd is None:
    print("no O_DIRECT here")
    raise SystemExit(0)
out = _native.aligned_buffer(8192)
got = _native.pread_batch([fd], [4096], [8192], out, aligned=[True], threads=1)
data = open(sys.argv[1], "rb").read()
direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
print([int(n) for n in got], bytes(out[:5904]) == data[4096:], direct)
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_an_aligned_read_to_the_end_of_a_file_keeps_o_direct_on_older_kernels(tmp_path):
    """A read of whole pages past the end of a file came back short, and the read of the
    rest began off a page boundary: kernels before 5.5 refuse that (EINVAL), and the
    descriptor, which datasets keep open, lost O_DIRECT for good."""
    shim = tmp_path / "pre55.so"
    (tmp_path / "pre55.c").write_text(PRE_5_5_DIRECT_IO)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "pre55.c"), "-ldl"], check=True
    )
    data = write_file(tmp_path / "ends-mid-page.bin", random_bytes(10_000, seed=3))
    env = {**os.environ, "LD_PRELOAD": str(shim)}
    child = subprocess.run(
        [sys.executable, "-c", READ_TO_THE_END, str(data)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    if child.stdout.strip() == "no O_DIRECT here":
        pytest.skip(f"{tmp_path}'s file system takes no O_DIRECT")
    assert child.stdout.split() == ["[5904]", "True", "True"], child.stdout + child.stderr


# A signal that interrupts a call on a FUSE or NFS file system: the first open() of a path
# naming "interrupted", and the first fsync(), fail with EINTR.  Preloaded into a child.
INTERRUPTED_ONCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/types.h>
static int opens_interrupted, fsyncs_interrupted;
int open(const char *path, int flags, ...)
{
    static int (*real)(const char *, int, ...);
    if (!real)
        real = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open");
    va_list ap;
    va_start(ap, flags);
    mode_t mode = (mode_t)va_arg(ap, int);
    va_end(ap);
    if (strstr(path, "interrupted") && opens_interrupted < 2) {
        opens_interrupted++;
        errno = EINTR;
        return -1;
    }
    return real(path, flags, mode);
}
int open64(const char *path, int flags, ...) __attribute__((alias("open")));
int fsync(int fd)
{
    static int (*real)(int);
    if (!real)
        real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    if (!fsyncs_interrupted) {
        fsyncs_interrupted = 1;
        errno = EINTR;
        return -1;
    }
    return real(fd);
}
"""

COPY_SEALED = """
import os, sys
from bbio import _native
src, dst = sys.argv[1], sys.argv[2]
(done,) = _native.copy_files([src], [dst], threads=1, modes=[0o640], mtimes_ns=[10**18])
print("error" if done.error else "copied", open(dst, "rb").read() == open(src, "rb").read())
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_copy_interrupted_by_a_signal_in_open_or_fsync_is_retried(tmp_path):
    """The thread that calls in from Python copies too, and receives the job's signals:
    on a FUSE or NFS file system an open() or fsync() it interrupts fails with EINTR,
    which failed the file's copy."""
    shim = tmp_path / "interrupted.so"
    (tmp_path / "interrupted.c").write_text(INTERRUPTED_ONCE)
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "interrupted.c"), "-ldl"],
        check=True,
    )
    src = write_file(tmp_path / "interrupted-source.bin", random_bytes(70_000, seed=4))
    child = subprocess.run(
        [sys.executable, "-c", COPY_SEALED, str(src), str(tmp_path / "interrupted-copy.bin")],
        env={**os.environ, "LD_PRELOAD": str(shim)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == ["copied", "True"], child.stdout + child.stderr
