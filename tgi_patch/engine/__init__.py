"""The batched speculative engine, split by job (as vLLM's v1 engine is):

- `core.py`: `SpeculativeEngine`, whose `step()` orchestrates schedule → draft → D-Cut → one packed forward → verify
  → advance → record; `generate_batch`.
- `request.py`: `SamplingParams`, the running `Request`, `TokenEvent`, `StepTrace`.
- `scheduler.py`: admission, cancellation, finishing; the step's `ScheduledBatch`; advancing each request by the
  tokens verification emitted for it (stop ids, length limit).
- `model_runner.py`: the target's paged KV pool and anchors, the packed target forward, the features kept for the
  drafter, dummy-step profiling.
- `drafting.py`: `BatchDrafter`: a ragged batch drafts through the family's own `drafter.draft` (the code the
  `generate()` hook runs), over the drafter's paged KV pool.
- `config.py`: `EngineConfig`, the engine's settings (every field an `angelspec serve` flag).
- `dcut.py`: D-Cut (`DCutPolicy`): the step's kind, draft width, where n-gram lookups replace blocks, selection;
  its parts (acceptance calibration, the cost model, measured rates and back-off, `NgramIndex`) come from
  `angelspec_hf.policy`, which the `generate()` hook's policy shares.
- `verification.py`: the sampler: draft-token selection, penalised and processed target scores, batched acceptance.
- `sampling.py`: penalties, temperature / top-k / top-p, the counter-based random streams, inverse-CDF draws.
- `paged.py`: `PagedKVPool`, `RaggedStep` and the ragged attention function of the packed target forward;
  `PoolCache` / `PoolDraftCache`, the pool as a drafter's cache.
- `kernels/`: D-Cut selection and verification, the torch `reference.py` beside `triton_kernels.py`; the dispatch
  in `kernels/__init__.py`.
- `transfer.py`: `upload`, host values queued to the device without waiting for it.

Host and device: per-slot state (KV lengths, page tables, anchors, pending drafter features, D-Cut's calibration
tables) lives in device tensors updated in place, and the host keeps integer mirrors of what sizes a step (lengths,
pages owned, pending counts), so planning and allocation never read the device. A step reads the device once, for
everything the host needs of it together (`SpeculativeEngine._read`), plus once before the forward where D-Cut chose
the depths on the device (a budget, "auto", n-gram lookups); `tests/test_host_syncs.py` counts the reads per step kind.

Imports only go one way: core → config, scheduler, model_runner, dcut, verification; config → dcut; scheduler → request → sampling;
model_runner → drafting → paged; dcut, verification → kernels → sampling; any of them → transfer and
`angelspec_hf.policy` (which imports nothing of the engine). `tests/test_import_graph.py` checks that
no import cycle appears anywhere in the package.
"""

from .config import EngineConfig
from .core import GenerationFailed, SpeculativeEngine, StepKeptError, generate_batch
from angelspec_hf.policy import AcceptanceCalibrator, CostModel

from .dcut import parse_verify
from .request import (FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, SamplingParams, StepTrace,
                      TokenEvent)

__all__ = [
    "FINISH_CANCELLED", "FINISH_EOS", "FINISH_ERROR", "FINISH_LENGTH", "AcceptanceCalibrator", "CostModel",
    "EngineConfig", "GenerationFailed", "SamplingParams", "SpeculativeEngine", "StepKeptError", "StepTrace", "TokenEvent",
    "generate_batch", "parse_verify",
]
