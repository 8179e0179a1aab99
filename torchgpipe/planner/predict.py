"""A configuration's step time and peak memory per worker, from measured costs.

The time is the simulator's over the schedule's action lists, each action
costing its partition's layers at its micro-batch size, the overhead per
task, and a message to another worker::

    F   forward of the partition's layers                   (+ message to j+1)
    B   backward, after the forward again if checkpointed   (+ message to j-1)
    I   input gradients (after the same recomputation)      (+ message to j-1)
    W   the weights' gradients, after I (the first partition's: its whole B)

The memory walks each worker's actions (:func:`peak_memory`) through the
bytes of :class:`~torchgpipe.planner.partitions.Partitions`, counting once
what partitions of one process share (:mod:`~torchgpipe.planner.sharing`).

Partitions sharded over ``shards`` data-parallel ranks (FSDP2, gathered
through the step) keep a shard of their parameters and optimizer states
between steps, and during one the whole parameters and gradients beside
them; each partition's first ``F`` gathers its parameters first, and its
last ``B`` or ``W`` reduce-scatters its gradients after.
"""
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Sequence, Set, Tuple

from torchgpipe.engine.generators import named, worker_of
from torchgpipe.engine.schedule import Action, Kind, Schedule
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.planner.costs import Costs
from torchgpipe.planner.partitions import Partitions
from torchgpipe.planner.sharing import SharedBytes

__all__: List[str] = []

#: Actions' times in whole nanoseconds: the simulator adds exact integers.
NANOSECONDS = 1_000_000_000


@dataclass(frozen=True)
class Candidate:
    """A configuration the planner predicts: a built-in ``schedule``, the ``balance``, the
    micro-batches (as many as the mini-batch splits into), the checkpoint mode, the
    ``workers`` (devices or ranks) and the ``placement`` of the partitions on them."""

    schedule: str
    balance: Tuple[int, ...]
    chunks: int
    checkpoint: str
    workers: int
    placement: str = 'loop'

    def worker_of(self, j: int) -> int:
        """The worker that runs partition ``j``."""
        return worker_of(j, len(self.balance), self.workers, self.placement)

    def plan(self, micro_batches: int) -> Schedule:
        """The schedule's action lists, for the micro-batches the chunks really make."""
        return named(self.schedule, micro_batches, len(self.balance), self.workers)


@dataclass
class Prediction:
    """What a configuration is predicted to cost: the ``step``'s seconds, each worker's
    peak ``memory`` in bytes, its seconds at work by kind of task (``busy``, as a trace
    sees it: longer where workers share the cores), and when each action ``ends``."""

    step: float
    memory: List[float]
    busy: List[Dict[str, float]]
    ends: Dict[Action, float]


def micro_batches(batch: int, chunks: int) -> List[int]:
    """The sizes of the micro-batches a mini-batch of ``batch`` splits into (as torch.chunk)."""
    size = math.ceil(batch / chunks)
    count = math.ceil(batch / size)
    return [size] * (count - 1) + [batch - size * (count - 1)]


def predict(costs: Costs, candidate: Candidate, *, param_scale: float = 2.0,
            shards: int = 1) -> Prediction:
    """The step time and each worker's peak memory of ``candidate`` by ``costs``, training
    keeping ``param_scale`` parameter-sized tensors per parameter (as
    :func:`~torchgpipe.balance.balance_by_size` counts), sharded over ``shards`` ranks;
    ``ValueError`` if the schedule cannot run it."""
    sizes = micro_batches(costs.batch, candidate.chunks)
    schedule = candidate.plan(len(sizes))
    parts = Partitions(costs, candidate.balance, candidate.worker_of)
    checkpointed = checkpoints(candidate.checkpoint, len(sizes))
    n = len(candidate.balance)
    collectives = sharded_collectives(schedule, costs, parts, shards)

    def seconds(action: Action) -> Tuple[float, Dict[str, float]]:
        """The action's time, and its work by kind of task."""
        part = parts(action.j, sizes[action.i])
        times, messages = part.times, part.messages
        split = action.kind in (Kind.I, Kind.W)
        overhead = costs.split_overhead if split else costs.overhead
        if action.kind is Kind.F:
            work, sent, to = {'forward': times.forward}, messages.exit, action.j + 1
            skips = messages.skips_out, messages.skips_out_bytes
        elif action.kind is Kind.W:
            work, sent, to, skips = {'weight': times.weight}, 0.0, action.j, (0, 0.0)
        else:
            work = ({'backward': times.backward} if action.kind is Kind.B
                    else {'input': times.input})
            sent, to = messages.entry, action.j - 1
            skips = messages.skips_back, messages.skips_back_bytes
            if checkpointed[action.i]:
                work['recompute'] = times.forward
                overhead += costs.checkpoint_overhead
        latency, per_byte = costs.transfer
        crosses = 0 <= to < n and candidate.worker_of(to) != candidate.worker_of(action.j)
        message = latency + per_byte * sent if crosses else 0.0
        # A message of its own for each skip to or from another worker.
        message += skips[0] * (latency + costs.skip_overhead) + per_byte * skips[1]
        return sum(work.values()) + overhead + message + collectives.get(action, 0.0), work

    cost: Dict[Action, Fraction] = {}
    works: Dict[Action, Dict[str, float]] = {}
    for actions in schedule.workers:
        for action in actions:
            total, works[action] = seconds(action)
            cost[action] = Fraction(round(total * NANOSECONDS))
    # The engine recomputes before it waits for the gradient.
    ahead = {action: Fraction(round(work.get('recompute', 0.0) * NANOSECONDS))
             for action, work in works.items()}
    times = simulate_sharing(schedule.workers, n, cost.__getitem__, costs.cores,
                             ahead.__getitem__)
    busy: List[Dict[str, float]] = [{} for _ in range(candidate.workers)]
    for action, work in works.items():
        # Cores shared stretch an action's work as a trace would see it.
        start, end = times[action]
        stretch = float((end - start) / cost[action]) if cost[action] else 1.0
        into = busy[candidate.worker_of(action.j)]
        for kind, time in work.items():
            into[kind] = into.get(kind, 0.0) + time * stretch
    ends = {action: float(end) / NANOSECONDS for action, (_, end) in times.items()}
    step = max(ends.values(), default=0.0)
    # The weights' gradients are made in the step (zero_grad leaves None).
    made = gradient_share(param_scale)
    memory = []
    for w in range(candidate.workers):
        mine = [j for j in range(n) if candidate.worker_of(j) == w]
        gradients = parts.gradients(mine)
        grads = made * gradients
        # Parameters, optimizer state, gradients (a tied weight's share always); sharded,
        # a shard of the first two, and the whole parameters gathered for the step.
        parameters = parts.parameters(mine)
        static = (param_scale - 1) * parameters / shards + gradients + \
            (parameters if shards > 1 else 0.0)
        memory.append(max(peak_memory(schedule.workers, w, parts, sizes, checkpointed, made),
                          grads + exchange_memory(parts, candidate, w)) + static - grads)
    return Prediction(step=step, memory=memory, busy=busy, ends=ends)


def sharded_collectives(schedule: Schedule, costs: Costs, parts: Partitions,
                        shards: int) -> Dict[Action, float]:
    """The seconds the actions of partitions sharded over ``shards`` ranks add: an
    all-gather of the parameters before each partition's first ``F``, a reduce-scatter of
    its gradients after its last ``B`` or ``W`` (each a ring: ``shards - 1`` messages of a
    shard, at the cost of a message between workers, whose latency the per-task overhead
    holds across processes: a collective's is left out)."""
    if shards < 2:
        return {}
    latency, per_byte = costs.transfer
    added: Dict[Action, float] = {}
    for actions in schedule.workers:
        for j in {a.j for a in actions}:
            mine = [a for a in actions if a.j == j]
            first = next(a for a in mine if a.kind is Kind.F)
            last = [a for a in mine if a.kind in (Kind.B, Kind.W)][-1]
            for action, moved in ((first, parts.parameters([j])), (last, parts.gradients([j]))):
                added[action] = added.get(action, 0.0) + \
                    (shards - 1) * (latency + per_byte * moved / shards)
    return added


def checkpoints(mode: str, m: int) -> List[bool]:
    """Which of ``m`` micro-batches a checkpoint mode checkpoints."""
    if mode == 'always':
        return [True] * m
    if mode == 'except_last':
        return [i < m - 1 for i in range(m)]
    return [False] * m


def gradient_share(param_scale: float) -> float:
    """How many of ``param_scale``'s tensors per parameter are its gradient: one, or
    less where training keeps no more than the parameter."""
    return min(1.0, max(0.0, param_scale - 1.0))


def exchange_memory(parts: Partitions, candidate: Candidate, worker: int) -> float:
    """What a worker holds beside a shared weight's gradients as processes sum them at a
    step's end: the other workers' parts received, and the sum."""
    if not parts.costs.processes:
        return 0.0
    total = 0.0
    for holders, nbytes in parts.costs.shared:
        workers = [candidate.worker_of(j) for j in {parts.partition_of(k) for k in holders}]
        if worker in workers and len(workers) > 1:
            total += (len(workers) - workers.count(worker) + 1) * nbytes
    return total


def posted_ahead(workers: Sequence[Sequence[Action]], worker: int, parts: Partitions,
                 sizes: Sequence[int]) -> List[float]:
    """The bytes of the receives a worker's process has posted and not taken during each of
    its actions: each other worker's first message from the step's start, and its next
    from the take of the one before (in the order that worker sends them)."""
    sequences: Dict[int, List[float]] = {}  # each other worker's messages here, in order
    taken_by: Dict[Tuple[bool, int, int], List[Tuple[int, int]]] = {}
    for sender, actions in enumerate(workers):
        if sender == worker or not parts.costs.processes:
            continue
        sequence = sequences[sender] = []
        for action in actions:
            forward = action.kind is Kind.F
            for to, nbytes in ([] if action.kind is Kind.W
                               else parts.sent(action.j, sizes[action.i], forward)):
                if parts.worker_of(to) == worker:
                    taken_by.setdefault((forward, action.i, to), []).append(
                        (sender, len(sequence)))
                    sequence.append(nbytes)
    posted = dict.fromkeys(sequences, 1)  # how many of each sender's messages are posted
    taken: Set[Tuple[int, int]] = set()
    ahead = []
    for action in workers[worker]:
        takes = [] if action.kind is Kind.W else taken_by.get(
            (action.kind is Kind.F, action.i, action.j), [])
        for sender, p in takes:
            taken.add((sender, p))
            posted[sender] = max(posted[sender], p + 2)
        ahead.append(sum(nbytes for sender, sequence in sequences.items()
                         for p, nbytes in enumerate(sequence[:posted[sender]])
                         if (sender, p) not in taken))
    return ahead


def peak_memory(workers: Sequence[Sequence[Action]], worker: int, parts: Partitions,
                sizes: Sequence[int], checkpointed: Sequence[bool], made: float = 0.0
                ) -> float:
    """The most activation memory a worker holds at once over its actions, with ``made``
    times each partition's weight gradients from its first backward pass on.

    Processes hold what they send another until the step's end, and each other's
    next message in the buffer posted to receive it (``posted_ahead``)."""
    live = peak = 0.0
    graded: Set[int] = set()  # the partitions whose weights have gradients
    shared_bytes = SharedBytes(parts, sizes, checkpointed)
    # The built-in schedules number their workers as Candidate.worker_of does.
    for action, posted in zip(workers[worker], posted_ahead(workers, worker, parts, sizes)):
        part = parts(action.j, sizes[action.i])
        activations, temporaries = part.activations, part.temporaries
        live += posted
        sent_forward, sent_back = (sum(n for _, n in parts.sent(action.j, sizes[action.i], f))
                                   for f in (True, False))
        # (An input handed over as it is, the partition before holds.)
        whole = activations.kept + part.messages.entry - part.messages.turned
        kept = (part.messages.entry - part.messages.turned_through if checkpointed[action.i]
                else whole)
        again = activations.kept if checkpointed[action.i] else 0.0
        # A skip received is a copy; one handed over is the stash's own tensor,
        # unless a checkpointed pass made it.
        kept += activations.received + (activations.handed if checkpointed[action.i] else 0.0)
        if action.kind is Kind.F:
            live += kept - shared_bytes.taken(action)
        elif action.kind is Kind.I:
            live += again  # recomputed, and kept for W
        # The partition's first B (or W) makes its weights' gradients; a later one
        # holds its own until added to them.
        later = action.j in graded
        grads = (made * parts.gradients([action.j])
                 if action.kind in (Kind.B, Kind.W) and not later else 0.0)
        if action.kind is Kind.B or action.kind is Kind.W and action.j == 0:
            # (The first partition's W starts from its graph, not its output.)
            pass_peak = temporaries.weight if action.kind is Kind.W else temporaries.backward
            working = pass_peak.accumulating if later else (
                (1 - made) * pass_peak.alone + made * pass_peak.making - grads)
            if action.kind is Kind.W:
                working -= activations.retained  # the gradients it starts from, live since I
        elif action.kind is Kind.I and action.j:
            working = temporaries.input
        elif action.kind is Kind.I:
            working = activations.retained  # the gradients it receives, its output still held
        elif action.kind is Kind.W:
            working = temporaries.gradients if later else 0.0
        else:  # F: its temporaries (checkpointed: its recomputation's count)
            working = 0.0 if checkpointed[action.i] else temporaries.forward
        if action.kind in (Kind.B, Kind.W):
            graded.add(action.j)
        working -= shared_bytes.counted(action)
        peak = max(peak, live + grads + working + (again if action.kind is Kind.B else 0.0))
        if checkpointed[action.i] and action.kind in (Kind.B, Kind.I):
            # The recomputation's own peak, before the backward pass.
            peak = max(peak, live + temporaries.forward + (again if action.kind is Kind.B else 0.0))
        live += grads
        if action.kind is Kind.B:
            live -= kept
        elif action.kind is Kind.I:
            # The output goes (W needs only what autograd saved), gradients stay.
            live += activations.retained - activations.held - activations.above
        elif action.kind is Kind.W:
            live -= kept + again - activations.held - activations.above + activations.retained
        live += shared_bytes.after(action)
        # What this pass sent stays in flight past where its own reference goes: a
        # checkpointed output from the send on, else from B, or from I and W as they free it.
        if parts.costs.processes:
            let_go = min(sent_forward, activations.held)
            live += {Kind.F: sent_forward if checkpointed[action.i] else 0.0,
                     Kind.B: sent_back + (0.0 if checkpointed[action.i] else sent_forward),
                     Kind.I: 0.0 if checkpointed[action.i] else let_go,
                     Kind.W: sent_back + (0.0 if checkpointed[action.i]
                                          else sent_forward - let_go)}[action.kind]
        live -= posted
    return peak
