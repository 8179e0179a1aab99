"""The norm of a pipeline's gradients over its ranks, bit for bit torch's on the unwrapped
module: one all-reduce fills a slot per parameter, written by the one rank counting it
(zeros elsewhere, so the sum is exact); every rank takes the norm of the same vector."""
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._foreach_utils import (_device_has_foreach_support,
                                        _group_tensors_by_device_and_dtype,
                                        _has_foreach_support)

__all__: List[str] = []

#: The dtypes a gradient's norm may have, by the code its slot carries (0: no gradient).
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def slots(module: nn.Module) -> Dict[str, int]:
    """The slot of every parameter name of ``module``: its place in ``module.parameters()``."""
    places: Dict[int, int] = {}
    for p in module.parameters():
        places.setdefault(id(p), len(places))
    return {name: places[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def norms_of(grads: Sequence[Tensor], norm_type: float, foreach: Optional[bool]) -> List[Tensor]:
    """The norm of each of ``grads``, computed as :func:`torch.nn.utils.clip_grad_norm_` does."""
    norms: List[Optional[Tensor]] = [None] * len(grads)
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([maybe], indices) in grouped.items():
        tensors = cast(List[Tensor], maybe)
        if (foreach is None and _has_foreach_support(tensors, device)) or \
                (foreach and _device_has_foreach_support(device)):
            found = list(torch._foreach_norm(tensors, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was given, but torch has no foreach kernels for "
                               f"{device.type} tensors: give foreach=None or False")
        else:
            found = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        for index, norm in zip(indices, found):
            norms[index] = norm
    return [n for n in norms if n is not None]


def in_torch_order(norms: List[Tensor]) -> List[Tensor]:
    """``norms`` grouped by dtype, as :func:`torch.nn.utils.clip_grad_norm_` stacks them."""
    grouped = _group_tensors_by_device_and_dtype(
        [[torch.empty(0, dtype=n.dtype) for n in norms]], with_indices=True)
    return [norms[i] for _, (_, indices) in grouped.items() for i in indices]


@torch.no_grad()
def total_norm(counted: Sequence[Tuple[int, Tensor]], size: int, norm_type: float,
               device: torch.device, group: Optional[dist.ProcessGroup],
               foreach: Optional[bool] = None) -> Tensor:
    """The norm (zero-dimensional, on ``device``) of every rank's gradients, each of
    ``counted`` with its slot out of ``size``, the same on every rank."""
    vector = torch.zeros(2, size, dtype=torch.float64, device=device)
    if counted:
        places, grads = zip(*counted)
        norms = norms_of(grads, norm_type, foreach)
        where = torch.tensor(places, device=device)
        vector[0, where] = torch.stack([n.to(device, torch.float64) for n in norms])
        vector[1, where] = torch.tensor([DTYPES.index(n.dtype) + 1.0 for n in norms],
                                        dtype=torch.float64, device=device)
    dist.all_reduce(vector, group=group)
    present = vector[1] > 0
    values, codes = vector[0, present], (vector[1, present] - 1).long().tolist()
    if not codes:
        return torch.tensor(0.0, device=device)
    if len(set(codes)) == 1:  # the usual case: the stack of the norms, as they were
        stacked = values.to(DTYPES[codes[0]])
    else:
        stacked = torch.stack(in_torch_order([v.to(DTYPES[c]) for v, c in zip(values, codes)]))
    total: Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


@torch.no_grad()
def clip_grads(grads: Iterable[Tensor], max_norm: float, total: Tensor) -> None:
    """Scales ``grads`` in place as :func:`torch.nn.utils.clip_grad_norm_` does given ``total``."""
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.device))


def check_finite(total: Tensor, norm_type: float) -> None:
    """Raises as :func:`torch.nn.utils.clip_grad_norm_` does with ``error_if_nonfinite=True``."""
    if not bool(torch.isfinite(total)):
        raise RuntimeError(f'the total norm of order {norm_type} of the gradients is '
                           f'{float(total)}, which cannot be clipped; give '
                           'error_if_nonfinite=False to scale the gradients by it anyway')
