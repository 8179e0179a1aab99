"""A partition's costs, summed from its layers' at a micro-batch size: its actions'
times, and the bytes :func:`~torchgpipe.planner.predict.peak_memory` walks through.

Within a partition the layers' backward passes run last first, each freeing
the activations it used, so the most a partition's backward pass holds is the
most any layer's does beyond what the layers after it have freed. The
pipeline holds what it hands over (an output, skips) until the backward pass
that needs it, and the gradients it passes a backward pass until it returns.
"""
import bisect
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from torchgpipe.planner.costs import Costs, LayerCosts

__all__: List[str] = []


@dataclass(frozen=True)
class Times:
    """A partition's task times, in seconds: ``F``, ``I``, ``W`` and ``B`` (the loss's in
    the last; the first partition's ``I`` computes nothing and its ``W`` is its ``B``)."""

    forward: float
    input: float
    weight: float
    backward: float


@dataclass(frozen=True)
class Activations:
    """What a partition's forward pass leaves for its backward pass, in bytes: ``kept``
    (its layers' saved tensors, and ``held``: the output and sent skips only the
    pipeline holds), the skips it pops ``received`` from another worker (copies) or
    ``handed`` by an earlier partition of its own, the gradients ``I`` keeps until ``W``
    (``retained``), and what ``I`` lets go of beside ``held`` (``above``: the graph
    above the last layer with weights, where no ``W`` starts)."""

    kept: float
    held: float
    received: float
    handed: float
    retained: float
    above: float


@dataclass(frozen=True)
class Peak:
    """The most a backward pass holds beyond the activations kept: ``alone``; ``making``
    the weights' gradients by then (a step's first pass); ``accumulating`` a later
    micro-batch's gradients beside those already made."""

    alone: float
    making: float
    accumulating: float


@dataclass(frozen=True)
class Temporaries:
    """The most each of a partition's tasks holds beyond its activations, in bytes:
    ``F``'s, ``B``'s, the first partition's ``W`` (which starts from its graph; another's
    is ``backward``), ``I``'s (which frees nothing the forward pass saved), and a layer's
    new weight gradients at most (``gradients``: a later ``W``'s)."""

    forward: float
    backward: Peak
    weight: Peak
    input: float
    gradients: float


@dataclass(frozen=True)
class Messages:
    """What a partition receives and sends, in bytes: its input (``entry``; the first's,
    what it copies of the mini-batch), its output (``exit``), ``entry`` where the
    partition before is on its process, which holds it (``turned``; ``turned_through``
    where that is the layers' input itself), and how many skips ``F`` sends other workers
    (``skips_out``, a message each, of ``skips_out_bytes``) and ``B`` (or ``I``) sends
    back (``skips_back``, their gradients)."""

    entry: float
    exit: float
    turned: float
    turned_through: float
    skips_out: int
    skips_out_bytes: float
    skips_back: int
    skips_back_bytes: float


@dataclass(frozen=True)
class PartitionCosts:
    """A partition's costs at one micro-batch size, summed from its layers'."""

    times: Times
    activations: Activations
    temporaries: Temporaries
    messages: Messages


class Partitions:
    """The costs of each partition of a balance, for each micro-batch size, summed once."""

    def __init__(self, costs: Costs, balance: Sequence[int],
                 worker_of: Callable[[int], int] = lambda j: j) -> None:
        self.costs = costs
        self.bounds = [sum(balance[:j]) for j in range(len(balance) + 1)]
        self.worker_of = worker_of
        #: The partitions of each skip's two ends, the layers that stash and pop it.
        self.ends = [(self.partition_of(a), self.partition_of(b)) for a, b in costs.skips]
        self._sums: Dict[Tuple[int, int], PartitionCosts] = {}
        self._lent: Dict[Tuple[int, int], Tuple[Dict[int, float], Dict[int, float]]] = {}
        self._returned: Dict[Tuple[int, int], List[Tuple[int, float, bool]]] = {}

    def partition_of(self, layer: int) -> int:
        """The partition that holds ``layer``."""
        return bisect.bisect_right(self.bounds, layer) - 1

    def __call__(self, j: int, size: int) -> PartitionCosts:
        """Partition ``j``'s costs for a micro-batch of ``size``."""
        key = (j, size)
        if key not in self._sums:
            self._sums[key] = self._sum(j, self.costs.at(size), size)
        return self._sums[key]

    def _sum(self, j: int, layers: LayerCosts, size: int) -> PartitionCosts:
        start, stop = self.bounds[j], self.bounds[j + 1]
        if j == len(self.bounds) - 2 and self.costs.loss:
            stop += 1  # the loss, which the last partition computes
        forward, input = sum(layers.forward[start:stop]), sum(layers.input[start:stop])
        backward, kept = sum(layers.backward[start:stop]), sum(layers.kept[start:stop])
        # The pipeline holds the output and sent skips until B (or I).
        last = self.bounds[j + 1] - 1
        crossing = [s for s, (a, b) in enumerate(self.costs.skips) if start <= a < stop <= b]
        held = layers.unsaved[last]
        held += sum(layers.loose[s] for s in crossing)
        kept += held
        # A process of its own after this one got a copy: the output is the pipeline's.
        copied = 0.0
        if (self.costs.processes and j < len(self.bounds) - 2
                and self.worker_of(j + 1) != self.worker_of(j)):
            copied = layers.passed[last]
            held += copied
        backward_peak, weight_peak, holding, gradients = self._passes(j, layers, start, stop)
        entry = layers.output[start - 1] if start else self.costs.entry * size
        # On the process of the partition before, the input is that one's output itself.
        turned = bool(self.costs.processes and j and self.worker_of(j - 1) == self.worker_of(j))
        through = layers.through[self.bounds[j - 1]:start] if j else []
        # I lets go of the graph above the last layer with weights: no W starts there.
        top = self._top(start, stop)
        received, handed, up = self._popped(j, layers, start, stop, top)
        if j == 0:
            above = 0.0
        elif top >= start:
            # The layers after, what the next saved of its output, and the nodes
            # above the weights (a ReLU after a convolution); a copied output is ``held``.
            above = (sum(layers.kept[top + 1:stop])
                     + layers.shed[top] + (layers.passed[top] if top + 1 < stop else 0.0)
                     - (copied if top < last else 0.0) + up)
        else:
            above = kept - held + up
        # The first partition's I computes nothing: W starts from its outputs' gradients.
        # A later I keeps those at nodes leading to a weight and on its leaves until W.
        weight = sum(layers.weight[start:stop]) + (0.0 if j else input)
        if j == 0:
            retained = layers.output[stop - 1] if len(self.bounds) > 2 else 0.0
            retained += sum(layers.skipped[s] for s in crossing)
            input = 0.0
        else:
            apart = self.worker_of(j - 1) != self.worker_of(j)
            retained = (sum(layers.retained[start:stop]) + received - up
                        + (entry if apart else 0.0))
        out, back = self._skips_sent(j, layers, True), self._skips_sent(j, layers, False)
        return PartitionCosts(
            Times(forward, input, weight, backward),
            Activations(kept, held, received, handed, retained, above),
            Temporaries(self._forwarding(layers, start, stop, kept), backward_peak,
                        weight_peak, holding, gradients),
            Messages(entry, layers.output[self.bounds[j + 1] - 1],
                     entry if turned else 0.0,
                     entry if turned and through and all(through) else 0.0,
                     len(out), sum(nbytes for _, nbytes in out),
                     len(back), sum(nbytes for _, nbytes in back)))

    def sent(self, j: int, size: int, forward: bool) -> List[Tuple[int, float]]:
        """What partition ``j``'s forward pass (or backward pass) sends other workers, in its
        order: the partition each message goes to, and its bytes. ``F`` sends the skips it
        stashed, then its output; ``B`` (or ``I``) the gradients of those it popped, then its
        input's."""
        layers = self.costs.at(size)
        sent = self._skips_sent(j, layers, forward)
        to = j + 1 if forward else j - 1
        if 0 <= to < len(self.bounds) - 1 and self.worker_of(to) != self.worker_of(j):
            sent.append((to, layers.output[self.bounds[max(j, to)] - 1]))
        return sent

    def _skips_sent(self, j: int, layers: LayerCosts, forward: bool) -> List[Tuple[int, float]]:
        """The skips (or, backward, their gradients) partition ``j`` sends other workers, a
        message each: to which partition, and their bytes."""
        (near, far), mine = (0, 1) if forward else (1, 0), self.worker_of(j)
        return [(ends[far], layers.skipped[k]) for k, ends in enumerate(self.ends)
                if ends[near] == j != ends[far] and self.worker_of(ends[far]) != mine]

    def _top(self, start: int, stop: int) -> int:
        """The last layer with weights from ``start`` to ``stop`` (``start - 1`` if none)."""
        parameters = self.costs.parameters
        return next((k for k in reversed(range(start, min(stop, len(parameters))))
                     if parameters[k]), start - 1)

    def lent(self, j: int, size: int) -> Tuple[Dict[int, float], Dict[int, float]]:
        """What partition ``j`` hands later partitions of its own process as it is, by
        partition: what they hold past ``j``'s ``I`` until their ``W`` (or ``B``), and
        what a checkpointed ``F`` of ``j`` makes for them (its output, unless it is its
        input; the skips they pop)."""
        if not self.costs.processes:
            return {}, {}
        if (j, size) not in self._lent:
            layers, lent, made = self.costs.at(size), {}, {}
            start, stop = self.bounds[j], self.bounds[j + 1]
            last = stop - 1
            if j + 2 < len(self.bounds) and self.worker_of(j + 1) == self.worker_of(j):
                unsaved = layers.unsaved[last]
                # What I lets go of (``above``; nothing in the first partition).
                top = self._top(start, stop)
                above = (0.0 if j == 0 else layers.kept[last] if top < last
                         else layers.shed[last])
                lent[j + 1] = unsaved + min(layers.output[last] - unsaved, above)
                through = layers.through[start:stop]
                made[j + 1] = 0.0 if through and all(through) else layers.output[last]
            for (a, b), (_, k), loose, nbytes, saved in zip(
                    self.costs.skips, self.ends, layers.loose, layers.skipped, layers.reused):
                if start <= a < stop <= b and self.worker_of(k) == self.worker_of(j):
                    made[k] = made.get(k, 0.0) + nbytes - saved
                    if b <= self._top(self.bounds[k], self.bounds[k + 1]):
                        lent[k] = lent.get(k, 0.0) + loose
            self._lent[j, size] = lent, made
        return self._lent[j, size]

    def returned(self, j: int, size: int) -> List[Tuple[int, float, bool]]:
        """The gradients partition ``j``'s backward pass hands back as they are to earlier
        partitions of its process: to which, their bytes, and whether ``j``'s leaf keeps
        them until its ``W`` (its input's)."""
        if not self.costs.processes or j == 0:
            return []
        if (j, size) not in self._returned:
            layers, mine = self.costs.at(size), self.worker_of(j)
            back = ([(j - 1, layers.output[self.bounds[j] - 1], True)]
                    if j > 1 and self.worker_of(j - 1) == mine else [])
            back += [(source, nbytes, False)
                     for (source, sink), nbytes in zip(self.ends, layers.skipped)
                     if source < j == sink and self.worker_of(source) == mine]
            self._returned[j, size] = back
        return self._returned[j, size]

    def _passes(self, j: int, layers: LayerCosts, start: int, stop: int
                ) -> Tuple[Peak, Peak, float, float]:
        """The peaks of partition ``j``'s backward pass and of its ``W`` (layers ``start`` to
        ``stop``), what its ``I`` holds, and a layer's new weight gradients at most
        (:class:`Temporaries`)."""
        # The last layer's output gradient is the pipeline's, held (``closing``); a
        # skip's gradient lives from its pop's backward pass to its stash's.
        working = layers.working[start:stop]
        working[-1] = layers.closing[stop - 1]
        # A skip a later partition pops: its gradient is the pipeline's too.
        for a, b in self.costs.skips:
            if start <= a < stop <= b:
                working[a - start] = max(working[a - start], layers.closing[a])
        # (A gradient the pop gives its output and the skip alike is one in B.)
        alone = list(working)
        for (a, b), nbytes, alias in zip(self.costs.skips, layers.skipped, layers.aliased):
            if start <= a < stop or start <= b < stop:
                for k in range(max(a + 1, start), min(b, stop)):
                    working[k - start] += nbytes
                    alone[k - start] += nbytes - (alias if k == b - 1 < stop - 1 else 0.0)
        passed_in = self._passed_in(j, layers, start, len(working))
        working = [w + h for w, h in zip(working, passed_in)]
        alone = [w + h for w, h in zip(alone, passed_in)]
        accumulating = layers.accumulating[start:stop]
        accumulating[-1] = layers.accumulating_last[stop - 1]
        # (A layer's output that only the next layer saved is gone by its turn.)
        passed = layers.passed[start:stop - 1] + [0.0]
        # The step's first pass makes the weights' gradients as it goes.
        making = self._made_by(start, stop)
        frees = layers.kept[start:stop]

        def peak() -> Peak:
            return Peak(*(_most(alone, extra, frees, passed)
                          for extra in ([0.0] * len(alone), making, accumulating)))
        # The first partition's W starts from the graph, not from its output.
        weight = peak() if j == 0 else None
        # The pipeline holds the output until B returns: the last layer frees none of it.
        if j < len(self.bounds) - 2:
            own = layers.output[stop - 1] - layers.unsaved[stop - 1]
            frees[-1] -= min(frees[-1], max(0.0, own))
        backward = peak()
        # I frees nothing on its way: W needs the graph and the gradients left for it.
        kept_for_w = layers.retained[start:stop]
        if j < len(self.bounds) - 2:
            # Less the output's gradient itself, which the pipeline holds already.
            kept_for_w[-1] -= layers.given[stop - 1]
        # What I keeps that a layer's B frees once used: its ``holding`` beyond B's peak.
        b_peaks = layers.working[start:stop]
        b_peaks[-1] = layers.closing[stop - 1]
        keeps = [max(0.0, i - b) for i, b in zip(layers.holding[start:stop], b_peaks)]
        holding = max((most + more + sum(kept_for_w[k + 1:])
                       for k, (most, more) in enumerate(zip(working, keeps))), default=0.0)
        if not any(self.costs.parameters[start:stop]):
            holding = backward.alone  # no W to keep the graph for: I frees it as B does
        return (backward, backward if weight is None else weight, holding,
                max(accumulating, default=0.0))

    def _forwarding(self, layers: LayerCosts, start: int, stop: int, kept: float) -> float:
        """The most the forward pass of layers ``start`` to ``stop`` holds at once beyond
        ``kept``: at each layer, what is kept before it, the live skips, and all it makes."""
        most = before = 0.0
        for k in range(start, stop):
            alive = layers.unsaved[k - 1] if k > start else 0.0
            alive += sum(nbytes for (a, b), nbytes in zip(self.costs.skips, layers.loose)
                         if start <= a <= k <= b)
            own = layers.kept[k] + layers.unsaved[k]
            most = max(most, before + alive + own + layers.forwarding[k])
            before += layers.kept[k]
        return max(0.0, most - kept)

    def _popped(self, j: int, layers: LayerCosts, start: int, stop: int, top: int
                ) -> Tuple[float, float, float]:
        """The bytes of the skips partition ``j`` pops that an earlier one stashed: received
        from another worker, handed over on its own, and those received for a layer
        after ``top`` (which ``I`` lets go of)."""
        received = handed = up = 0.0
        for (a, b), (source, _), nbytes, saved in zip(self.costs.skips, self.ends,
                                                      layers.skipped, layers.reused):
            if a < start <= b < stop:
                # (What the popping layer saves, its ``kept`` counts.)
                if self.worker_of(source) == self.worker_of(j):
                    handed += nbytes - saved
                else:
                    received += nbytes - saved
                    up += nbytes - saved if b > top else 0.0
        return received, handed, up

    def _passed_in(self, j: int, layers: LayerCosts, start: int, count: int) -> List[float]:
        """What the gradients the pipeline passes partition ``j``'s backward pass add beside
        each of its ``count`` layers: the output's beside every layer but the last
        (``closing`` counts it), a sent skip's beside the layers before its stash."""
        stop = self.bounds[j + 1]
        added = [0.0] * count
        if j < len(self.bounds) - 2:
            added[:-1] = [layers.output[stop - 1]] * (count - 1)
        for (a, b), nbytes in zip(self.costs.skips, layers.skipped):
            if start <= a < stop <= b:
                for k in range(start, a):
                    added[k - start] += nbytes
        return added

    def parameters(self, js: Iterable[int]) -> float:
        """The bytes of the weights of partitions ``js``, a tied weight once."""
        return self._distinct([k for j in js for k in range(self.bounds[j], self.bounds[j + 1])])

    def gradients(self, js: Iterable[int]) -> float:
        """The bytes of the weights' gradients partitions ``js`` (of one worker) make: a
        tied weight has one per partition."""
        return sum(self.parameters([j]) for j in js)

    def _made_by(self, start: int, stop: int) -> List[float]:
        """For each layer from ``start`` to ``stop``, the bytes of the weight gradients of
        the layers from it on (a tied weight once)."""
        made, total, seen = [0.0] * (stop - start), 0.0, set()
        for k in reversed(range(start, stop)):
            total += self.costs.parameters[k] if k < len(self.costs.parameters) else 0.0
            for tie, (holders, nbytes) in enumerate(self.costs.shared):
                if k in holders:
                    total -= nbytes if tie in seen else 0.0
                    seen.add(tie)
            made[k - start] = total
        return made

    def _distinct(self, layers: Sequence[int]) -> float:
        """The bytes of the weights of ``layers``, a tied weight once."""
        nbytes = float(sum(self.costs.parameters[k] for k in layers
                           if k < len(self.costs.parameters)))
        for holders, shared in self.costs.shared:
            nbytes -= max(0, len(set(holders) & set(layers)) - 1) * shared
        return nbytes


def _most(alone: Sequence[float], besides: Sequence[float], frees: Sequence[float],
          passed: Sequence[float]) -> float:
    """The most a backward pass through layers holds at once beyond what their forward
    passes kept, last first: each layer's own, less what the layers after it freed."""
    most = freed = 0.0
    for own, extra, kept, gone in reversed(list(zip(alone, besides, frees, passed))):
        most = max(most, own + extra - freed - gone)
        freed += kept
    return most
