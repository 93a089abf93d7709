"""A step's metrics read back from the device to the host at once."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def read_back(metrics: dict[str, list]) -> dict[str, list[float]]:
    """The metrics as floats, every tensor among them read back to the host in one transfer per device: on a
    GPU each read is a sync that stalls the host until the device is done, so one per metric and micro-batch
    (about 40 a PPO step) left the GPU idle between launches."""
    tensors = [(key, k, value.full_tensor() if isinstance(value, DTensor) else value)
               for key, values in metrics.items() for k, value in enumerate(values) if isinstance(value, torch.Tensor)]
    out = {key: [float(v) if not isinstance(v, torch.Tensor) else None for v in values] for key, values in metrics.items()}
    for device in {value.device for _, _, value in tensors}:
        mine = [(key, k, value) for key, k, value in tensors if value.device == device]
        for (key, k, _), number in zip(mine, torch.stack([v.float().reshape(()) for _, _, v in mine]).tolist()):
            out[key][k] = number
    return out
