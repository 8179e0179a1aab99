"""The plain ``nn.Sequential`` behind a GPipe: the bodies of :meth:`GPipe.load_state_dict
<torchgpipe.GPipe.load_state_dict>` (either key style) and :meth:`GPipe.unwrap
<torchgpipe.GPipe.unwrap>`."""
import copy
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Mapping, Optional, cast

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from torchgpipe.foundation.validation import Device, check_available, parse_device
from torchgpipe.runtime.batchnorm import restore_batch_norm

__all__: List[str] = []


def load_state_dict(module: nn.Module, partitions: List[nn.Sequential],
                    state_dict: Mapping[str, Any],
                    load: Callable[[Mapping[str, Any]], Any]) -> _IncompatibleKeys:
    """Loads ``state_dict`` into the GPipe ``module`` in whichever key style it has
    (``partitions.<j>.<child>...`` or ``<child>...``), reporting keys in that style; ``load``
    is the base classes' loading, with the caller's ``strict`` and ``assign``."""
    # The child names are unique across partitions: each names its partition.
    partition_of = {name: j for j, partition in enumerate(partitions)
                    for name in partition._modules}

    def in_gpipe_style(key: str) -> Optional[str]:
        # The module path of metadata keys has no parameter name: '0'.
        child = key.split('.', 1)[0]
        return f'partitions.{partition_of[child]}.{key}' if child in partition_of else None

    def is_own(key: str) -> bool:
        parts = key.split('.', 3)
        return (len(parts) > 2 and parts[0] == 'partitions'
                and str(partition_of.get(parts[2])) == parts[1])

    if any(map(is_own, state_dict)) or not any(map(in_gpipe_style, state_dict)):
        return cast(_IncompatibleKeys, load(state_dict))

    # Keys of no child stay as they are, to be reported unexpected.
    renamed = {key: in_gpipe_style(key) or key for key in state_dict}
    translated: Any = OrderedDict((renamed[key], value) for key, value in state_dict.items())
    metadata = getattr(state_dict, '_metadata', None)
    if metadata is not None:
        # The versions of the layers, which BatchNorm's loading reads.
        translated._metadata = OrderedDict(
            (in_gpipe_style(path) or path, value) for path, value in metadata.items())
    given = {new: old for old, new in renamed.items()}

    def report_in_given_style(_: nn.Module, keys: _IncompatibleKeys) -> None:
        # Every missing key is one of ours: 'partitions.<j>.<child name>...'.
        keys.missing_keys[:] = [key.split('.', 2)[2] for key in keys.missing_keys]
        keys.unexpected_keys[:] = [given.get(key, key) for key in keys.unexpected_keys]

    hook = module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
        report_in_given_style)
    try:
        return cast(_IncompatibleKeys, load(translated))
    finally:
        hook.remove()


def unwrap(partitions: List[nn.Sequential], training: bool,
           device: Optional[Device]) -> nn.Sequential:
    """The partitions' layers, copied into one ``nn.Sequential`` on ``device`` (the CPU if None).

    Raises:
        TypeError: ``device`` is not a device
        ValueError: ``device`` is a CUDA device that does not exist here
    """
    if device is None:
        target = torch.device('cpu')
    else:
        target = parse_device('device', device,
                              "use a device such as device='cpu' or device='cuda:0'")
        check_available('device', target, "unwrap on the CPU with device='cpu'")

    # One memo for all layers keeps what they share shared.
    memo: Dict[int, Any] = {}
    layers: 'OrderedDict[str, nn.Module]' = OrderedDict()
    for partition in partitions:
        for name, layer in partition.named_children():
            # One layer's copy at a time on its device; one memo keeps ties tied.
            layers[name] = copy.deepcopy(layer, memo).to(target)

    module = nn.Sequential(layers)
    # Not train(): each layer keeps its own mode.
    module.training = training
    return cast(nn.Sequential, restore_batch_norm(module))
