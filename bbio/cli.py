"""The ``bbio`` command: argument parsing only; every command calls the library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bbio._version import __version__
from bbio.config import load_config
from bbio.errors import BBIOError
from bbio.report import format_bytes, format_table


def _cmd_info(args: argparse.Namespace) -> int:
    from bbio.info import collect

    info = collect(load_config(args.config))
    rows = [
        ("bbio", info.bbio_version),
        ("MPI library", info.mpi_library.splitlines()[0]),
        ("mpi4py", info.mpi4py_version),
        ("h5py", info.h5py_version or "not installed"),
        ("HDF5", info.hdf5_version or "-"),
        ("h5py with MPI", "yes" if info.h5py_mpi else "NO (parallel HDF5 needed for checkpoints)"),
        (
            "native extension",
            "loaded" if info.native_loaded else f"NOT loaded: {info.native_error}",
        ),
        ("CRC32C", "hardware (SSE4.2)" if info.crc32c_hardware else "software tables"),
        ("BB root", info.bb.template),
        ("BB node 0", f"{info.bb.path}  ({format_bytes(info.bb.free_bytes)} free)"),
        ("PFS root", info.pfs.template),
        ("PFS path", f"{info.pfs.path}  ({format_bytes(info.pfs.free_bytes)} free)"),
        ("ranks per node", info.ranks_per_node or "real hosts"),
        ("job id", info.job_id),
    ]
    print(format_table(["item", "value"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``bbio`` command."""
    parser = argparse.ArgumentParser(prog="bbio", description=__doc__)
    parser.add_argument("--version", action="version", version=f"bbio {__version__}")
    parser.add_argument("--config", help="TOML config file (default: $BBIO_CONFIG)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="versions, capabilities and configured roots (no MPI)")
    info.set_defaults(run=_cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bbio`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except BBIOError as exc:
        print(f"bbio: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
