"""How the ranks of a pipeline across processes talk: messages on the wire, channels of
tensors and words, the codec of headers and words, and what a rank raises when another
fails, hangs or disagrees."""
from typing import List

__all__: List[str] = []
