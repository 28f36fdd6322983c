"""The ``bbio`` command: argument parsing only; every command calls the library."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

from bbio._version import __version__
from bbio.config import load_config
from bbio.errors import BBIOError, from_oserror
from bbio.report import format_bytes, format_table

if TYPE_CHECKING:
    from bbio.info import RootInfo


def _root_rows(setting: str, label: str, path_label: str, root: RootInfo) -> list[tuple[str, str]]:
    """The two ``bbio info`` rows of the root ``setting``: "not set" when it is unset."""
    if root.path is None and root.problem is None:
        return [
            (label, f"not set (set BBIO_{setting.upper()} or {setting} in the config file)"),
            (path_label, "not set"),
        ]
    if root.path is None:
        return [(label, root.template), (path_label, f"cannot resolve: {root.problem}")]
    if root.free_bytes is None:
        return [(label, root.template), (path_label, f"{root.path}  (free: {root.problem})")]
    return [
        (label, root.template),
        (path_label, f"{root.path}  ({format_bytes(root.free_bytes)} free)"),
    ]


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
        *_root_rows("bb_root", "BB root", "BB node 0", info.bb),
        *_root_rows("pfs_root", "PFS root", "PFS path", info.pfs),
        ("ranks per node", info.ranks_per_node or "real hosts"),
        ("job id", info.job_id),
    ]
    print(format_table(["item", "value"], rows))
    return 0


def _run_collective(args: argparse.Namespace, call) -> int:
    """Run ``call(comm)`` on every rank of MPI.COMM_WORLD; report bbio errors once.

    bbio raises the same error on every rank, so rank 0 prints it and all ranks
    exit with status 1.  If the ranks do not all arrive within a minute (an
    error on some ranks only), the job is aborted rather than left hanging.
    """
    from mpi4py import MPI

    from bbio.mpi import abort_on_error, wait_all_ranks

    comm = MPI.COMM_WORLD
    logging.basicConfig(format="bbio: %(levelname)s: %(message)s", level=logging.INFO)

    def main() -> int:
        try:
            call(comm)
        except BBIOError as exc:
            if comm.Get_rank() == 0:
                print(f"bbio: error: {exc}", file=sys.stderr, flush=True)
            try:
                wait_all_ranks(comm, 60, "reporting the error")
            except BBIOError:
                print(f"bbio: error on rank {comm.Get_rank()}: {exc}", file=sys.stderr, flush=True)
                comm.Abort(1)
            return 1
        return 0

    return abort_on_error(comm, main)


def _print_on_root(comm, text: str) -> None:
    if comm.Get_rank() == 0:
        print(text, flush=True)


def _cmd_stage_in(args: argparse.Namespace) -> int:
    from bbio.stage.run import stage_in

    def call(comm) -> None:
        summary = stage_in(
            comm,
            args.src,
            args.dst,
            mode=args.mode,
            verify=args.verify,
            include=args.include,
            exclude=args.exclude,
            skip_unreadable=args.skip_unreadable,
            config=load_config(args.config),
        )
        _print_on_root(comm, summary.report())

    return _run_collective(args, call)


def _cmd_stage_out(args: argparse.Namespace) -> int:
    from bbio.stage.run import stage_out

    def call(comm) -> None:
        summary = stage_out(
            comm,
            args.src,
            args.dst,
            verify=args.verify,
            include=args.include,
            exclude=args.exclude,
            skip_unreadable=args.skip_unreadable,
            overwrite=args.overwrite,
            config=load_config(args.config),
        )
        _print_on_root(comm, summary.report())

    return _run_collective(args, call)


def _cmd_verify(args: argparse.Namespace) -> int:
    from bbio.stage.verify import verify

    def call(comm) -> None:
        report = verify(comm, args.src, args.dst, config=load_config(args.config))
        _print_on_root(comm, report.report())

    return _run_collective(args, call)


def parse_size(text: str) -> int:
    """'1048576', '64M', '1G', '512KiB' -> bytes (binary units)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = cleaned.rstrip("KMGT"), cleaned[len(cleaned.rstrip("KMGT")) :]
    try:
        value = int(float(number) * units[unit])
    except (KeyError, ValueError, OverflowError):  # OverflowError: inf, 1e400
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1G or 256M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _cmd_pack(args: argparse.Namespace) -> int:
    from bbio.stage.pack import pack

    def call(comm) -> None:
        summary = pack(
            comm,
            args.src,
            args.out,
            shard_size=args.shard_size,
            include=args.include,
            exclude=args.exclude,
            config=load_config(args.config),
        )
        _print_on_root(comm, summary.report())

    return _run_collective(args, call)


def _bb_root(args: argparse.Namespace):
    config = load_config(args.config)
    return config.expand(args.bb_root or config.bb_root, node=args.node or 0)


def _ckpt_roots(args: argparse.Namespace):
    config = load_config(args.config)
    pfs_root = config.expand(args.pfs_root) if args.pfs_root else config.pfs_dir()
    return _bb_root(args), pfs_root


def _cmd_ckpt_ls(args: argparse.Namespace) -> int:
    from bbio.checkpoint import admin

    bb_root, pfs_root = _ckpt_roots(args)
    rows = admin.list_checkpoints(bb_root, pfs_root, args.node, args.name)
    print(f"burst buffer {bb_root}; PFS {pfs_root}")
    print(
        format_table(
            ["name", "step", "burst buffer (this node)", "PFS", "drain queue"],
            [(r.name, r.step, r.bb, r.pfs, r.queue) for r in rows],
        )
    )
    return 0


def _cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from bbio.checkpoint import admin

    bb_root, pfs_root = _ckpt_roots(args)
    checked = admin.verify(bb_root, pfs_root, args.node, args.name)
    print(f"{checked} checkpoint file(s) verified (size and CRC32C)")
    return 0


def _cmd_ckpt_drain(args: argparse.Namespace) -> int:
    from bbio.checkpoint import admin

    drained = admin.finish(_bb_root(args), args.timeout)
    for journal in drained.failed:
        print(f"bbio: error: could not finish draining {journal}", file=sys.stderr)
    if drained.failed:
        return 1
    busy = {name: tasks for name, tasks in drained.queued.items() if tasks}
    if busy:
        steps = ", ".join(f"{name}: {tasks}" for name, tasks in busy.items())
        print(f"drained the queued checkpoint step(s) in {drained.bb_root} to the PFS ({steps})")
    else:
        print(
            f"nothing to drain in {drained.bb_root}: no checkpoint step queued "
            f"({len(drained.queued)} checkpointer journal(s))"
        )
    return 0


def _cmd_ckpt_wait(args: argparse.Namespace) -> int:
    from bbio.checkpoint import admin

    bb_root, pfs_root = _ckpt_roots(args)
    step = (
        args.step
        if args.step is not None
        else admin.newest_local_step(bb_root, pfs_root, args.name, args.node)
    )
    admin.wait_committed(bb_root, pfs_root, args.name, step, args.timeout)
    print(f"checkpoint {args.name} step {step} is committed on the PFS")
    return 0


def _cmd_slurm(args: argparse.Namespace) -> int:
    from bbio import slurm

    job = slurm.Job.from_env(os.environ)
    site = slurm.Site.load(args.config, os.environ)
    if args.slurm_command == "prolog":
        path = slurm.prolog(site, job)
        print(f"bbio prolog: burst buffer {path} ready")
        return 0
    done = slurm.epilog(site, job, slurm.epilog_timeout(args.timeout))
    for journal in done.failed:
        print(f"bbio epilog: could not drain {journal}; {done.path} is kept", file=sys.stderr)
    if done.failed:
        print(
            "bbio epilog: fix what is said above, then run the epilog again; a save said "
            "to be set aside is never drained, and fails every epilog of the job: once "
            f"you have kept what you need of {done.path} ('bbio ckpt ls --bb-root' on it), "
            "remove it by hand, then resume the node",
            file=sys.stderr,
        )
    if done.removed:
        print(
            "bbio epilog: every checkpoint file queued on this node is on the PFS (each "
            f"checkpoint is committed once every node's files are); {done.path} removed"
        )
    elif not done.failed:
        print(f"bbio epilog: no burst-buffer directory {done.path}: nothing to do")
    return 1 if done.failed else 0


def _add_filter_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--include", action="append", default=[], metavar="GLOB", help="only paths matching GLOB"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out paths matching GLOB (a directory: with all it holds)",
    )


def _add_transfer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify", action="store_true", help="re-read every copy and compare CRC32C"
    )
    _add_filter_options(parser)
    parser.add_argument(
        "--skip-unreadable",
        action="store_true",
        help="list and skip unreadable files (and files that keep changing) instead of failing",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``bbio`` command."""
    parser = argparse.ArgumentParser(
        prog="bbio",
        description="bbio: stage data between the PFS and node-local burst buffers, and "
        "look after checkpoints (run the MPI commands under mpirun or srun).",
        epilog="Docs: README.md, docs/staging.md, docs/reading.md, docs/checkpoints.md, "
        "docs/configuration.md, docs/admin-slurm.md.",
    )
    parser.add_argument("--version", action="version", version=f"bbio {__version__}")
    parser.add_argument(
        "--config",
        help="TOML config file (default: $BBIO_CONFIG, else /etc/bbio/bbio.toml if it exists)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="versions, capabilities and configured roots (no MPI)")
    info.set_defaults(run=_cmd_info)

    stage_in = commands.add_parser(
        "stage-in", help="copy a PFS tree into every node's burst buffer (run under MPI)"
    )
    stage_in.add_argument("src", help="source directory (on the PFS)")
    stage_in.add_argument("dst", help="destination on each node; may contain {node}")
    stage_in.add_argument(
        "--mode",
        choices=["replicate", "shard"],
        default="replicate",
        help="replicate: every node gets the whole tree (default); shard: each node a "
        "subset balanced by bytes",
    )
    _add_transfer_options(stage_in)
    stage_in.set_defaults(run=_cmd_stage_in)

    stage_out = commands.add_parser(
        "stage-out", help="merge every node's burst-buffer tree into one PFS tree (run under MPI)"
    )
    stage_out.add_argument("src", help="source on each node; may contain {node}")
    stage_out.add_argument("dst", help="destination directory (on the PFS)")
    _add_transfer_options(stage_out)
    stage_out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files of DST changed since bbio last wrote or read them (else refused)",
    )
    stage_out.set_defaults(run=_cmd_stage_out)

    check = commands.add_parser(
        "verify", help="re-read both sides of a transfer and compare with its manifest (MPI)"
    )
    check.add_argument("src", help="the transfer's source; may contain {node}")
    check.add_argument(
        "dst", help="the transfer's destination (holds the manifest); may contain {node}"
    )
    check.set_defaults(run=_cmd_verify)

    packer = commands.add_parser("pack", help="pack many small files into HDF5 shards (MPI)")
    packer.add_argument("src", help="directory of small files")
    packer.add_argument("out", help="output directory for shard-*.h5 and bbio-pack.json")
    packer.add_argument(
        "--shard-size", type=parse_size, default="1G", help="bytes per shard (default 1G)"
    )
    _add_filter_options(packer)
    packer.set_defaults(run=_cmd_pack)

    ckpt = commands.add_parser("ckpt", help="checkpoints on this node and the PFS (no MPI)")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    for action, help_text, run in (
        ("ls", "list checkpoints in this node's burst buffer and on the PFS", _cmd_ckpt_ls),
        ("verify", "re-read checkpoint files and compare CRC32C", _cmd_ckpt_verify),
        ("drain", "finish draining this node's checkpoints (Slurm epilog)", _cmd_ckpt_drain),
        ("wait", "wait until a checkpoint is committed on the PFS", _cmd_ckpt_wait),
    ):
        sub = ckpt_commands.add_parser(action, help=help_text, description=help_text)
        sub.add_argument("--bb-root", help="this node's burst buffer (default: configured)")
        if action != "drain":  # a drain goes where each journal's target.json says
            sub.add_argument("--pfs-root", help="the PFS root (default: configured)")
        sub.add_argument(
            "--node", type=int, help="virtual node index to expand {node} with (default 0)"
        )
        if action in ("ls", "verify"):
            sub.add_argument("name", nargs="?", help="one checkpointer name (default: all)")
        if action == "wait":
            sub.add_argument("name", help="checkpointer name")
            sub.add_argument("--step", type=int, help="default: the newest in this burst buffer")
        if action == "drain":
            sub.add_argument(
                "--finish",
                action="store_true",
                required=True,
                help="drain everything now, then exit",
            )
        if action in ("drain", "wait"):
            sub.add_argument("--timeout", type=float, help="seconds before giving up")
        sub.set_defaults(run=run)

    hooks = commands.add_parser("slurm", help="Slurm prolog and epilog work on this node (no MPI)")
    hook_commands = hooks.add_subparsers(dest="slurm_command", metavar="HOOK", required=True)
    hook_commands.add_parser(
        "prolog", help="create the job's burst-buffer directory for its user (run as root)"
    ).set_defaults(run=_cmd_slurm)
    epilog = hook_commands.add_parser(
        "epilog", help="drain queued checkpoints, then remove the job's burst-buffer directory"
    )
    epilog.add_argument("--timeout", default="3600", help="seconds, inf: no limit (default 3600)")
    epilog.set_defaults(run=_cmd_slurm)
    return parser


LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launched_rank() -> int:
    """This process's rank as its launcher (mpirun, srun) set it; 0 when not launched."""
    for name in LAUNCHER_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


USAGE_EXIT_DELAY_SECONDS = 10.0  # mpirun ends the job at rank 0's exit; srun waits


def _let_the_first_rank_speak() -> None:
    """Under a launcher, every rank meets a usage error at once and the launcher may end
    the job as soon as one rank has failed: the other ranks wait (a busy machine may
    start the first rank seconds late), so that the first rank, which alone prints
    it, gets the message out."""
    if launched_rank() > 0:
        time.sleep(USAGE_EXIT_DELAY_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bbio`` command."""
    parser = build_parser()
    # Usage errors are the same on every rank: only the first rank prints them.
    quiet = contextlib.redirect_stderr(io.StringIO()) if launched_rank() > 0 else nullcontext()
    with quiet:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                _let_the_first_rank_speak()
            raise
    if not getattr(args, "run", None):
        if launched_rank() == 0:
            parser.print_help()
        _let_the_first_rank_speak()
        return 2
    try:
        return args.run(args)
    except BBIOError as exc:
        print(f"bbio: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # one the library did not turn into a BBIOError: name its path
        words = (
            args.command,
            getattr(args, "ckpt_command", None),
            getattr(args, "slurm_command", None),
        )
        error = from_oserror(
            exc,
            f"finish bbio {' '.join(word for word in words if word)}",
            hint="check that path (its permissions for this user, its file system), then run "
            "the command again",
        )
        print(f"bbio: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
