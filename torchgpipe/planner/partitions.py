"""A partition's costs, summed from its layers' at a micro-batch size: the times of its
actions, and the bytes the planner's walk of a worker's memory takes at each action
(:func:`~torchgpipe.planner.predict.peak_memory`).

Within a partition the layers' backward passes run one after another, last
first, each freeing the activations it used; so the most a partition's
backward pass holds is the most any layer's does beyond what the layers
after it have freed by then. Between partitions, the pipeline holds what it
hands over (a partition's output, its skips) until the backward pass that
needs it, and the gradients it passes a backward pass until that pass
returns.
"""
import bisect
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from torchgpipe.planner.costs import Costs, LayerCosts

__all__: List[str] = []


class Partitions:
    """The costs of each partition of a balance, for each micro-batch size, summed once."""

    def __init__(self, costs: Costs, balance: Sequence[int],
                 worker_of: Callable[[int], int] = lambda j: j) -> None:
        self.costs = costs
        self.bounds = [sum(balance[:j]) for j in range(len(balance) + 1)]
        self.worker_of = worker_of
        #: The partitions of each skip's two ends, the layers that stash and pop it.
        self.ends = [(self.partition_of(a), self.partition_of(b)) for a, b in costs.skips]
        self._sums: Dict[Tuple[int, int], Dict[str, float]] = {}
        self._lent: Dict[Tuple[int, int], Tuple[Dict[int, float], Dict[int, float]]] = {}
        self._returned: Dict[Tuple[int, int], List[Tuple[int, float, bool]]] = {}

    def partition_of(self, layer: int) -> int:
        """The partition that holds ``layer``."""
        return bisect.bisect_right(self.bounds, layer) - 1

    def __call__(self, j: int, size: int) -> Dict[str, float]:
        """Partition ``j``'s times and bytes for a micro-batch of ``size``.

        Keys: ``forward``, ``input``, ``weight``, ``backward`` and ``kept``
        (its layers' sums, the loss's with the last partition's; ``weight``,
        of the first partition, whose ``I`` has nothing to compute, is its
        whole backward pass);
        ``working`` (the most its backward pass holds beyond ``kept``),
        ``making`` (the same, with the weights' gradients the pass has made by
        then, in the step's first pass) and ``accumulating`` (the same, for a
        micro-batch after the first: with its weights' new gradients, until
        added to those kept); of the first partition, ``working_w``,
        ``making_w`` and ``accumulating_w`` too, for its ``W`` (which starts
        from the graph, not from its output);
        ``gradients`` (a layer's new weight gradients at most), ``held`` (the
        bytes of its output and of the skips it sends in ``kept`` only
        because the pipeline holds them, until ``B`` or ``I``),
        ``retained`` (the gradients kept from ``I`` to ``W``), ``holding``
        (the most ``I`` holds beyond ``kept``: it frees nothing on its way,
        and keeps what it leaves for ``W``), ``above`` (the bytes ``I`` lets
        go of once done, beside ``held``: what the layers after its last
        with weights keep, and what that layer's nodes above its weights
        saved; all it keeps if it has no weights; and the skips received for
        layers up there),
        ``received`` and ``handed`` (the skips it pops that a partition
        before it stashed, on another worker or on its own),
        ``entry`` (the bytes of its input) and ``exit`` (of its output),
        ``skips_out`` and ``skips_out_bytes`` (how many skips it stashes that a
        partition on another worker pops, a message each in ``F``, and their
        bytes), ``skips_back`` and ``skips_back_bytes`` (of those it pops that one
        on another worker stashed, whose gradients it sends back),
        ``turned`` (of its input, where the partition before runs in the
        same process and holds it: counted there) and ``turned_through``
        (the same, where that partition's output is its own input, which it
        keeps checkpointed too),
        ``forwarding`` (the most its forward pass holds beyond ``kept``).
        """
        key = (j, size)
        if key not in self._sums:
            self._sums[key] = self._sum(j, self.costs.at(size), size)
        return self._sums[key]

    def _sum(self, j: int, layers: LayerCosts, size: int) -> Dict[str, float]:
        start, stop = self.bounds[j], self.bounds[j + 1]
        if j == len(self.bounds) - 2 and self.costs.loss:
            stop += 1  # the loss, which the last partition computes
        sums = {name: sum(getattr(layers, name)[start:stop])
                for name in ('forward', 'input', 'backward', 'kept')}
        # The pipeline holds a partition's output until its backward pass (or
        # I), whether or not the layer after it saves it; and so a skip it
        # stashed that a later partition pops (one popped here is gone then).
        last = self.bounds[j + 1] - 1
        sent = [s for s, (a, b) in enumerate(self.costs.skips) if start <= a < stop <= b]
        sums['held'] = layers.unsaved[last] if last < len(layers.unsaved) else 0.0
        sums['held'] += sum(layers.loose[s] for s in sent if s < len(layers.loose))
        sums['kept'] += sums['held']
        # Saved by the next layer, the output is the pipeline's alone all the
        # same where that layer's partition is a process of its own: it got a copy.
        copied = 0.0
        if (self.costs.processes and j < len(self.bounds) - 2
                and self.worker_of(j + 1) != self.worker_of(j) and last < len(layers.passed)):
            copied = layers.passed[last]
            sums['held'] += copied
        sums.update(self._passes(j, layers, start, stop))
        sums['forwarding'] = self._forwarding(layers, start, stop, sums['kept'])
        sums['entry'] = layers.output[start - 1] if start else self.costs.entry * size
        # A process running the partition before too hands its output over as
        # it is: one tensor, which that partition holds (``turned``); if it
        # checkpointed the micro-batch, only where the output is its input,
        # which it keeps then (``turned_through``).
        turned = bool(self.costs.processes and j and self.worker_of(j - 1) == self.worker_of(j))
        through = layers.through[self.bounds[j - 1]:start] if j else []
        sums['turned'] = sums['entry'] if turned else 0.0
        sums['turned_through'] = sums['entry'] if turned and through and all(through) else 0.0
        sums['exit'] = layers.output[self.bounds[j + 1] - 1]
        sums.update(self._messages(j, layers))
        # I lets go of the graph above the layers with weights (a loss, the
        # activations after the last linear layer): no W starts there; of a
        # partition without weights, of all of it (W has nothing to do).
        top = self._top(start, stop)
        # (A skip received for a layer up there goes with it, and its gradient.)
        sums['received'], sums['handed'], up = self._popped(j, layers, start, stop, top)
        if j == 0:
            sums['above'] = 0.0
        elif top >= start:
            # Above where W starts: the layers after the last with weights, the
            # output that the next of them saved, and what the nodes of that
            # layer above its weights saved (a ReLU after its convolution).
            # (The copied output, in the last layer's ``kept``, is ``held`` already.)
            sums['above'] = (sum(layers.kept[top + 1:stop])
                             + (layers.shed[top] if top < len(layers.shed) else 0.0)
                             + (layers.passed[top] if top + 1 < stop and layers.passed else 0.0)
                             - (copied if top < last else 0.0) + up)
        else:
            sums['above'] = sums['kept'] - sums['held'] + up
        # The first partition's I computes nothing (no input gradient): W
        # starts from its outputs (and sent skips), and keeps their gradients
        # until then. A later one's I keeps the gradients that reached its
        # layers' nodes leading to a weight, where W starts, and those of its
        # input and popped skips, on their leaves, until W lets the pass go:
        # copies of those another worker received, the same tensors on this one.
        # (W's time: of the first partition, its whole backward pass.)
        measured = sum(layers.weight[start:stop]) + (0.0 if j else sums['input'])
        if j == 0:
            sums['retained'] = layers.output[stop - 1] if len(self.bounds) > 2 else 0.0
            sums['retained'] += sum(layers.skipped[s] for s in sent
                                    if s < len(layers.skipped))
            sums['input'] = 0.0
        else:
            apart = self.worker_of(j - 1) != self.worker_of(j)
            sums['retained'] = (sum(layers.retained[start:stop]) + sums['received'] - up
                                + (sums['entry'] if apart else 0.0))
        sums['weight'] = (measured if layers.weight
                          else max(0.0, sums['backward'] - sums['input']))
        return sums

    def _messages(self, j: int, layers: LayerCosts) -> Dict[str, float]:
        """The skips partition ``j`` sends to or takes from another worker, a message of
        its own each: ``F`` sends those it stashed, ``B`` (or ``I``) the gradients
        of those it popped (the keys ``skips_out``... of :meth:`__call__`)."""
        mine, sums = self.worker_of(j), {}
        for name, near, far in (('skips_out', 0, 1), ('skips_back', 1, 0)):
            skips = [k for k, ends in enumerate(self.ends)
                     if ends[near] == j != ends[far] and self.worker_of(ends[far]) != mine]
            sums[name] = float(len(skips))
            sums[name + '_bytes'] = sum(layers.skipped[k] for k in skips
                                        if k < len(layers.skipped))
        return sums

    def _top(self, start: int, stop: int) -> int:
        """The last layer with weights from ``start`` to ``stop`` (``start - 1`` if none)."""
        parameters = self.costs.parameters
        return next((k for k in reversed(range(start, min(stop, len(parameters))))
                     if parameters[k]), start - 1)

    def lent(self, j: int, size: int) -> Tuple[Dict[int, float], Dict[int, float]]:
        """What partition ``j`` hands a later partition of the same process as it is,
        by that partition, for a micro-batch of ``size`` (across processes; within
        one, each gets a copy):

        - what its ``I`` lets go of that the later one holds on until its ``W``
          (or ``B``): its output to the next, where the pipeline held it or
          what its ``I`` lets go of (``above``) holds it, and the skips it
          stashed that the later one pops below where that one's ``W`` starts;
        - what it makes for the later one in a checkpointed forward pass, which
          keeps nothing of its own: its output to the next, unless that is its
          input, and the skips it stashed that the later one pops.
        """
        if not self.costs.processes:
            return {}, {}
        if (j, size) not in self._lent:
            layers, lent, made = self.costs.at(size), {}, {}
            start, stop = self.bounds[j], self.bounds[j + 1]
            last = stop - 1
            if j + 2 < len(self.bounds) and self.worker_of(j + 1) == self.worker_of(j):
                unsaved = layers.unsaved[last] if layers.unsaved else 0.0
                # (Above the last layer with weights, all it keeps goes at I;
                # of that layer, what its nodes above its weights saved. The
                # first partition's I lets go of nothing it keeps.)
                top = self._top(start, stop)
                above = (0.0 if j == 0 else layers.kept[last] if top < last
                         else layers.shed[last] if layers.shed else 0.0)
                lent[j + 1] = unsaved + min(layers.output[last] - unsaved, above)
                through = layers.through[start:stop]
                made[j + 1] = 0.0 if through and all(through) else layers.output[last]
            reused = layers.reused or [0.0] * len(layers.loose)
            for (a, b), (_, k), loose, nbytes, saved in zip(
                    self.costs.skips, self.ends, layers.loose, layers.skipped, reused):
                if start <= a < stop <= b and self.worker_of(k) == self.worker_of(j):
                    made[k] = made.get(k, 0.0) + nbytes - saved
                    if b <= self._top(self.bounds[k], self.bounds[k + 1]):
                        lent[k] = lent.get(k, 0.0) + loose
            self._lent[j, size] = lent, made
        return self._lent[j, size]

    def returned(self, j: int, size: int) -> List[Tuple[int, float, bool]]:
        """The gradients partition ``j``'s backward pass hands back as they are to an
        earlier partition of the same process, for a micro-batch of ``size``: to which,
        their bytes, and whether ``j``'s leaf keeps them until its ``W`` (its input's;
        not to the first partition, whose ``W``, its whole backward pass, counts its
        output's gradient from its ``I``)."""
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
                ) -> Dict[str, float]:
        """The most partition ``j``'s backward passes hold beyond ``kept``, layers ``start``
        to ``stop`` (its loss's too): the keys ``working``, ``accumulating``,
        ``making``, ``holding`` and ``gradients`` of :meth:`__call__`, and for the
        first partition those of ``working``, ``accumulating`` and ``making`` for
        its ``W`` (``working_w``...)."""
        # The layers' backward passes run one after another, last first, each
        # freeing the activations it used: the most any holds beyond what the
        # layers after it have freed by then; for a later micro-batch, with
        # its new weight gradients (``W`` holds those alone). The last layer's
        # output gradient is the pipeline's, held (``closing``); the others'
        # come from the pass itself. A skip's gradient lives from the backward
        # pass of the layer that pops it (or the start of this one's, if a
        # later partition does) to that of the layer that stashed it (or its
        # end, if an earlier one did), on the workers of those two partitions
        # (not of those it passes over).
        working = layers.working[start:stop]
        if layers.closing and stop - 1 < len(layers.closing):
            working[-1] = layers.closing[stop - 1]
            # A layer stashing a skip a later partition pops gets the skip's
            # gradient from the pipeline, held until the pass returns, as the
            # last layer gets its output's (which a stashing layer returning its
            # input, a shortcut, passes on as its input's: held too).
            for a, b in self.costs.skips:
                if start <= a < stop <= b:
                    working[a - start] = max(working[a - start], layers.closing[a])
        # (A gradient the pop gives its output and the skip alike, as an addition
        # does, is the layer before's own in B; I, keeping all, holds both.)
        aliased = layers.aliased or [0.0] * len(layers.skipped)
        alone = list(working)
        for (a, b), nbytes, alias in zip(self.costs.skips, layers.skipped, aliased):
            if start <= a < stop or start <= b < stop:
                for k in range(max(a + 1, start), min(b, stop)):
                    working[k - start] += nbytes
                    alone[k - start] += nbytes - (alias if k == b - 1 < stop - 1 else 0.0)
        passed_in = self._passed_in(j, layers, start, len(working))
        working = [w + h for w, h in zip(working, passed_in)]
        alone = [w + h for w, h in zip(alone, passed_in)]
        accumulating = layers.accumulating[start:stop] or [0.0] * len(working)
        if layers.accumulating_last and layers.closing and stop - 1 < len(layers.closing):
            accumulating[-1] = layers.accumulating_last[stop - 1]
        # (A layer's output that only the next layer saved is gone by its turn.)
        passed = layers.passed[start:stop - 1] + [0.0] if layers.passed else [0.0] * len(working)
        # The step's first pass makes the weights' gradients as it goes: by a
        # layer's turn, those of the layers after it, and its own.
        besides = {'working': [0.0] * len(alone), 'accumulating': accumulating,
                   'making': self._made_by(start, stop)}
        frees = layers.kept[start:stop]
        # The first partition's W starts from the graph, not from its output.
        sums = {name + '_w': _most(alone, extra, frees, passed)
                for name, extra in besides.items()} if j == 0 else {}
        # B starts from the output, which the pipeline holds until B returns:
        # the last layer's pass frees none of it, whoever saved it (the layer
        # itself, a ReLU; the next one).
        if j < len(self.bounds) - 2 and layers.unsaved:
            own = layers.output[stop - 1] - layers.unsaved[stop - 1]
            frees[-1] -= min(frees[-1], max(0.0, own))
        sums.update({name: _most(alone, extra, frees, passed) for name, extra in besides.items()})
        # I frees nothing on its way: W needs the graph as it is, and the
        # gradients left for it by the layers after each.
        kept_for_w = layers.retained[start:stop] or [0.0] * len(working)
        if j < len(self.bounds) - 2 and kept_for_w:
            # What the last layer leaves W may be the output's gradient itself,
            # which the pipeline holds beside the layers before already.
            kept_for_w[-1] -= (layers.given[stop - 1] if layers.given
                               else min(kept_for_w[-1], layers.output[stop - 1]))
        # (What a layer's own pass frees once used and I keeps: its ``holding``,
        # beyond its B's; the last layer's B as the last, its output held.)
        b_peaks = layers.working[start:stop]
        if layers.closing and stop - 1 < len(layers.closing):
            b_peaks[-1] = layers.closing[stop - 1]
        keeps = ([max(0.0, i - b) for i, b in zip(layers.holding[start:stop], b_peaks)]
                 if layers.holding else [0.0] * len(working))
        holding = max((most + more + sum(kept_for_w[k + 1:])
                       for k, (most, more) in enumerate(zip(working, keeps))), default=0.0)
        if not any(self.costs.parameters[start:stop]):
            holding = sums['working']  # no W to keep the graph for: I frees it as B does
        return {**sums, 'holding': holding, 'gradients': max(accumulating, default=0.0)}

    def _forwarding(self, layers: LayerCosts, start: int, stop: int, kept: float) -> float:
        """The most the forward pass of layers ``start`` to ``stop`` holds at once beyond
        ``kept``, what it leaves: at each layer, what the layers before keep, its input
        if none of them keeps it, the skips stashed by then that it or a later layer
        pops, and all it makes (what it leaves and its temporaries)."""
        if not layers.forwarding:
            return 0.0
        loose = layers.loose or [0.0] * len(self.costs.skips)
        most = before = 0.0
        for k in range(start, stop):
            alive = layers.unsaved[k - 1] if k > start and layers.unsaved else 0.0
            alive += sum(nbytes for (a, b), nbytes in zip(self.costs.skips, loose)
                         if start <= a <= k <= b)
            own = layers.kept[k] + (layers.unsaved[k] if layers.unsaved else 0.0)
            most = max(most, before + alive + own + layers.forwarding[k])
            before += layers.kept[k]
        return max(0.0, most - kept)

    def _popped(self, j: int, layers: LayerCosts, start: int, stop: int, top: int
                ) -> Tuple[float, float, float]:
        """The bytes of the skips partition ``j`` (layers ``start`` to ``stop``) pops that
        an earlier partition stashed: on another worker (received, a copy), and on its
        own (handed over as they are); and of those received for a layer after ``top``
        (the last with weights), which ``I`` lets go of with their gradients."""
        received = handed = up = 0.0
        reused = layers.reused or [0.0] * len(layers.skipped)
        for (a, b), (source, _), nbytes, saved in zip(self.costs.skips, self.ends,
                                                      layers.skipped, reused):
            if a < start <= b < stop:
                # (What the popping layer saves, its ``kept`` counts.)
                if self.worker_of(source) == self.worker_of(j):
                    handed += nbytes - saved
                else:
                    received += nbytes - saved
                    up += nbytes - saved if b > top else 0.0
        return received, handed, up

    def _passed_in(self, j: int, layers: LayerCosts, start: int, count: int) -> List[float]:
        """What the gradients the pipeline passes partition ``j``'s backward pass add
        beside each of its ``count`` layers' (from ``start``).

        It passes those of the partition's output and of the skips it sent on
        (``torch.autograd.backward(tensors, grads)``) and holds them until the
        pass returns, after the layers that used them: the output's beside
        every layer but the last (whose ``closing`` counts it), a skip's beside
        the layers before the one that stashed it (whose own pass counts it as
        it uses it).
        """
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
        """The bytes of the weights of partitions ``js``, a weight several of their layers
        hold (a tied one) counted once."""
        return self._distinct([k for j in js for k in range(self.bounds[j], self.bounds[j + 1])])

    def gradients(self, js: Iterable[int]) -> float:
        """The bytes of the weights' gradients partitions ``js`` (of one worker) make.

        A tied weight has a gradient per partition, in one process as across
        processes (the first partition's, and each later one's share, which
        the step sums as it ends: see ``torchgpipe.foundation.tied``).
        """
        return sum(self.parameters([j]) for j in js)

    def _made_by(self, start: int, stop: int) -> List[float]:
        """For each layer from ``start`` to ``stop``, the bytes of the gradients of the
        weights of the layers from it on (a weight several of them hold, once)."""
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
        """The bytes of the weights of ``layers``, a weight several of them hold once."""
        nbytes = float(sum(self.costs.parameters[k] for k in layers
                           if k < len(self.costs.parameters)))
        for holders, shared in self.costs.shared:
            nbytes -= max(0, len(set(holders) & set(layers)) - 1) * shared
        return nbytes


def _most(alone: Sequence[float], besides: Sequence[float], frees: Sequence[float],
          passed: Sequence[float]) -> float:
    """The most a backward pass through layers holds at once beyond what their forward
    passes kept: each layer's own (``alone``, ``besides`` it), less what the layers
    after it ``frees`` and what it ``passed`` on (gone by its turn), last first."""
    most = freed = 0.0
    for own, extra, kept, gone in reversed(list(zip(alone, besides, frees, passed))):
        most = max(most, own + extra - freed - gone)
        freed += kept
    return most
