"""The pipeline core: the partitions one process holds, and the steps that run them.

The modules are faces (their own checks, registration, state dicts), built through
:meth:`~torchgpipe.modules.base.CoreModule.build`; what runs is their ``core``, whose
step is one template::

    GPipe ──────────────► Core                 all partitions, a mailbox in memory
    DistributedGPipe ───► RankCore(Core)       this rank's partitions, the wire (its hooks)

An evaluation step is a training step's forward actions alone, without autograd, in eval
mode; the last partition keeps the outputs, or each micro-batch's weighted loss.
"""
import warnings
from contextlib import contextmanager, nullcontext
from typing import (Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence,
                    Tuple, cast)

import torch
from torch import Tensor, nn

from torchgpipe.engine.generators import check_schedule, resolve
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.pipeline import Pipeline
from torchgpipe.engine.schedule import Action, Kind, Schedule, ScheduleLike
from torchgpipe.engine.step import LossFunction, Reducer, Step, split_given, weighted
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import first_on_meta
from torchgpipe.foundation.stream import current_stream, use_device
from torchgpipe.foundation.tied import shares_apart, tied_masters
from torchgpipe.foundation.validation import check_evaluation, check_step, describe
from torchgpipe.runtime.batchnorm import DeferredBatchNorm, deferred_step
from torchgpipe.runtime.checkpoint import checkpoint_stop
from torchgpipe.runtime.traits import PartitionTraits, RunState
from torchgpipe.runtime.worker import distinct_devices
from torchgpipe.skip.layout import SkipLayout

__all__ = ['Core']

#: A step's micro-batches' loss weights, its schedule and its checkpoint stop.
Planned = Tuple[List[float], Schedule, int]
#: What a step returns, given this process's result (see ``Core.agreed``).
Finish = Callable[[Any], Any]


class Core:
    """One process's share of a pipeline, and the steps that run it. :meth:`train` and
    :meth:`evaluate` are templates; a rank's core overrides their hooks
    (:attr:`target_elsewhere`, :meth:`check_whole`, :meth:`schedule_for`, :meth:`agreed`,
    :meth:`reducing`)."""

    #: Whether the target of a loss may be another process's.
    target_elsewhere = False
    #: How to give the layers data, where a step finds one on the meta device.
    materialize = ('place the pipeline on real devices: build the GPipe from layers holding '
                   "data, with devices=[...] (the meta device is for shapes alone)")

    def __init__(self, partitions: Dict[int, nn.Sequential], devices: Sequence[torch.device],
                 skip_layout: SkipLayout, chunks: int, checkpoint: str,
                 planned_threads: Optional[int]) -> None:
        self.partitions = partitions
        self.devices = list(devices)
        self.skip_layout = skip_layout
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norms = [m for p in partitions.values() for m in p.modules()
                                     if isinstance(m, DeferredBatchNorm)]
        #: The layers that refuse a mode they have no code for (captured in one mode).
        self.mode_checked = [m for p in partitions.values() for m in p.modules()
                             if callable(getattr(type(m), 'check_mode', None))]
        self.state = RunState(len(partitions))
        #: The intra-op threads its plan measured with, if any, until the first step.
        self.planned_threads = planned_threads
        #: Whether every layer was seen to hold data (see check_materialized).
        self.materialized = False

    def check_threads(self) -> None:
        """Warns at the first step if its intra-op threads are not those its plan measured."""
        planned, self.planned_threads, now = self.planned_threads, None, torch.get_num_threads()
        if planned is not None and now != planned:
            warnings.warn(describe(
                'the intra-op threads of a planned pipeline must be those its plan measured '
                'with, or its steps take another time than predicted',
                f'planned_threads: {planned}, torch.get_num_threads(): {now}',
                f'call torch.set_num_threads({planned}) before the first step, '
                'or plan again for the threads you train with'), UserWarning)

    def check_materialized(self) -> None:
        """Raises before a step while a layer of this process is on the meta device: a
        rank's layers built there stay until it materializes them."""
        if self.materialized:
            return
        on_meta = first_on_meta([child for p in self.partitions.values()
                                 for child in p.named_children()])
        if on_meta is not None:
            raise ValueError(describe(
                'the layers must hold data to run a step', f"'{on_meta}' on the meta device",
                self.materialize))
        self.materialized = True

    def check_modes(self) -> None:
        """Raises a layer's ``check_mode()`` error before a step starts work."""
        for layer in self.mode_checked:
            getattr(layer, 'check_mode')()

    def tied(self) -> List[nn.Parameter]:
        """The parameters several partitions use."""
        return tied_masters(list(self.partitions.values()))

    def forward(self, batches: List[microbatch.Batch], training: bool) -> None:
        """0.0.7's forward: one autograd graph, in clock cycles, for the caller's backward."""
        self.check_modes()
        self.check_threads()
        microbatch.move(batches, self.devices[0])
        streams = [current_stream(d) for d in self.devices]
        with use_device(self.devices[0]):
            copy_streams = self.state.ensure_copy_streams(self.devices, self.chunks)
        pipeline = Pipeline(batches, list(self.partitions.values()), self.devices, copy_streams,
                            streams, self.skip_layout,
                            checkpoint_stop(self.checkpoint, self.chunks, len(batches), training),
                            self.state.traits, self.state.recorder)
        # Deferred BatchNorm commits after this many (a short batch has fewer), or never
        # if the step fails.
        with deferred_step(self.deferred_batch_norms, len(batches)):
            pipeline.run()

    def train(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
              loss_fn: LossFunction, schedule: ScheduleLike, reduction: str, training: bool,
              reducer: Optional[Reducer] = None) -> Tensor:
        """:meth:`~torchgpipe.GPipe.train_step`, or this process's share of it."""
        def check() -> Dict[str, Any]:
            check_schedule(schedule)
            check_step(loss_fn, reduction)
            return {'schedule': schedule}  # labelled where ranks compare it (RankCore)

        def plan(sizes: List[int]) -> Planned:
            weights, m = weighted(sizes, reduction), len(sizes)
            return (weights, self.schedule_for(schedule, m),
                    checkpoint_stop(self.checkpoint, self.chunks, m, training))
        with self.started(check, input, target, loss_fn, plan, reducer=reducer) as (step, finish):
            with deferred_step(self.deferred_batch_norms, len(step.shared.batches)):
                loss = step.run()
            return cast(Tensor, finish(loss))

    def evaluate(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                 loss_fn: Optional[LossFunction], reduction: str,
                 output_fn: Optional[Callable[[TensorOrTensors], Any]],
                 everywhere: bool = False) -> Any:
        """:meth:`~torchgpipe.GPipe.eval_step`, or this process's share of it (the output
        where the last partition is, or ``everywhere``), in evaluation mode."""
        def check() -> Dict[str, Any]:
            check_evaluation(target, loss_fn, reduction, output_fn, self.target_elsewhere)
            return {'loss': loss_fn is not None, 'everywhere': everywhere}

        def plan(sizes: List[int]) -> Planned:
            weights = [1.0] * len(sizes) if loss_fn is None else weighted(sizes, reduction)
            return weights, forward_only(len(sizes), len(self.devices)), 0
        with self.started(check, input, target, loss_fn, plan, train=False) as (step, finish):
            loss = step.run()
            output = None if loss_fn is not None else step.output()
            if output is not None and output_fn is not None:
                output = output_fn(output)
            result = finish(loss if loss_fn is not None else output if everywhere else None)
        return output if loss_fn is None and not everywhere else result

    @contextmanager
    def started(self, check: Callable[[], Dict[str, Any]], input: Optional[TensorOrTensors],
                target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                plan: Callable[[List[int]], Planned], *,
                reducer: Optional[Reducer] = None,
                train: bool = True) -> Iterator[Tuple[Step, Finish]]:
        """The template of a step, which the body runs: ``check()`` checks the arguments and
        says what the step is, the input is split, ``plan(sizes)`` plans it, and every
        process agrees (:meth:`agreed`) before any work."""
        self.check_whole()
        name = 'train_step' if train else 'eval_step'
        batches = targets = sizes = planned = problem = None
        words: Dict[str, Any] = {}
        # All refuse what one process refuses; one given no data plans on the agreed sizes.
        try:
            words = check()
            # Before the input is split: that of an empty pipeline's forward fails.
            if not self.devices:
                raise ValueError(f'{name} needs at least one layer: this GPipe is empty')
            self.check_materialized()
            self.check_modes()
            batches, targets, sizes = split_given(input, target, self.chunks, self.devices[-1])
            planned = None if sizes is None else plan(sizes)
            if 0 in self.partitions and batches is not None:
                microbatch.move(batches, self.devices[0])
        except Exception as exc:
            problem = exc
        lacking = ['input'] if 0 in self.partitions and batches is None else []
        if len(self.devices) - 1 in self.partitions and loss_fn is not None and targets is None:
            lacking.append('target')
        said = {'step': name, 'micro-batches': sizes, 'input': batches, **words}
        reducing = self.reducing() if train and reducer is None else nullcontext(reducer)
        with self.agreed(said, lacking, problem, train) as (agreed, mailbox, finish), \
                reducing as reducer:
            weights, schedule, stop = planned or plan(agreed)
            self.check_threads()
            n, m, here = len(self.devices), len(agreed), list(self.partitions)
            traits = dict(zip(here, self.state.traits))
            streams = dict(zip(here, self.state.ensure_copy_streams(
                [self.devices[j] for j in here], self.chunks)))
            yield Step([self.partitions.get(j) for j in range(n)], self.devices,
                       batches or [None] * m, targets or [None] * m, loss_fn, weights, schedule,
                       self.skip_layout, stop, [traits.get(j, PartitionTraits()) for j in range(n)],
                       self.state.recorder, mailbox=mailbox, reducer=reducer, train=train,
                       copy_streams=[streams.get(j) for j in range(n)]), finish

    def check_whole(self) -> None:
        """Raises if no step can run: never in one process, which a failed step leaves whole."""

    def reducing(self) -> ContextManager[Optional[Reducer]]:
        """Around a training step's work, the reducer of the partitions' gradients, if
        they reduce them themselves: never in one process."""
        return nullcontext(None)

    def schedule_for(self, schedule: ScheduleLike, m: int) -> Schedule:
        """``schedule`` for ``m`` micro-batches, checked to fit the workers (a device's thread)."""
        return resolve(schedule, m, len(self.devices),
                       [distinct_devices([d])[0] for d in self.devices])

    @contextmanager
    def agreed(self, said: Dict[str, Any], lacking: List[str], problem: Optional[Exception],
               train: bool) -> Iterator[Tuple[List[int], Optional[Mailbox], Finish]]:
        """The micro-batches' sizes of the step every process ``said`` it runs, the mailbox
        to the others and the step's ``Finish``; a ``problem``, or an ``'input'`` or
        ``'target'`` a process is ``lacking``, refuses it. In one process: as they are (a
        lacking one is of a wrong type), the tied gradients added in one order."""
        refuse(problem)
        for what in lacking:
            microbatch.check(None, what)
        with shares_apart(list(self.partitions.values())) if train else nullcontext():
            yield said['micro-batches'], None, lambda result: result


def refuse(problem: Optional[Exception], *layout: Any) -> None:
    """Raises ``problem``, if any: one process agrees with itself (``layout``: as ranks do)."""
    if problem is not None:
        raise problem


def forward_only(m: int, n: int) -> Schedule:
    """The forward actions of ``m`` micro-batches on ``n`` partitions, in clock order.

    Example::

        >>> print(forward_only(2, 2))
        0F0 0F1
        1F0 1F1
    """
    return Schedule(([Action(Kind.F, i, j) for i in range(m)] for j in range(n)),
                    name='forward only')


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Puts ``module`` in evaluation mode, and each of its layers back in its own mode after."""
    modes = [(layer, layer.training) for layer in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for layer, training in modes:
            layer.training = training

