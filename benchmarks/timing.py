"""Timing on a noisy shared machine: steps side by side, epochs of training, and their spread.

The rules: variants compared in the same run, taking turns so that slow
spells of the machine hit them alike, and the fastest step or epoch as the
headline statistic, since noise only ever adds time. Noise is large here
(epoch times vary by some 17%, more than the gaps between some settings), so
every figure also keeps its spread (:func:`spread`: the fastest, the median
and the slowest sample), which the tables and plots show beside it.
"""
import functools
import gc
import statistics
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence

import torch

from benchmarks.devices import synchronize
from benchmarks.report import progress

__all__ = ['spread', 'warmup_steps', 'time_steps', 'Trainer', 'measure_throughputs',
           'measure_settings']


def spread(samples: Sequence[float]) -> Dict[str, float]:
    """The fastest (``min``), ``median`` and slowest (``max``) of some samples, and their count."""
    return {'min': min(samples), 'median': statistics.median(samples), 'max': max(samples),
            'samples': len(samples)}


def warmup_steps(config: Mapping[str, Any]) -> int:
    """Untimed calls of each step before the timed ones: ``config['warmup']``, or 1.

    Smoke runs set 0: their figures mean nothing, and a warm-up call would
    only run again what the timed one runs.
    """
    return int(config.get('warmup', 1))


def time_steps(steps: Mapping[str, Callable[[], None]], rounds: int, *, warmup: int = 1,
               desc: str = 'timing') -> Dict[str, Dict[str, float]]:
    """The :func:`spread` of the time in seconds of each step function, timed side by side.

    Every round runs each step once, in an order rotated from round to
    round, so that slow spells of a shared machine hit all of them alike.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    for r in progress(range(rounds), desc=desc):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return {name: spread(samples) for name, samples in seconds.items()}


class Trainer:
    """Trains a model with plain SGD on one synthetic batch, an epoch at a time, timing each.

    The same batch is fed at every step, so that no data loading is timed.

    Args:
        model: the model (plain or GPipe), on its devices
        input: the batch, on the first device
        target: the target, on the last device
        loss_fn: ``loss_fn(output, target)``
        steps_per_epoch: steps of one epoch
        devices: the devices to synchronize before and after each epoch
    """

    def __init__(self, model: torch.nn.Module, input: torch.Tensor, target: torch.Tensor,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, steps_per_epoch: int,
                 devices: Sequence[torch.device]) -> None:
        self.model = model
        self.input = input
        self.target = target
        self.loss_fn = loss_fn
        self.steps_per_epoch = steps_per_epoch
        self.devices = list(devices)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.seconds: List[float] = []

    def epoch(self) -> None:
        synchronize(self.devices)
        start = time.perf_counter()
        for _ in range(self.steps_per_epoch):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(self.input), self.target)
            loss.backward()
            self.optimizer.step()
        synchronize(self.devices)
        self.seconds.append(time.perf_counter() - start)

    def result(self) -> Dict[str, Any]:
        """Samples/s of the epochs after the first: the fastest, the spread and the mean.

        ``throughput`` is the fastest epoch's (the headline), ``throughput_spread``
        the :func:`spread` of all counted epochs, ``throughput_mean`` their
        mean, as the paper reports.
        """
        samples = self.steps_per_epoch * len(self.input)
        counted = [samples / t for t in self.seconds[1:]]
        return {'epoch_seconds': self.seconds, 'samples_per_epoch': samples,
                'throughput': max(counted), 'throughput_spread': spread(counted),
                'throughput_mean': sum(counted) / len(counted)}


def measure_throughputs(factories: Mapping[str, Callable[[], Trainer]], epochs: int, *,
                        interleave: bool) -> Dict[str, Dict[str, Any]]:
    """Trains every setting for ``epochs`` epochs and returns each :meth:`Trainer.result`.

    The first epoch is a warm-up (allocations, kernel selection) and is not
    counted, so ``epochs`` must be at least 2.

    With ``interleave``, every trainer is built first, and the settings take
    turns epoch by epoch, so that slow spells of a shared machine hit them
    alike (on CPU). Otherwise each setting is built, trained and released in
    turn, so that only one occupies the devices at a time (on CUDA).
    """
    if epochs < 2:
        raise ValueError(f'epochs must be at least 2, got {epochs}: the first epoch is a '
                         'warm-up and is not counted')
    if interleave:
        trainers = {name: factory() for name, factory in factories.items()}
        for _ in progress(range(epochs), desc='epochs (settings interleaved)'):
            for trainer in trainers.values():
                trainer.epoch()
        return {name: trainer.result() for name, trainer in trainers.items()}
    results: Dict[str, Dict[str, Any]] = {}
    for name, factory in factories.items():
        trainer = factory()
        for _ in progress(range(epochs), desc=name):
            trainer.epoch()
        results[name] = trainer.result()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results



def measure_settings(rows: Sequence[Dict[str, Any]],
                     build: Callable[[Dict[str, Any], Dict[str, Any]], Trainer], epochs: int,
                     device: str) -> List[Dict[str, Any]]:
    """Each row's :meth:`Trainer.result`, with what ``build(row, info)`` put in ``info``.

    ``build`` makes the trainer of a row and fills ``info`` with what the
    results should say about it (devices, balance, size). On CPU the rows
    take turns epoch by epoch (see :func:`measure_throughputs`).
    """
    infos: Dict[str, Dict[str, Any]] = {r['name']: {} for r in rows}
    factories = {r['name']: functools.partial(build, r, infos[r['name']]) for r in rows}
    measured = measure_throughputs(factories, epochs, interleave=device == 'cpu')
    return [dict(infos[name], **measured[name]) for name in factories]
