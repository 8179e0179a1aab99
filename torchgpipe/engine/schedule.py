"""Schedules as data: each worker's actions, in order, written ``{partition}{kind}{micro-batch}``.

A worker (a device's thread, or a rank) may own several partitions. The kinds::

    0F1   forward pass (without keeping activations, if checkpointed)
    1B0   backward pass, whole (after the recomputation, if checkpointed)
    2I0   backward pass for the partition's inputs only: sends their gradients
    2W0   the rest: the gradients of the partition's parameters, from what 2I0 kept
"""
import enum
import re
from dataclasses import dataclass
from typing import (Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union,
                    cast)

from torchgpipe.foundation.validation import describe

__all__: List[str] = []


class Kind(enum.Enum):
    """What an action does to one micro-batch on one partition."""

    #: The forward pass (without keeping activations, if checkpointed).
    F = 'F'
    #: The whole backward pass, after the recomputation if checkpointed.
    B = 'B'
    #: The backward pass for the partition's inputs only (the partition before waits for it).
    I = 'I'  # noqa: E741 (the letter of the notation)
    #: The gradients of the partition's parameters, from what ``I`` kept.
    W = 'W'


def notation(partition: int, kind: str, micro_batch: int) -> str:
    """How an action, or a timeline's task (``0F'1``, ``1C0``), is written: ``'1B0'``."""
    return f'{partition}{kind}{micro_batch}'


@dataclass(frozen=True, init=False)
class Action:
    """One action of a schedule: ``kind`` of micro-batch ``i`` on partition ``j``, printed
    partition first (``Action(Kind.F, 1, 0)`` is ``0F1``).

    Args:
        kind (Kind or str): ``Kind.F`` or ``'F'``, and so on
        i (int): the micro-batch; or ``micro_batch=``, harder to swap with ``j``
        j (int): the partition; or ``partition=``

    Raises:
        ValueError: ``kind`` is not F, B, I or W; or an index given twice, or not at all

    Example::

        >>> Action('F', micro_batch=1, partition=0)
        Action(kind=<Kind.F: 'F'>, i=1, j=0)
        >>> print(Action(Kind.B, micro_batch=0, partition=1))
        1B0
    """

    kind: Kind
    i: int
    j: int

    def __init__(self, kind: Union[Kind, str], i: Optional[int] = None,
                 j: Optional[int] = None, *, micro_batch: Optional[int] = None,
                 partition: Optional[int] = None) -> None:
        object.__setattr__(self, 'kind', Kind(kind))
        object.__setattr__(self, 'i', _index(i, micro_batch, 'micro_batch'))
        object.__setattr__(self, 'j', _index(j, partition, 'partition'))

    @property
    def micro_batch(self) -> int:
        """The micro-batch, ``i``."""
        return self.i

    @property
    def partition(self) -> int:
        """The partition, ``j``."""
        return self.j

    def __str__(self) -> str:
        return notation(self.j, self.kind.value, self.i)

    @classmethod
    def parse(cls, text: str) -> 'Action':
        """The action written ``text``, such as ``'0F1'``.

        Raises:
            ValueError: ``text`` is not ``{partition}{F|B|I|W}{micro-batch}``
        """
        match = _ACTION.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"schedule action {text!r} is not of the form "
                             "'{partition}{F|B|I|W}{micro-batch}'; write e.g. '0F1' for the "
                             'forward pass of micro-batch 1 on partition 0')
        j, kind, i = match.groups()
        return cls(Kind(kind), int(i), int(j))


def _index(positional: Optional[int], keyword: Optional[int], name: str) -> int:
    if (positional is None) == (keyword is None):
        raise ValueError(describe(f'Action takes its {name} once, by position or as {name}=',
                                  f'{name}: {positional!r} and {keyword!r}',
                                  "write e.g. Action('F', micro_batch=1, partition=0)"))
    return positional if positional is not None else cast(int, keyword)


_ACTION = re.compile(r'(\d+)([FBIW])(\d+)')

#: What a schedule may be given as: a Schedule, its text, or action lists.
ScheduleLike = Union['Schedule', str, Sequence[Sequence[Union[Action, str]]]]


class Schedule:
    """Each worker's actions, in the order the worker runs them; printed a line per worker.

    Args:
        workers: one list of actions per worker
        name: the name of a built-in schedule; ``'own'`` for others

    Example::

        >>> schedule = Schedule([[Action(Kind.F, 0, 0), Action(Kind.B, 0, 0)]])
        >>> str(schedule)
        '0F0 0B0'
        >>> Schedule.parse(str(schedule)) == schedule
        True
    """

    def __init__(self, workers: Iterable[Iterable[Action]], name: str = 'own') -> None:
        self.workers: List[List[Action]] = [list(actions) for actions in workers]
        self.name = name
        #: The clock cycles its last :meth:`check` laid out, which a step runs.
        self.cycles: Optional[List[List[Action]]] = None

    def __str__(self) -> str:
        return '\n'.join(' '.join(map(str, actions)) for actions in self.workers)

    def __repr__(self) -> str:
        return f'Schedule.parse({str(self)!r})'

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.workers == other.workers

    @classmethod
    def parse(cls, schedule: ScheduleLike) -> 'Schedule':
        """A schedule from its text (a line per worker), or from lists of actions or their text.

        Raises:
            ValueError: an action written wrong
            TypeError: ``schedule`` is none of these
        """
        if isinstance(schedule, Schedule):
            return schedule
        if isinstance(schedule, str):
            return cls([Action.parse(a) for a in re.split(r'[\s,]+', line.strip()) if a]
                       for line in schedule.strip().splitlines())
        if not isinstance(schedule, Sequence) or \
                any(isinstance(w, str) or not isinstance(w, Sequence) for w in schedule):
            raise TypeError(f'a schedule must be a name, its text or a list of action lists, '
                            f'not {type(schedule).__name__}; write e.g. '
                            f"[['0F0', '0B0'], ['1F0', '1B0']]")
        return cls([a if isinstance(a, Action) else Action.parse(str(a)) for a in actions]
                   for actions in schedule)

    def placement(self) -> Dict[int, int]:
        """The worker of each partition.

        Raises:
            ValueError: two workers run actions of one partition
        """
        worker: Dict[int, int] = {}
        for w, actions in enumerate(self.workers):
            for action in actions:
                if worker.setdefault(action.j, w) != w:
                    raise ValueError(f'schedule runs partition {action.j} on workers '
                                     f'{worker[action.j]} and {w} ({action}); give all actions '
                                     'of a partition to one worker')
        return worker

    def check(self, *, micro_batches: int, partitions: int) -> List[List[Action]]:
        """Proves, before any work, that the schedule runs each action once (``F``, and
        ``B`` or both ``I`` and ``W``, of each micro-batch on each partition) and can finish.

        Args:
            micro_batches (int): the micro-batches of the step
            partitions (int): the partitions of the model

        Returns:
            the actions of each clock cycle (:func:`~torchgpipe.engine.schedule.clock_order`)

        Raises:
            ValueError: an action is missing, unknown, twice, or can never run (the
                message names the actions that wait for each other)

        Example::

            >>> schedule = Schedule.parse('0F0 0B0\\n1F0 1B0')
            >>> cycles = schedule.check(micro_batches=1, partitions=2)
            >>> [' '.join(map(str, cycle)) for cycle in cycles]
            ['0F0', '1F0', '1B0', '0B0']
        """
        m, n = micro_batches, partitions
        self.placement()
        seen: Dict[Action, int] = {}
        for w, actions in enumerate(self.workers):
            for action in actions:
                if not (0 <= action.j < n and 0 <= action.i < m):
                    raise ValueError(f'schedule action {action} is outside the step: it has '
                                     f'partitions 0..{n - 1} and micro-batches 0..{m - 1}')
                if action in seen:
                    raise ValueError(f'schedule runs {action} twice; run each action once')
                seen[action] = w
        for j in range(n):
            for i in range(m):
                b, i_, w = (Action(k, i, j) in seen for k in (Kind.B, Kind.I, Kind.W))
                if b and (i_ or w):
                    raise ValueError(f'schedule runs both {j}B{i} and a split of it '
                                     f'({j}I{i}, {j}W{i}); run one of the two')
                missing = [Action(Kind.F, i, j)] if Action(Kind.F, i, j) not in seen else []
                if not (b or i_ or w):
                    missing.append(Action(Kind.B, i, j))
                elif not b:
                    missing += [Action(k, i, j) for k, ran in ((Kind.I, i_), (Kind.W, w))
                                if not ran]
                if missing:
                    raise ValueError(f'schedule never runs {missing[0]}; every micro-batch '
                                     'needs F, and B or both I and W, on every partition')
        self.cycles = clock_order(self.workers, n)
        return self.cycles


def depends_on(action: Action, n: int, split: Callable[[int, int], bool]) -> List[Action]:
    """What ``action`` waits for: ``jFi`` for ``(j-1)Fi``; ``jBi`` or ``jIi`` for ``jFi``
    and ``(j+1)Bi`` (``(j+1)Ii`` if ``split(i, j+1)``); ``jWi`` for ``jIi``. Skips add
    nothing: they go forward along these."""
    i, j = action.i, action.j
    if action.kind is Kind.F:
        return [Action(Kind.F, i, j - 1)] if j > 0 else []
    if action.kind is Kind.W:
        return [Action(Kind.I, i, j)]
    needs = [Action(Kind.F, i, j)]
    if j < n - 1:
        needs.append(Action(Kind.I if split(i, j + 1) else Kind.B, i, j + 1))
    return needs


def dependencies(workers: Sequence[Sequence[Action]], n: int) -> Dict[Action, List[Action]]:
    """What each action of a schedule waits for."""
    split = {(a.i, a.j) for actions in workers for a in actions if a.kind is Kind.I}
    return {a: depends_on(a, n, lambda i, j: (i, j) in split)
            for actions in workers for a in actions}


def clock_order(workers: Sequence[Sequence[Action]], n: int) -> List[List[Action]]:
    """Lays a schedule out in clock cycles: at each, every worker runs its next action if
    what it waits for ran before; ``ValueError`` naming the :func:`circle` if it cannot finish."""
    needs = dependencies(workers, n)
    done: Set[Action] = set()
    position = [0] * len(workers)
    cycles: List[List[Action]] = []
    while True:
        heads = [actions[position[w]] for w, actions in enumerate(workers)
                 if position[w] < len(actions)]
        if not heads:
            return cycles
        cycle = [a for a in heads if all(d in done for d in needs[a])]
        if not cycle:
            raise ValueError(f'the schedule cannot go on: {circle(workers, needs, done, position)}'
                             '; each worker runs its actions in order, so to break the circle, '
                             'move one of these actions ahead of the one it waits behind on its '
                             'worker')
        for w, actions in enumerate(workers):
            if position[w] < len(actions) and actions[position[w]] in cycle:
                position[w] += 1
        done.update(cycle)
        cycles.append(cycle)


def circle(workers: Sequence[Sequence[Action]], needs: Dict[Action, List[Action]],
           done: Set[Action], position: List[int]) -> str:
    """In words, the actions that wait for each other (what they need, or the action
    before them on their worker) once no worker's next action can run; it starts where a
    reorder is most likely meant, at one waiting for a later action of its own worker."""
    left = {a: w for w, actions in enumerate(workers) for a in actions[position[w]:]}
    heads = {w: actions[position[w]] for w, actions in enumerate(workers)
             if position[w] < len(actions)}

    def waits_for(action: Action) -> Tuple[Action, Optional[int]]:
        w = left[action]
        if heads[w] != action:
            return heads[w], w
        missing = [d for d in needs[action] if d not in done]
        return next((d for d in missing if left.get(d) == w), missing[0]), None

    start = next((a for a in heads.values()
                  if any(left.get(d) == left[a] for d in needs[a] if d not in done)),
                 next(iter(heads.values())))
    path: List[Tuple[Action, Optional[int]]] = [(start, None)]
    index = {start: 0}
    while True:
        action, behind = waits_for(path[-1][0])
        if action in index or action not in left:
            break
        index[action] = len(path)
        path.append((action, behind))
    if action not in left:  # waits for an action no worker runs: no circle, an end
        return (f'{start} can never run, for it waits for '
                + ', which waits for '.join(str(a) for a, _ in path[1:] + [(action, None)])
                + ', which no worker runs')
    cycle = path[index[action]:] + [(action, behind)]
    words = [f'{a} (before it on worker {w})' if w is not None else str(a)
             for a, w in cycle[1:]]
    return f'{cycle[0][0]} can never run, for it waits for ' + ', which waits for '.join(words)

