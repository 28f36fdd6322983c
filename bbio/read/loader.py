"""``Loader``: batches of a global shuffle, read collectively, prefetched in the background.

Every rank computes the whole shuffled order from the seed (see
:mod:`bbio.read.sampler`), so no request is ever exchanged: each step is one
planned collective read.  While the training computes, a background thread
reads the next ``prefetch`` steps (MPI must run with ``MPI_THREAD_MULTIPLE``,
mpi4py's default; otherwise the loader reads in the foreground and says so).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import numpy as np

from bbio.arguments import integer_argument
from bbio.errors import UsageError
from bbio.mpi import agreed, same_arguments
from bbio.read.datasets import Dataset
from bbio.read.sampler import batches_of, epoch_order, steps_per_epoch

log = logging.getLogger("bbio")


class Loader:
    """Iterate over batches: each rank gets its part of a global shuffle.

    Collective over ``comm``, which must hold the dataset's ranks in the same
    order (the communicator given to :func:`open_dataset`, or a duplicate) on
    every rank: a rank that passes None or ``MPI.COMM_NULL`` cannot reach the
    others, which then wait (when every rank does, each raises a
    :class:`UsageError`).  Every rank must
    create the loader with the same dataset and arguments, iterate the same
    number of steps and call :meth:`close` (or use ``with``).  Invalid or
    differing arguments, or different datasets, raise the same
    :class:`UsageError` on every rank, as does a second loader of a dataset
    while another loader of it is mid-iteration (started, neither closed nor at
    its end), prefetching or not.
    ``start_step`` resumes after that many steps (counted over all
    epochs), e.g. the step saved with a checkpoint.  Each element is what
    :meth:`Dataset.read` returns for this rank's ids of that step;
    ``loader.indices`` holds those ids.  The split is PyTorch
    ``DistributedSampler``'s, without padding: with ``drop_last=False`` an
    epoch delivers every sample exactly once across ranks.
    """

    def __init__(
        self,
        comm,
        dataset: Dataset,
        batch_size: int,
        seed: int,
        epochs: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        prefetch: int = 2,
        start_step: int = 0,
    ) -> None:
        from mpi4py import MPI

        if not _is_communicator(comm):  # nothing to agree over, but the dataset's
            _check_dataset(dataset)
        arguments: dict = {}
        # The caller's communicator, not the dataset's: ranks that pass different
        # datasets would wait in collectives over different communicators.
        common = comm if _is_communicator(comm) else dataset.comm
        with agreed(common, "Loader"):
            _check_dataset(dataset)
            _check_communicator(comm, dataset)
            _check_no_loader_iterating(dataset)
            where = dataset.path
            arguments = {
                "batch_size": integer_argument("batch_size", batch_size, 1, where),
                "seed": integer_argument("seed", seed, 0, where),
                "epochs": integer_argument("epochs", epochs, 0, where),
                "shuffle": _flag("shuffle", shuffle, where),
                "drop_last": _flag("drop_last", drop_last, where),
                "prefetch": integer_argument("prefetch", prefetch, 0, where),
                "start_step": integer_argument("start_step", start_step, 0, where),
            }
        same_arguments(common, "Loader", {"dataset": dataset.opening})
        same_arguments(common, f"Loader of {dataset.path}", arguments)
        self.dataset = dataset
        dataset.loaders.add(self)
        self.rank = dataset.comm.Get_rank()
        self.replicas = dataset.comm.Get_size()
        self.batch_size = arguments["batch_size"]
        self.seed = arguments["seed"]
        self.epochs = arguments["epochs"]
        self.shuffle = arguments["shuffle"]
        self.drop_last = arguments["drop_last"]
        self.start_step = arguments["start_step"]
        prefetch = arguments["prefetch"]
        threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if prefetch and not threaded and self.rank == 0:
            log.warning(
                "MPI is not initialised with MPI_THREAD_MULTIPLE: reading in the foreground"
            )
        self.prefetch = prefetch if threaded else 0
        self.indices = None  # this rank's ids of the batch last returned
        self._steps = steps_per_epoch(len(dataset), self.replicas, self.batch_size, self.drop_last)
        self._queue: queue.Queue = queue.Queue()
        self._turn = threading.Condition()
        self._allowed = 0  # the background thread may fetch steps below this
        self._closing = False
        self._thread: threading.Thread | None = None
        self._iterated = False  # iter() was called
        self._started = False  # the first step was asked for
        self._failed = False  # a step raised: the iteration ended
        self._taken = 0  # steps the training thread took
        self._total = max(0, self.epochs * self._steps - self.start_step)
        # The first epoch's shuffle is drawn now, not in the first step: for a
        # dataset of many small samples it takes tens of milliseconds.
        first = self.start_step // self._steps if self._steps else self.epochs
        self._orders: dict[int, np.ndarray] = {}
        if first < self.epochs:
            self._orders[first] = epoch_order(len(dataset), self.seed, first, self.shuffle)

    def __len__(self) -> int:
        """Steps per epoch (the same on every rank)."""
        return self._steps

    @property
    def iterating(self) -> bool:
        """Whether the loader is mid-iteration: its first step was asked for, and it is
        neither closed nor at its end (the training thread took the schedule's last step,
        or an error).  The same on every rank, which all iterate alike.  Not collective."""
        ended = self._failed or self._taken == self._total
        return self._started and not self._closing and not ended

    def _schedule(self) -> Iterator[tuple]:
        step = 0
        for epoch in range(self.epochs):
            if step + self._steps <= self.start_step:  # a whole epoch already done
                step += self._steps
                continue
            order = self._orders.pop(epoch, None)
            if order is None:
                order = epoch_order(len(self.dataset), self.seed, epoch, self.shuffle)
            for batches in batches_of(order, self.replicas, self.batch_size, self.drop_last):
                if step >= self.start_step:
                    yield batches
                step += 1

    def _fetch(self, batches) -> tuple:
        # Drawn from the seed, the batches are the same on every rank (the arguments
        # were compared): no digest of them is compared at every step.
        self.dataset.check_open()  # closed under the loader: closing is collective
        return batches[self.rank], self.dataset._read_planned(batches)

    def _may_fetch(self, step: int) -> bool:
        with self._turn:
            while step >= self._allowed and not self._closing:
                self._turn.wait()
            return step < self._allowed

    def _allow(self, steps: int) -> None:
        with self._turn:
            self._allowed += steps
            self._turn.notify()

    def _background(self) -> None:
        try:
            for step, batches in enumerate(self._schedule()):
                if not self._may_fetch(step):
                    return
                self._queue.put(("batch", self._fetch(batches)))
        except BaseException as exc:  # handed to the training thread
            self._queue.put(("error", exc))
            return
        self._queue.put(("end", None))

    def __iter__(self) -> Iterator:
        """Each step is a collective read over the dataset's communicator."""
        self._check_open()
        if self.prefetch and self._iterated:
            raise UsageError("a prefetching Loader can be iterated once; create a new one")
        self._iterated = True
        return self._batches()

    def _check_open(self) -> None:
        if self._closing:
            raise UsageError(
                "the Loader is closed", path=self.dataset.path, hint="create a new Loader"
            )

    def _batches(self) -> Iterator:
        self._started = True
        if self.prefetch == 0:  # may be iterated again: each iteration counts its own steps
            self._failed, self._taken = False, 0
            for batches in self._schedule():
                self._check_open()
                try:
                    self.indices, data = self._fetch(batches)
                except BaseException:  # raised alike on every rank: the iteration ends
                    self._failed = True
                    raise
                self._taken += 1
                yield data
            return
        self._allow(self.prefetch)
        self._thread = threading.Thread(target=self._background, name="bbio-loader", daemon=True)
        self._thread.start()
        while True:
            self._check_open()
            kind, item = self._queue.get()
            if kind == "end":
                return
            if kind == "error":
                self._failed = True
                raise item
            self._allow(1)
            self.indices, data = item
            self._taken += 1
            yield data

    def close(self) -> None:
        """Collective: stop prefetching and join the background thread.  Iterating a closed
        loader raises :class:`UsageError`.

        The thread only ever runs ahead by the steps the training has allowed,
        the same number on every rank, so the collective reads it has started
        finish alike everywhere before it stops.
        """
        with self._turn:
            self._closing = True
            self._turn.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_dataset(dataset) -> None:
    """Raise unless ``dataset`` is an open :class:`Dataset`.  Not collective."""
    if not isinstance(dataset, Dataset):
        raise UsageError(
            f"Loader needs a dataset opened with open_dataset, not {type(dataset).__name__}"
        )
    dataset.check_open()


def _check_no_loader_iterating(dataset: Dataset) -> None:
    """Raise unless no loader of ``dataset`` is mid-iteration (:attr:`Loader.iterating`):
    its collective reads (in the background when it prefetches) would mix with a new
    loader's.  Not collective."""
    if any(loader.iterating for loader in dataset.loaders):
        raise UsageError(
            "another Loader of this dataset is still iterating (started, neither closed "
            "nor at its end)",
            path=dataset.path,
            hint="iterate it to its end or close it (loader.close(), or leave its with "
            "block) before making another of the same dataset; its reads would mix with "
            "the new loader's",
        )


def _check_communicator(comm, dataset: Dataset) -> None:
    """Raise unless ``comm`` holds ``dataset``'s ranks in the same order.  Not collective."""
    from mpi4py import MPI

    if not _is_communicator(comm):
        given = "a freed communicator" if comm == MPI.COMM_NULL else type(comm).__name__
        raise UsageError(
            f"Loader needs the communicator the dataset was opened with, not {given}",
            path=dataset.path,
        )
    relation = MPI.Comm.Compare(comm, dataset.comm)
    if relation not in (MPI.IDENT, MPI.CONGRUENT):
        names = {MPI.SIMILAR: "the dataset's ranks in another order", MPI.UNEQUAL: "other ranks"}
        raise UsageError(
            f"the Loader's communicator holds {names[relation]} (it must be the dataset's)",
            path=dataset.path,
            hint="pass the communicator the dataset was opened with",
        )


def _is_communicator(comm) -> bool:
    """Is ``comm`` an MPI communicator, not freed?  Not collective."""
    from mpi4py import MPI

    return isinstance(comm, MPI.Comm) and comm != MPI.COMM_NULL


def _flag(name: str, value, path) -> bool:
    """``value`` as a bool, else a :class:`UsageError` naming ``name`` (and ``path``).
    Not collective."""
    if not isinstance(value, (bool, np.bool_)):
        raise UsageError(f"{name} must be True or False, not {value!r}", path=path)
    return bool(value)
