"""Host data to the device without waiting for it.

The engine plans each step on the host from integers it already knows (what it scheduled, what the previous step's
one read brought back) and sends the device what it planned: index lists, counts, per-request parameters. A plain
`torch.tensor(values, device="cuda")` copies synchronously, after everything queued before it; `upload` stages the
values in pinned memory and queues the copy (`non_blocking=True`), so the host plans on while the device works."""

from __future__ import annotations

import torch


def upload(values, device, dtype=torch.long) -> torch.Tensor:
    """Host values (a list, nested lists of equal lengths) as a tensor of `dtype` on `device`: queued through pinned
    memory off the CPU, the tensor itself on it."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
