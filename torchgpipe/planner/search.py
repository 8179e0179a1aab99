"""The search: every configuration worth predicting, and the fastest that fits.

A configuration is a schedule with its *shape* (partitions per worker: one,
a loop, or a V), micro-batches, a checkpoint mode and a balance. The
balances tried are few but disagree: by time, by memory, by both, and by
layer count. The best few are then refined by moving one boundary a layer
at a time while the step gets faster and still fits, which is how a layer
heavy in memory but light in time (a large vocabulary's head) finds its place.
"""
from dataclasses import replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from torchgpipe.balance import blockpartition
from torchgpipe.engine.generators import BUILT_INS
from torchgpipe.planner.costs import Costs
from torchgpipe.planner.option import Option, option
from torchgpipe.planner.predict import Candidate, micro_batches, predict

__all__: List[str] = []

#: How many of the best configurations have their balance refined.
REFINED = 8


def chunk_counts(batch: int, most: int) -> List[int]:
    """The numbers of micro-batches up to ``most`` a mini-batch really splits into: a
    count ``torch.chunk`` cannot make (10 samples in 6) is the smaller one's step."""
    return sorted({len(micro_batches(batch, m)) for m in range(1, min(most, batch) + 1)})


def balances(costs: Costs, partitions: int, param_scale: float) -> List[Tuple[int, ...]]:
    """A few balances of the layers into ``partitions``, by time, memory, both, and count."""
    layers = costs.layers
    if partitions > layers:
        return []
    at = costs.at(costs.sizes[len(costs.sizes) // 2])
    time = [at.forward[k] + at.backward[k] for k in range(layers)]
    memory = [at.kept[k] + param_scale * costs.parameters[k] for k in range(layers)]
    if costs.loss:  # the loss runs with the last layer
        time[-1] += at.forward[-1] + at.backward[-1]
        memory[-1] += at.kept[-1]
    found = []
    for weights in (time, memory, _mixed(time, memory)):
        scaled = [round(w * 1e6 / max(max(weights), 1e-30)) for w in weights]
        found.append(tuple(len(block) for block in blockpartition.solve(scaled, partitions)))
    base, extra = divmod(layers, partitions)
    found.append(tuple(base + (j < extra) for j in range(partitions)))
    return list(dict.fromkeys(found))


def _mixed(time: Sequence[float], memory: Sequence[float]) -> List[float]:
    """Each layer's share of the total time plus its share of the total memory."""
    total_time, total_memory = max(sum(time), 1e-30), max(sum(memory), 1e-30)
    return [t / total_time + m / total_memory for t, m in zip(time, memory)]


def configurations(costs: Costs, workers: int, *, schedules: Sequence[str],
                   chunks: Sequence[int], checkpoints: Sequence[str],
                   param_scale: float) -> Iterator[Candidate]:
    """Every configuration of the grid, with the balances of :func:`balances`."""
    for name in schedules:
        for virtual, placement in BUILT_INS[name].shapes:
            if virtual > 1 and workers == 1:
                continue  # one worker: more partitions only add overhead
            for balance in balances(costs, virtual * workers, param_scale):
                for m in chunks:
                    for mode in checkpoints:
                        yield Candidate(name, balance, m, mode, workers, placement)


def search(costs: Costs, workers: int, *, memory_limit: Optional[float],
           schedules: Sequence[str], chunks: Sequence[int], checkpoints: Sequence[str],
           param_scale: float, shards: int = 1) -> List[Option]:
    """Every configuration predicted, the best that fit ``memory_limit`` refined: those
    that fit first (fastest first, then the smaller peak), then the others (smallest
    peak first)."""
    seen: Dict[Candidate, Option] = {}

    def scored(candidate: Candidate) -> Option:
        if candidate not in seen:
            found = predict(costs, candidate, param_scale=param_scale, shards=shards)
            seen[candidate] = option(candidate, found.step, found.memory, found.busy)
        return seen[candidate]

    def key(candidate: Candidate) -> Tuple[float, float]:
        return scored(candidate).step, max(scored(candidate).memory)

    grid = list(configurations(costs, workers, schedules=schedules, chunks=chunks,
                               checkpoints=checkpoints, param_scale=param_scale))
    for start in sorted((c for c in grid if scored(c).fits(memory_limit)), key=key)[:REFINED]:
        # Moves one boundary by a layer at a time while the step gets faster and still fits.
        best: Optional[Candidate] = start
        while best is not None:
            moved = [replace(best, balance=b) for b in neighbours(best.balance)]
            better = [c for c in moved if scored(c).fits(memory_limit) and key(c) < key(best)]
            best = min(better, key=key, default=None)
    fit = sorted((c for c in seen if seen[c].fits(memory_limit)), key=key)
    over = sorted((c for c in seen if not seen[c].fits(memory_limit)),
                  key=lambda c: max(seen[c].memory))
    return [seen[c] for c in fit + over]


def neighbours(balance: Tuple[int, ...]) -> Iterator[Tuple[int, ...]]:
    """The balances one layer away: a boundary moved left or right, no partition emptied."""
    for j in range(len(balance) - 1):
        for step in (-1, 1):
            moved = list(balance)
            moved[j] += step
            moved[j + 1] -= step
            if moved[j] > 0 and moved[j + 1] > 0:
                yield tuple(moved)
