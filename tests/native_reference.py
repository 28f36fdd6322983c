"""Plain-Python references of the native functions, to check the C results byte for byte."""

from __future__ import annotations

import errno
import os

CRC32C_POLY = 0x82F63B78


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes, value: int = 0) -> int:
    """Bytewise CRC32C (Castagnoli), continuing from ``value``."""
    crc = value ^ 0xFFFFFFFF
    for byte in bytes(data):
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def copy_range(
    src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, length: int
) -> tuple[int, int]:
    """Copy with os.pread/os.pwrite; returns (bytes copied, CRC32C of them)."""
    data = b""
    while length < 0 or len(data) < length:
        want = 1 << 16 if length < 0 else min(1 << 16, length - len(data))
        chunk = os.pread(src_fd, want, src_offset + len(data))
        if not chunk:
            break
        data += chunk
    written = 0
    while written < len(data):
        written += os.pwrite(dst_fd, data[written:], dst_offset + written)
    return len(data), crc32c(data)


def pread_batch(
    fds: list[int], offsets: list[int], lengths: list[int], out: bytearray, out_offsets: list[int]
) -> list[int]:
    """Sequential os.pread of each request; returns bytes read or -errno per request."""
    results = []
    for fd, offset, length, dst in zip(fds, offsets, lengths, out_offsets, strict=True):
        try:
            data = os.pread(fd, length, offset)
        except OSError as exc:
            results.append(-(exc.errno or errno.EIO))
            continue
        out[dst : dst + len(data)] = data
        results.append(len(data))
    return results
