"""Which samples each rank reads at each step: a pure function of the seed.

The split is PyTorch ``DistributedSampler``'s: the epoch's order (a permutation
seeded with ``seed + epoch``, or ``0..n-1`` without shuffling) is dealt out
round-robin, rank ``r`` taking positions ``r, r + R, r + 2R, ...``.  Two choices
differ, so that an epoch delivers every sample exactly once:

* ``drop_last=False``: no padding.  Ranks get ``ceil`` or ``floor`` of
  ``n / R`` samples; a rank may get a short or empty last batch.
* ``drop_last=True``: the order is cut to a multiple of ``R`` (as the sampler
  does), and each rank's incomplete last batch is dropped (as ``DataLoader``
  does).

The permutation comes from NumPy (PCG64), not from ``torch.randperm``.
"""

from __future__ import annotations

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of all ``n`` samples in ``epoch``."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(seed + epoch).permutation(n).astype(np.int64)


def rank_indices(order: np.ndarray, replicas: int, rank: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s share of ``order`` (``DistributedSampler``'s round-robin split)."""
    if drop_last:
        order = order[: (order.size // replicas) * replicas]
    return order[rank::replicas]


def steps_per_epoch(n: int, replicas: int, batch_size: int, drop_last: bool) -> int:
    """Steps in one epoch: the same on every rank."""
    if drop_last:
        return (n // replicas) // batch_size
    per_rank = -(-n // replicas)
    return -(-per_rank // batch_size)


def epoch_batches(
    n: int,
    replicas: int,
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
) -> list[list[np.ndarray]]:
    """Every step's batches of one epoch: ``result[step][rank]`` (maybe empty)."""
    return batches_of(epoch_order(n, seed, epoch, shuffle), replicas, batch_size, drop_last)


def batches_of(
    order: np.ndarray, replicas: int, batch_size: int, drop_last: bool
) -> list[list[np.ndarray]]:
    """The batches of an epoch whose order is ``order``: ``result[step][rank]``."""
    shares = [rank_indices(order, replicas, rank, drop_last) for rank in range(replicas)]
    return [
        [share[step * batch_size : (step + 1) * batch_size] for share in shares]
        for step in range(steps_per_epoch(order.size, replicas, batch_size, drop_last))
    ]
