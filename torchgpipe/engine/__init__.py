"""The engine: schedules as data, and one executor that runs them (:mod:`~torchgpipe.engine.step`).

What differs between ways to run is the partition boundary: linked into one autograd
graph (:mod:`~torchgpipe.engine.pipeline`, for ``forward``) or cut at each partition's
input (:mod:`~torchgpipe.engine.step`, for steps).
"""
from typing import List

__all__: List[str] = []
