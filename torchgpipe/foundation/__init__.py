"""The foundation: what every layer above stands on, importing nothing above it.

Devices and streams (``stream``, ``copy``, ``placement``), micro-batches
(``microbatch``, ``nochunk``), the order of backward tasks (``dependency``,
``phony``), which pass runs and what it replays (``phase``, ``rng``,
``autocast``), argument checks (``validation``), shared parameters
(``tied``), layer replacement (``layers``) and recording (``record``).
"""
from typing import List

__all__: List[str] = []
