"""What both cost models share: the device-aware clock, the key of the hardware a profile applies to, online
least-squares fits that start from a profile and follow the steps actually timed, and the profile cache (atomic JSON
files under `default_cache_dir()`, written only when the machine was quiet while the profile was taken)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from angelspec_hf.attention import GQA_SDPA_ATTENTION

logger = logging.getLogger(__name__)


def clock(device=None) -> float:
    """`time.perf_counter()` once the work already queued on `device` has run. CUDA and other accelerators run kernels
    asynchronously, so a timer read right after a forward returns measures the launches, not the work; on the CPU (and
    for `None`) this is `perf_counter()` itself."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type not in ("cpu", "meta"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.accelerator.synchronize(device)
    return time.perf_counter()


def packed_linear(module) -> bool:
    """Whether `module` is a linear layer reading oneDNN-prepacked weights (`angelspec_hf.cpu_kernels.PrepackedLinear`,
    recognised by its attributes)."""
    return bool(getattr(module, "packed_for_cpu", False) and getattr(module, "enabled", True))


def _prepacked(model) -> bool:
    return any(packed_linear(m) for m in model.modules())


def _packed_by(model, library: str) -> bool:
    """Whether `model` has linears reading weights packed by `library` (`PrepackedLinear.library`: "mkl", "stream")."""
    return any(getattr(m, "library", None) == library and getattr(m, "enabled", True) for m in model.modules())


def hardware_key(model, drafter=None) -> str:
    """Which measured costs apply: the models' configs and dtypes, the device, the CPU threads, the linear kernels (a
    model whose linears read weights packed by oneDNN, MKL or the weight-streaming kernel has costs of its own) and the
    target's attention where it is `angelspec_sdpa` (its verify forwards cost less). 16 hex digits."""
    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    parts = [model.config.to_json_string(use_diff=False), str(model.dtype), str(device.type), name,
             str(torch.get_num_threads()), torch.__version__]
    if drafter is not None:
        parts += [drafter.config.to_json_string(use_diff=False), str(drafter.dtype)]
    packed = [m for m in (model, drafter) if m is not None and _prepacked(m)]
    if packed:  # only then, so the keys of stock models (and their cached files) stay as they were
        parts.append("prepacked:" + ",".join("target" if m is model else "drafter" for m in packed))
        if drafter is not None and model in packed and getattr(drafter.config, "draft_vocab_size", None):
            parts.append("pruned draft head prepacked")  # drafting got cheaper: costs measured before do not apply
    for library in ("mkl", "stream"):
        users = [m for m in (model, drafter) if m is not None and _packed_by(m, library)]
        if users:
            parts.append(f"{library}-packed:" + ",".join("target" if m is model else "drafter" for m in users))
    if getattr(model.config, "_attn_implementation", None) == GQA_SDPA_ATTENTION:
        parts.append(f"attention:{GQA_SDPA_ATTENTION}")  # appended only then: other keys stay as they were
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# ---- fits ----------------------------------------------------------------------------------------------------------
class OnlineLeastSquares:
    """`y ≈ features · coef` by exponentially weighted least squares (× `decay` per observation: recent ones count
    most), started from prior pseudo-observations (`prior_x` rows with values `prior_y`, worth `prior_weight`
    observations in all) whose weight fades × `prior_fade` per observation down to `min_prior` of it. Early
    observations then never give wild coefficients, a stale prior does not linger, and directions the data never vary
    along (e.g. every step of a batch at one size) keep the prior's slope as long as `min_prior` > 0."""

    def __init__(self, prior_x, prior_y, prior_weight: float = 4.0, decay: float = 0.99, prior_fade: float = 0.9,
                 min_prior: float = 0.0):
        x = torch.tensor(prior_x, dtype=torch.float64)
        y = torch.tensor(prior_y, dtype=torch.float64)
        w = prior_weight / len(x)
        self.prior_xx, self.prior_xy = w * x.T @ x, w * x.T @ y
        self.xx, self.xy = torch.zeros_like(self.prior_xx), torch.zeros_like(self.prior_xy)
        self.decay, self.prior_fade, self.min_prior = decay, prior_fade, min_prior
        self.prior_scale, self.count = 1.0, 0

    def add(self, x, y: float) -> None:
        x = torch.tensor(x, dtype=torch.float64)
        self.xx = self.xx * self.decay + torch.outer(x, x)
        self.xy = self.xy * self.decay + x * float(y)
        self.prior_scale = max(self.prior_scale * self.prior_fade, self.min_prior)
        self.count += 1

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(XᵀWX, XᵀWy)` of the data and the prior together."""
        return self.xx + self.prior_scale * self.prior_xx, self.xy + self.prior_scale * self.prior_xy

    @property
    def coef(self) -> tuple[float, ...]:
        xx, xy = self.moments()
        return tuple(torch.linalg.lstsq(xx, xy[:, None]).solution[:, 0].tolist())


class LinearFit(OnlineLeastSquares):
    """`y ≈ a + b·x` (`OnlineLeastSquares` of the features `(1, x)`), its prior a line through x = 1 and x =
    `prior_span`; the slope is never negative (a cost never falls with more tokens)."""

    def __init__(self, a: float, b: float, prior_weight: float = 4.0, prior_span: float = 8.0, decay: float = 0.99,
                 prior_fade: float = 0.9):
        super().__init__([[1.0, 1.0], [1.0, prior_span]], [a + b, a + b * prior_span], prior_weight, decay,
                         prior_fade)

    def add(self, x: float, y: float) -> None:
        super().add([1.0, float(x)], y)

    @property
    def coef(self) -> tuple[float, float]:
        xx, xy = self.moments()
        (n, sx), (_, sxx) = xx.tolist()
        sy, sxy = xy.tolist()
        det = n * sxx - sx * sx
        b = max((n * sxy - sx * sy) / det if det > 1e-12 else 0.0, 0.0)
        return (sy - b * sx) / n, b

    def __call__(self, x: float) -> float:
        a, b = self.coef
        return max(a + b * x, 1e-6)


# ---- the profile cache -----------------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """Where measured cost models are cached: `$ANGELSPEC_COST_MODELS`, else `$ANGELSPEC_CACHE/cost_models` (default
    `~/.cache/angelspec/cost_models`)."""
    if os.environ.get("ANGELSPEC_COST_MODELS"):
        return Path(os.environ["ANGELSPEC_COST_MODELS"])
    return Path(os.environ.get("ANGELSPEC_CACHE", Path.home() / ".cache" / "angelspec")) / "cost_models"


def read_profile(path: Path, parse):
    """`parse(json of path)`, or None when the file is absent, damaged or `parse` rejects it (ValueError, KeyError,
    TypeError): a profile that cannot be read is measured again."""
    if not path.is_file():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None


def write_profile(path: Path, data: dict) -> bool:
    """Write `data` to `path` atomically (a concurrent reader sees the old file or the new one). False when the cache
    cannot be written: it is an optimisation, and a read-only one keeps its old profile."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        return True
    except OSError:
        return False


class OtherLoad:
    """A context manager measuring how many CPU cores *other* processes kept busy while its block ran (`cores`): the
    machine's busy time (`/proc/stat`) less this process's own CPU time, over the wall time. `cores` is None where
    `/proc/stat` does not exist."""

    def __init__(self):
        self.cores: float | None = None

    @staticmethod
    def _busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_seconds() -> float:
        t = os.times()
        return t.user + t.system

    def __enter__(self) -> OtherLoad:
        self._start = (time.perf_counter(), self._busy_seconds(), self._own_seconds())
        return self

    def __exit__(self, *exc) -> None:
        wall0, busy0, own0 = self._start
        busy1, wall = self._busy_seconds(), time.perf_counter() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            self.cores = max(busy1 - busy0 - (self._own_seconds() - own0), 0.0) / wall


def max_other_load() -> float:
    """The CPU cores other processes may keep busy while a CPU profile is taken for it still to be cached:
    `$ANGELSPEC_PROFILE_MAX_OTHER_LOAD` (a float; `inf` caches every profile), default 0.5."""
    value = os.environ.get("ANGELSPEC_PROFILE_MAX_OTHER_LOAD", "0.5")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"ANGELSPEC_PROFILE_MAX_OTHER_LOAD must be a number, got {value!r}") from None


class QuietWindow:
    """Whether other processes stayed off the CPU since the window (re)started: `quiet()` closes the window (at most
    `max_other_load()` cores kept busy by others, or not on the CPU, or no `/proc/stat`) and starts the next. Refined
    costs are written back to a profile's cache only after a quiet window, for the reason `profile_cached` caches
    only quiet profiles."""

    def __init__(self, device="cpu"):
        self.cpu = torch.device(device).type == "cpu"
        self.cores: float | None = None  # the last closed window's
        self._load = OtherLoad().__enter__()

    def quiet(self) -> bool:
        self._load.__exit__(None, None, None)
        self.cores = self._load.cores
        self._load = OtherLoad().__enter__()
        return not self.cpu or self.cores is None or self.cores <= max_other_load()


def profile_cached(path: Path, parse, profile, device, to_dict) -> tuple[object, bool]:
    """The profile cached at `path` (`parse`d), else `profile()` measured now and cached (`to_dict`). A CPU profile
    measured while other processes kept more than `max_other_load()` cores busy is used but not cached: its costs are
    those of a busy machine, and a cached one would mislead every later run (it heals only as slowly as the online
    refinement replaces it). Returns `(profile, cached)`: `cached` is whether it is (now) on disk, i.e. whether
    refined costs may be written back to `path`."""
    found = read_profile(path, parse)
    if found is not None:
        return found, True
    with OtherLoad() as load:
        measured = profile()
    busy = torch.device(device).type == "cpu" and load.cores is not None and load.cores > max_other_load()
    if busy:
        logger.warning("other processes kept %.1f CPU cores busy while the cost profile was measured: it is used for "
                       "this run only, not cached (%s)", load.cores, path)
        return measured, False
    data = to_dict(measured)
    if load.cores is not None and math.isfinite(load.cores):
        data["other_load_cores"] = round(load.cores, 3)
    return measured, write_profile(path, data)
