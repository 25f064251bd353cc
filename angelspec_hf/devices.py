"""Device and dtype choice for every loader and command (`--device`, `--dtype`).

`resolve_device(None | "auto")` is CUDA when this torch sees a GPU, else the CPU; `resolve_dtype(None | "auto", device)`
is float32 on the CPU and bfloat16 on CUDA (float16 on a GPU without bf16). A device that is not there, or a dtype
name that is not one of `DTYPES`, raises `DeviceError` (a `ValueError`) whose message names the flag, so the commands
print it and exit non-zero without a traceback. Timers wait for the device with
`angelspec_hf.modeling.draft_policy.clock(device)`.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DeviceError", "add_device_arguments", "describe_device", "resolve_device", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class DeviceError(ValueError):
    """A `--device` / `--dtype` that cannot be used on this machine (the message says why)."""


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return "torch.cuda.is_available() is False; this torch is a CPU build"
    return f"torch.cuda.is_available() is False; this torch is built for CUDA {torch.version.cuda} but sees no GPU"


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """The device `name` names: None / "auto" → "cuda" when a GPU is visible, else "cpu"; "cpu", "cuda", "cuda:1",
    "mps", "xpu", ... as `torch.device` reads them. Raises `DeviceError` for a malformed name or a device this
    machine does not have."""
    if name is None or (isinstance(name, str) and name.strip().lower() == "auto"):
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name.strip() if isinstance(name, str) else name)
    except (RuntimeError, TypeError) as error:
        raise DeviceError(f"--device {name}: not a device name (auto, cpu, cuda, cuda:N, ...): {error}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name}: no CUDA device is available ({_no_cuda_reason()})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
    elif device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        available = getattr(backend, "is_available", None)
        if device.type == "mps":
            available = torch.backends.mps.is_available
        if available is None or not available():
            raise DeviceError(f"--device {name}: no {device.type} device is available to this torch")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """The dtype `name` names (`DTYPES`: float32/fp32, bfloat16/bf16, float16/fp16, or a `torch.dtype`); None / "auto"
    → float32 on the CPU (and other non-CUDA devices), bfloat16 on CUDA (float16 where the GPU has no bf16).
    Raises `DeviceError` for any other name."""
    if isinstance(name, torch.dtype):
        if not name.is_floating_point:
            raise DeviceError(f"--dtype {name}: a model dtype must be a floating-point type")
        return name
    if name is None or name.strip().lower() == "auto":
        device = resolve_device(device)
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    dtype = DTYPES.get(name.strip().lower().removeprefix("torch."))
    if dtype is None:
        raise DeviceError(f"--dtype {name}: choose one of auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)")
    return dtype


def add_device_arguments(parser) -> None:
    """`--device` and `--dtype` on a command that loads a model (resolved by `angelspec_hf.cli.main`)."""
    parser.add_argument("--device", default="auto",
                        help="where the models run: auto (cuda when a GPU is visible, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto",
                        help="the target's (and drafter's) dtype: auto (float32 on cpu, bfloat16 on cuda), float32 "
                             "(fp32), bfloat16 (bf16), float16 (fp16)")


def describe_device(device) -> str:
    """`device` for a results header: "x86_64 CPU" or "cuda:0 (NVIDIA H200)"."""
    import platform

    device = torch.device(device)
    if device.type == "cpu":
        return f"{platform.machine()} CPU"
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
