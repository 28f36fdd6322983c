"""The MPI shell's helpers: node topology (real or virtual) and agreement on errors.

Importing this module does not import ``mpi4py.MPI``: every function receives
a communicator, so MPI is already initialised by the caller.  The only call
that works without an initialised MPI is :func:`library_version`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

from bbio.config import Config, load_config
from bbio.errors import CLASSES_BY_NAME, BBIOError, BBIOTimeoutError, CollectiveError, UsageError

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def _mpi():
    from mpi4py import MPI

    return MPI


@dataclasses.dataclass
class Topology:
    """How the ranks of ``comm`` group into nodes.

    ``node_comm`` holds the ranks of this rank's node; ``leader_comm`` holds
    rank 0 of every node, and is None on the other ranks.  Nodes are numbered
    0..nodes-1 in the order of their lowest world rank.
    """

    comm: Any
    node_comm: Any
    leader_comm: Any | None
    node: int
    nodes: int
    virtual: bool

    @property
    def nodes_on_host(self) -> int:
        """How many nodes share this machine: all of them when virtual, else 1."""
        return self.nodes if self.virtual else 1

    @property
    def is_leader(self) -> bool:
        """True on the rank that leads its node (node rank 0)."""
        return self.node_comm.Get_rank() == 0

    def node_of_rank(self) -> list[int]:
        """Collective over ``comm``: the node index of every rank of ``comm``."""
        return self.comm.allgather(self.node)

    def free(self) -> None:
        """Free the communicators this topology created.  Collective over ``comm``."""
        self.node_comm.Free()
        if self.leader_comm is not None:
            self.leader_comm.Free()


def topology(comm, ranks_per_node: int | None = None) -> Topology:
    """Split ``comm`` into nodes.  Collective over ``comm``.

    With ``ranks_per_node`` set (``BBIO_RANKS_PER_NODE``), consecutive groups of
    that many ranks form virtual nodes, which is how multi-node behaviour is
    tested on one machine.  Otherwise ranks sharing memory form a node.
    """
    mpi = _mpi()
    rank = comm.Get_rank()
    if ranks_per_node:
        node_comm = comm.Split(color=rank // ranks_per_node, key=rank)
    else:
        node_comm = comm.Split_type(mpi.COMM_TYPE_SHARED, key=rank)
    is_leader = node_comm.Get_rank() == 0
    leader_comm = comm.Split(color=0 if is_leader else mpi.UNDEFINED, key=rank)
    if leader_comm == mpi.COMM_NULL:
        leader_comm = None
    node, nodes = (leader_comm.Get_rank(), leader_comm.Get_size()) if is_leader else (0, 0)
    node, nodes = node_comm.bcast((node, nodes), root=0)
    return Topology(comm, node_comm, leader_comm, node, nodes, virtual=bool(ranks_per_node))


def all_agree(comm, ok: bool) -> bool:
    """Collective over ``comm``: True only if ``ok`` is True on every rank."""
    return bool(comm.allreduce(bool(ok), op=_mpi().LAND))


def same_arguments(comm, what: str, arguments: Mapping[str, Any]) -> None:
    """Collective over ``comm``: raise the same :class:`UsageError` on every rank unless
    every rank is in the collective call ``what`` (:func:`check_same_call`) and passed
    it equal ``arguments`` (name -> value).

    Values are compared by a fingerprint (:func:`fingerprints`): arrays by dtype,
    shape and a digest of their bytes, paths as strings, anything else by
    ``repr``.  The error names each differing argument with rank 0's value and the
    first other rank's.
    """
    check_same_arguments(what, gather_in_call(comm, what, fingerprints(arguments)))


def fingerprints(arguments: Mapping[str, Any]) -> dict[str, str]:
    """Not collective: ``arguments`` (name -> value) as :func:`check_same_arguments`
    compares them, for a call that gathers them with what else it gathers."""
    return {name: _fingerprint(value) for name, value in arguments.items()}


def check_same_arguments(what: str, everyone: Sequence[Mapping[str, str]]) -> None:
    """Not collective: raise :class:`UsageError` unless every rank's
    :func:`fingerprints` (as gathered, in rank order, by every rank) are equal."""
    first = everyone[0]
    differing = [
        (name, rank, theirs[name])
        for name in first
        for rank, theirs in enumerate(everyone)
        if theirs.get(name) != first[name]
    ]
    seen: dict[str, tuple[int, str]] = {}
    for name, rank, value in differing:
        seen.setdefault(name, (rank, value))
    if seen:
        listed = "; ".join(
            f"{name}: rank 0 {first[name]}, rank {rank} {value}"
            for name, (rank, value) in seen.items()
        )
        raise UsageError(
            f"{what}: the ranks passed different arguments ({listed})",
            hint="a collective call needs the same arguments on every rank of its communicator",
        )


def gather_in_call(comm, what: str, mine: T) -> list[T]:
    """Collective over ``comm``: allgather ``mine`` from every rank of the collective call
    ``what``, after :func:`check_same_call`."""
    everyone = comm.allgather((what, mine))
    check_same_call([call for call, _ in everyone])
    return [theirs for _, theirs in everyone]


def check_same_call(calls: Sequence[str]) -> None:
    """Not collective: raise :class:`UsageError` unless ``calls``, the call each rank is in
    (as gathered, in rank order, by every rank), are one call.

    bbio's collective calls each begin with an allgather of their name, so a
    rank in another call of the same object (say ``close`` while the others
    ``save``) makes every rank raise this error instead of hanging.
    """
    other = next((rank for rank, call in enumerate(calls) if call != calls[0]), None)
    if other is not None:
        raise UsageError(
            f"the ranks are in different collective calls: rank 0 in {calls[0]}, "
            f"rank {other} in {calls[other]}",
            hint="make each collective call on every rank of the communicator, in the same "
            "order (close a checkpointer or a dataset on every rank, not on some)",
        )


def _fingerprint(value: Any) -> str:
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return f"array({value.dtype.str}, {value.shape}, sha256 {digest})"
    if isinstance(value, os.PathLike):
        return repr(os.fspath(value))
    if isinstance(value, np.generic):  # np.int64(2) and 2 are the same argument
        return repr(value.item())
    return repr(value)


def deal(items: Sequence[T], comm) -> Sequence[T]:
    """This rank's share of ``items``, dealt round-robin over the ranks of ``comm``."""
    return items[comm.Get_rank() :: comm.Get_size()]


def allgather_dict(comm, part: Mapping[K, V]) -> dict[K, V]:
    """Collective over ``comm``: the union of every rank's ``part`` (later ranks win ties)."""
    merged: dict[K, V] = {}
    for piece in comm.allgather(dict(part)):
        merged.update(piece)
    return merged


def sum_over_ranks(comm, *values: int) -> list[int]:
    """Collective over ``comm``: the element-wise sums of ``values`` over all ranks."""
    return [int(v) for v in comm.allreduce(np.array(values, dtype=np.int64))]


def describe_error(exc: BaseException) -> tuple[str, str, int | None]:
    """Not collective: (class, message, errno) of ``exc`` as every rank can rebuild it (with
    :func:`agreed_error`, or as a column's members do in staging): a bbio error's
    class is the nearest one of :data:`CLASSES_BY_NAME` it derives from (a module's own
    subclass, such as a UsageError's, stays a UsageError)."""
    known = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in CLASSES_BY_NAME), None)
    name = known if isinstance(exc, BBIOError) and known else type(exc).__name__
    errno = getattr(exc, "errno", None) if isinstance(exc, BBIOError) else None
    return name, str(exc), errno if isinstance(errno, int) else None


def agreed_error(failures: list[tuple], what: str, size: int) -> BBIOError:
    """The one error every rank raises for ``failures`` [(rank, class, message[, errno])] of
    ``size`` ranks.

    The lowest failing rank's error is kept, with its class (and errno) when that
    is a bbio error class; other exceptions become :class:`CollectiveError`.
    When every rank failed alike, no rank is singled out.
    """
    rank, cls_name, message = failures[0][:3]
    errno = failures[0][3] if len(failures[0]) > 3 else None
    if len(failures) == size and all(f[1:] == failures[0][1:] for f in failures):
        where = ""
    else:
        others = ", ".join(str(f[0]) for f in failures[1:])
        where = f" on rank {rank}" + (f" (ranks {others} failed too)" if others else "")
    cls = CLASSES_BY_NAME.get(cls_name)
    if cls is None:
        return CollectiveError(f"{what} failed{where}: {cls_name}: {message}")
    return cls(f"{what} failed{where}: {message}", errno=errno)


@contextmanager
def agreed(comm, what: str, totals: np.ndarray | None = None) -> Iterator[None]:
    """Collective over ``comm``: run the block, then make every rank agree on its outcome.

    If the block raises on any rank, every rank raises the same error, naming
    the failing rank and its message (the local exception is chained as the
    cause).  No rank is left waiting: the agreement is one small allreduce that
    every rank reaches, failed or not (then, only after a failure, an
    allgather of the messages), so the block itself must not enter a
    collective after a local failure could have happened on another rank.
    The allreduce is waited for without spinning in MPI (:func:`wait_quietly`):
    ranks that finish first leave the CPU to the others and to file system daemons.
    ``totals``, int64 counters the block may fill in, are summed over the
    ranks in place by the same allreduce.
    """
    local: Exception | None = None
    try:
        yield
    except Exception as exc:
        local = exc
    sums = np.zeros(1 + (0 if totals is None else totals.size), dtype=np.int64)
    sums[0] = local is not None
    if totals is not None:
        sums[1:] = totals
    wait_quietly(comm.Iallreduce(_mpi().IN_PLACE, sums, op=_mpi().SUM))
    if totals is not None:
        totals[:] = sums[1:]
    if not sums[0]:
        return
    outcome = None if local is None else describe_error(local)
    outcomes = comm.allgather(outcome)
    failures = [(r, *o) for r, o in enumerate(outcomes) if o is not None]
    if failures:
        raise agreed_error(failures, what, comm.Get_size()) from local


def agreed_config(comm, what: str, config: Config | None) -> Config:
    """Collective over ``comm``, the first step of the collective call ``what``:
    ``config``, else the settings :func:`load_config` reads.  A rank whose settings
    cannot be read (a bad ``BBIO_*`` variable or config file on one node) makes every
    rank raise the same :class:`ConfigError`, instead of leaving the other ranks in the
    call's first collective; a rank in another call makes every rank raise the
    :class:`UsageError` of :func:`check_same_call`."""
    return agreed_allgather(comm, what, lambda: config or load_config())[comm.Get_rank()]


def agreed_allgather(comm, what: str, fn: Callable[[], T], quiet: bool = False) -> list[T]:
    """Collective over ``comm``: run ``fn()`` on every rank and allgather the results.

    Like :func:`agreed` and an ``allgather`` in one collective: if ``fn``
    raises on any rank, every rank raises the same error instead.  A rank in
    another call raises :func:`check_same_call`'s error on every rank.  With
    ``quiet``, ranks wait for the slowest ``fn`` without spinning
    (:func:`wait_quietly` on a barrier), when ``fn`` takes long and unevenly.
    """
    local: Exception | None = None
    result = None
    try:
        result = fn()
    except Exception as exc:
        local = exc
    if quiet:
        wait_quietly(comm.Ibarrier())
    outcome = None if local is None else describe_error(local)
    outcomes = gather_in_call(comm, what, (outcome, result))
    failures = [(r, *o) for r, (o, _) in enumerate(outcomes) if o is not None]
    if failures:
        raise agreed_error(failures, what, comm.Get_size()) from local
    return [value for _, value in outcomes]


def wait_quietly(*requests, poll: float = 0.0002, yield_for: float = 0.002) -> None:
    """Not collective: wait for non-blocking MPI ``requests`` without MPI's busy polling.

    MPI's blocking waits poll the network at full speed; a rank that only
    waits for others then takes CPU time from the ranks (and file system
    daemons) doing the work.  This tests the requests (each test also drives
    their progress), for the first ``yield_for`` seconds yielding the CPU
    between tests (``sched_yield``: another runnable process runs, else the
    test comes again at once), then sleeping ``poll`` seconds between them.
    The short waits of a collective call whose ranks arrive together (a
    save's agreements) end without a sleep's delay at every step of the
    collective; a long wait sleeps.
    """
    from mpi4py import MPI

    pending = list(requests)
    yield_until = time.perf_counter() + yield_for
    while not MPI.Request.Testall(pending):
        if time.perf_counter() < yield_until:
            os.sched_yield()
        else:
            time.sleep(poll)


def wait_all_ranks(comm, timeout: float, what: str) -> None:
    """Collective over ``comm``: a barrier that raises instead of waiting forever.

    Polls a non-blocking barrier; after ``timeout`` seconds the ranks that are
    still waiting raise :class:`BBIOTimeoutError` naming ``what``.
    """
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise BBIOTimeoutError(
                f"{what}: other ranks did not arrive within {timeout:.0f} s",
                rank=comm.Get_rank(),
                hint="another rank failed or hangs; see its output",
            )
        time.sleep(0.001)


def abort_on_error(comm, main: Callable[[], int | None]) -> int:
    """Run a program's ``main`` on this rank; if it raises, print and abort the job.

    Like ``python -m mpi4py``: one rank's uncaught exception ends every rank,
    so an MPI job never hangs on a dead peer.
    """
    try:
        return int(main() or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): Python prints it and exits with 1
            print(exc.code, file=sys.stderr, flush=True)
            code = 1
        if code and comm.Get_size() > 1:
            sys.stdout.flush()
            comm.Abort(code)
        return code
    except BaseException as exc:
        rank = comm.Get_rank()
        if isinstance(exc, BBIOError):
            print(f"bbio: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        else:
            tb = "".join(traceback.format_exception(exc))
            print(f"bbio: rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if comm.Get_size() > 1:
            comm.Abort(1)
        return 1


def library_version() -> str:
    """The MPI library's version string, without initialising MPI.  Not collective."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    return _mpi().Get_library_version().replace("\x00", "").strip()
