"""The devices an experiment runs on: CPU devices, CUDA devices, and waiting for them."""
from typing import Iterable, List

import torch

__all__ = ['cpu_devices', 'cuda_devices', 'synchronize']


def cpu_devices(n: int, *, distinct: bool = True) -> List[torch.device]:
    """``n`` CPU devices: ``cpu:0..n-1`` (a worker thread each) or ``cpu`` n times (inline)."""
    if distinct and n > 1:
        return [torch.device('cpu', i) for i in range(n)]
    return [torch.device('cpu')] * n


def cuda_devices(n: int) -> List[torch.device]:
    """The first ``n`` CUDA devices; exits with a message if there are fewer."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < n:
        raise SystemExit(f'this preset needs {n} CUDA device(s), {available} visible; '
                         'run a CPU preset instead (--preset cpu)')
    return [torch.device('cuda', i) for i in range(n)]


def synchronize(devices: Iterable[torch.device]) -> None:
    """Waits for every queued kernel on the CUDA devices among ``devices``."""
    for device in dict.fromkeys(devices):
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
