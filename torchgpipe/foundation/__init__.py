"""The foundation: what every layer above stands on, importing nothing of the package above it.

Devices and streams (:mod:`~torchgpipe.foundation.stream`,
:mod:`~torchgpipe.foundation.copy`, :mod:`~torchgpipe.foundation.placement`),
micro-batches (:mod:`~torchgpipe.foundation.microbatch`,
:mod:`~torchgpipe.foundation.nochunk`), the order of backward tasks
(:mod:`~torchgpipe.foundation.dependency`, :mod:`~torchgpipe.foundation.phony`),
which pass runs and what it must replay (:mod:`~torchgpipe.foundation.phase`,
:mod:`~torchgpipe.foundation.rng`, :mod:`~torchgpipe.foundation.autocast`),
the checks of every argument (:mod:`~torchgpipe.foundation.validation`), shared
parameters (:mod:`~torchgpipe.foundation.tied`), in-place replacement of
layers (:mod:`~torchgpipe.foundation.layers`), and the recording interface
(:mod:`~torchgpipe.foundation.record`).
"""
from typing import List

__all__: List[str] = []
