"""The pipeline core: the partitions one process holds, and the steps that run them.

The modules are faces (their own checks, registration, state dicts), built through
:meth:`CoreModule.build`; what runs is their ``core``, whose step is one template::

    GPipe ──────────────► Core                 all partitions, a mailbox in memory
    DistributedGPipe ───► RankCore(Core)       this rank's partitions, the wire (its hooks)
"""
import warnings
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from hashlib import sha1
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from torchgpipe.engine.evaluation import (check_evaluation, evaluating, evaluation_weights,
                                          forward_only, join)
from torchgpipe.engine.generators import built_in, check_schedule, resolve
from torchgpipe.engine.inputs import split_given, weighted
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.pipeline import Pipeline
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.engine.step import LossFunction, Step
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import check_materialized
from torchgpipe.foundation.stream import current_stream, use_device
from torchgpipe.foundation.tied import find_ties, place_partitions, shares_apart, tied_masters
from torchgpipe.foundation.validation import (check_chunks, check_one_process,
                                              check_planned_threads, check_step, describe,
                                              verify_module)
from torchgpipe.runtime.batchnorm import DeferredBatchNorm, deferred_step
from torchgpipe.runtime.checkpoint import checkpoint_stop
from torchgpipe.runtime.state import RunState
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import distinct_devices
from torchgpipe.skip.layout import SkipLayout, inspect_skip_layout
from torchgpipe.skip.skippable import verify_skippables

__all__ = ['Core', 'CoreModule']

#: Called with ``j`` once partition ``j`` has no backward pass left in the step.
Done = Callable[[int], None]
#: A step's micro-batches' loss weights, its schedule and its checkpoint stop.
Planned = Tuple[List[float], Schedule, int]
#: What a step returns, given this process's result (see ``Core.agreed``).
Finish = Callable[[Any], Any]
#: What a core keeps of the arguments both faces take (see :meth:`CoreModule.build`).
Settings = Tuple[SkipLayout, int, str, Optional[int]]


class Core:
    """One process's share of a pipeline, and the steps that run it. :meth:`train` and
    :meth:`evaluate` are templates; a rank's core overrides their hooks
    (:attr:`target_elsewhere`, :meth:`check_whole`, :meth:`schedule_for`, :meth:`agreed`)."""

    #: Whether the target of a loss may be another process's.
    target_elsewhere = False

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
              done: Optional[Done] = None) -> Tensor:
        """:meth:`~torchgpipe.GPipe.train_step`, or this process's share of it."""
        def check() -> Dict[str, Any]:
            check_schedule(schedule)
            check_step(loss_fn, reduction)
            return {'schedule': schedule_label(schedule)}

        def plan(sizes: List[int]) -> Planned:
            weights, m = weighted(sizes, reduction), len(sizes)
            return (weights, self.schedule_for(schedule, m),
                    checkpoint_stop(self.checkpoint, self.chunks, m, training))
        with self.started(check, input, target, loss_fn, plan, done=done) as (step, finish):
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
            return (evaluation_weights(sizes, reduction, loss_fn is not None),
                    forward_only(len(sizes), len(self.devices)), 0)
        with self.started(check, input, target, loss_fn, plan, train=False) as (step, finish):
            loss = step.run()
            output = None if loss_fn is not None else join(step.outputs())
            if output is not None and output_fn is not None:
                output = output_fn(output)
            result = finish(loss if loss_fn is not None else output if everywhere else None)
        return output if loss_fn is None and not everywhere else result

    @contextmanager
    def started(self, check: Callable[[], Dict[str, Any]], input: Optional[TensorOrTensors],
                target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                plan: Callable[[List[int]], Planned], *, done: Optional[Done] = None,
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
        with self.agreed(said, lacking, problem, train) as (agreed, mailbox, finish):
            weights, schedule, stop = planned or plan(agreed)
            self.check_threads()
            n, m, here = len(self.devices), len(agreed), list(self.partitions)
            traits = dict(zip(here, self.state.traits))
            streams = dict(zip(here, self.state.ensure_copy_streams(
                [self.devices[j] for j in here], self.chunks)))
            yield Step([self.partitions.get(j) for j in range(n)], self.devices,
                       batches or [None] * m, targets or [None] * m, loss_fn, weights, schedule,
                       self.skip_layout, stop, [traits.get(j, PartitionTraits()) for j in range(n)],
                       self.state.recorder, mailbox=mailbox, done=done, train=train,
                       copy_streams=[streams.get(j) for j in range(n)]), finish

    def check_whole(self) -> None:
        """Raises if no step can run: never in one process, which a failed step leaves whole."""

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


def schedule_label(schedule: ScheduleLike) -> str:
    """A built-in schedule's name, or a schedule's name and digest: what the ranks agree
    on before a rank given no data knows the micro-batches."""
    name = built_in(schedule)
    if name is not None:
        return name
    given = Schedule.parse(schedule)
    return f'{given.name} ({sha1(str(given).encode()).hexdigest()[:8]})'


def refuse(problem: Optional[Exception], *layout: Any) -> None:
    """Raises ``problem``, if any: one process agrees with itself (``layout``: as ranks do)."""
    if problem is not None:
        raise problem


class CoreModule(nn.Module):
    """A module whose settings live in, and whose checked steps run on, its :class:`Core`."""

    core: Core

    def build(self, module: nn.Sequential, balance: Any, chunks: int, checkpoint: str,
              deferred_batch_norm: bool, planned_threads: Optional[int],
              locate: Callable[[Any], Tuple[List[int], Sequence[Optional[torch.device]]]],
              agree: Callable[[Optional[Exception], List[int], str, bool], None] = refuse,
              ) -> Tuple[List[nn.Sequential], Dict[int, nn.Sequential], Settings]:
        """Splits ``module`` into partitions, BatchNorm deferred if asked, and places this
        process's, tied (see ``place_partitions``), once the arguments are checked (the
        face's own by ``locate(balance)``, which returns the balance and each partition's
        device, ``None`` if another process's) and every process agrees (``agree``). Returns the
        partitions, this process's by index, and the core's skip layout, chunks, checkpoint
        and planned threads."""
        devices: Sequence[Optional[torch.device]] = ()
        deferred, problem = False, None
        try:
            deferred = bool(deferred_batch_norm)
            verify_module(module)
            balance, devices = locate(balance)
            check_materialized(module, balance, devices)
            chunks = check_chunks(chunks)
            planned_threads = check_planned_threads(planned_threads)
            # As in 0.0.7, anything whose str() is a mode is one (an enum member).
            checkpoint = str(checkpoint)
            if checkpoint not in ('always', 'except_last', 'never'):
                # Word for word as in 0.0.7 (users match on it).
                raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
            verify_skippables(module)
        except Exception as exc:
            problem = exc
        agree(problem, balance, checkpoint, deferred)
        if deferred:
            module = cast(nn.Sequential,
                          DeferredBatchNorm.convert_deferred_batch_norm(module, chunks))
        self.balance = balance
        children = iter(module.named_children())
        partitions = [nn.Sequential(OrderedDict(next(children) for _ in range(n)))
                      for n in balance]
        find_ties(partitions)  # in any process's partitions
        here = {j: p for j, (p, d) in enumerate(zip(partitions, devices)) if d is not None}
        place_partitions(list(here.values()), [d for d in devices if d is not None])
        return partitions, here, (inspect_skip_layout(partitions), chunks, checkpoint,
                                  planned_threads)

    @property
    def chunks(self) -> int:
        """The number of micro-batches."""
        return self.core.chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self.core.chunks = chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode, ``'always'``, ``'except_last'`` or ``'never'``."""
        return self.core.checkpoint

    @checkpoint.setter
    def checkpoint(self, checkpoint: str) -> None:
        self.core.checkpoint = checkpoint

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], torch.Tensor], *,
                   schedule: ScheduleLike = '1f1b', reduction: str = 'mean') -> torch.Tensor:
        """Runs the forward and backward passes of a mini-batch, as ``schedule`` orders them:
        ``.grad`` adds what ``loss_fn(model(input), target).backward()`` gives the unwrapped model.

        Args:
            input (torch.Tensor or tuple): as :meth:`~torchgpipe.GPipe.forward` takes it
            target (torch.Tensor or tuple): split like the input (:class:`~torchgpipe.NoChunk`
                tensors go whole to every loss)
            loss_fn (callable): ``loss_fn(output, target)`` of one micro-batch, one element;
                called again in a recomputation (see :func:`~torchgpipe.is_recomputing`)
            schedule (str or schedule): ``'1f1b'`` (default), ``'fill_drain'``,
                ``'interleaved_1f1b'``, ``'zb_h1'``, ``'zbv'`` or one's own (:doc:`/schedules`)
            reduction (str): how ``loss_fn`` reduces a micro-batch, ``'mean'``
                (default: each loss weighted by its share of the mini-batch) or ``'sum'``

        Returns:
            torch.Tensor: the loss of the mini-batch, on the last device, without history

        Raises:
            ValueError: an unknown ``schedule`` or ``reduction``, a schedule that does not
                fit, a target that does not split like the input, an empty mini-batch
            TypeError: ``schedule`` or ``reduction`` of another type, or a ``loss_fn``
                not callable or not returning one element
            RuntimeError: gradients disabled, or several processes (see
                :func:`torchgpipe.distributed.train_step`)

        Example::

            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
            ...               balance=[2, 1], devices=['cpu:0', 'cpu:1'], chunks=4)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> optimizer.zero_grad()
            >>> loss = model.train_step(torch.randn(16, 4), torch.randn(16, 2), F.mse_loss)
            >>> optimizer.step()
        """
        check_one_process()
        return self.core.train(input, target, loss_fn, schedule, reduction, self.training)

    def eval_step(self, input: TensorOrTensors, target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates a mini-batch as ``model.eval()`` and :func:`torch.no_grad` would the
        unwrapped model, the layers back in their own mode after.

        Args:
            input (torch.Tensor or tuple): the mini-batch
            target (torch.Tensor or tuple, optional): with ``loss_fn``, the target
            loss_fn (callable, optional): as for :meth:`train_step`
            reduction (str): as for :meth:`train_step`
            output_fn (callable, optional): without ``loss_fn``, what to return of the output

        Returns:
            the loss of the mini-batch with ``loss_fn``; else the output (or ``output_fn`` of it)

        Raises:
            ValueError: only one of ``target`` and ``loss_fn``, or ``output_fn`` with them;
                or as for :meth:`train_step`
            TypeError: ``output_fn`` not callable; or as for :meth:`train_step`

        Example::

            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.Dropout(), nn.Linear(8, 2)),
            ...               balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
            >>> input, target = torch.randn(16, 4), torch.randn(16, 2)
            >>> model.eval_step(input, target, F.mse_loss).requires_grad
            False
            >>> model.eval_step(input).shape
            torch.Size([16, 2])
            >>> model.training                   # as it was
            True
        """
        with evaluating(self):
            return self.core.evaluate(input, target, loss_fn, reduction, output_fn)
