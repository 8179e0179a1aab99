"""The foundation: what every layer above stands on, importing nothing above it (streams,
copies, placement, micro-batches, fork and join, replayed passes, argument checks, tied
parameters, recording)."""
from typing import List

__all__: List[str] = []
