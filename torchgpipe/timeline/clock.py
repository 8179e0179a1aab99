"""How a timeline reads time and memory: wall-clock on CPU, CUDA events on the stream that
ran the work, and the process's peak resident size on CPU."""
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Union

import torch

__all__: List[str] = []


# A moment: seconds from perf_counter on CPU, or a CUDA event to be read later.
Stamp = Union[float, Any]


class Clock:
    """Stamps moments on CPU or on a CUDA stream, and reads them in seconds since the start."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        # Per CUDA device: an event recorded at the origin, after a synchronize.
        self.cuda_origins: Dict[int, Any] = {}

    def stamp(self, device: torch.device) -> Stamp:
        if device.type != 'cuda':
            return time.perf_counter()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.cuda_origins:
            # The first use of a device: its events are read against this one.
            torch.cuda.synchronize(index)
            origin: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            origin.record(torch.cuda.default_stream(index))
            torch.cuda.synchronize(index)
            self.cuda_origins[index] = (origin, time.perf_counter() - self.origin)
        event: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(index))
        return event

    def seconds(self, stamp: Stamp, device: torch.device) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin
        index = device.index if device.index is not None else torch.cuda.current_device()
        origin, offset = self.cuda_origins[index]
        stamp.synchronize()
        return float(offset + origin.elapsed_time(stamp) / 1e3)


def proc_status(key: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or ``None`` where there is none."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the process's peak resident size (Linux); returns whether it could."""
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The process's peak resident size in bytes, since :func:`reset_peak_rss` where it works."""
    peak = proc_status('VmHWM')
    if peak is not None:
        return peak
    # Elsewhere: the peak since the process started (kilobytes on Linux, bytes on macOS).
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == 'darwin' else maxrss * 1024)
