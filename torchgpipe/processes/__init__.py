"""What a pipeline across processes runs on: a rank's core, which rank holds each
partition, parameters tied across ranks, the norm of every rank's gradients, and
the averaging of replicas' gradients."""
from typing import List

__all__: List[str] = []
