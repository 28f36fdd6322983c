"""``mpirun -n N python -m bbio.bench SUITE [--quick] [--json FILE] [suite options]``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import bbio.bench as bench
from bbio.config import load_config


def _load_suites() -> None:
    for module in pkgutil.iter_modules(bench.__path__):
        if not module.name.startswith("_") and module.name != "plot":
            importlib.import_module(f"bbio.bench.{module.name}")


def build_parser() -> argparse.ArgumentParser:
    """Options common to every suite, plus each suite's own."""
    _load_suites()
    parser = argparse.ArgumentParser(prog="python -m bbio.bench", description=__doc__)
    suites = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for entry in bench.SUITES.values():
        sub = suites.add_parser(entry.name, help=entry.help, description=entry.help)
        sub.add_argument("--quick", action="store_true", help="small sizes: under a minute")
        sub.add_argument("--json", metavar="FILE", help="write the results as JSON")
        if entry.add_arguments:
            entry.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one suite on ``MPI.COMM_WORLD``, print its table, optionally write JSON."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = ["python", "-m", "bbio.bench", *argv]
    from mpi4py import MPI

    from bbio.mpi import abort_on_error, topology

    comm = MPI.COMM_WORLD

    def run() -> None:
        config = load_config()
        topo = topology(comm, config.ranks_per_node)
        ctx = bench.BenchContext(comm, args, bench.Results())
        bench.SUITES[args.suite].run(ctx)
        comm.Barrier()
        if comm.Get_rank() == 0:
            print(ctx.results.table())
            if args.json:
                bench.write_json(args.json, args.suite, ctx, ctx.nodes or topo.nodes)
                print(f"wrote {args.json}")
        topo.free()

    return abort_on_error(comm, run)


if __name__ == "__main__":
    sys.exit(main())
