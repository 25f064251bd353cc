"""Batched speculative decoding, in two packages:

- `engine/`: the continuous-batching speculative engine with D-Cut adaptive verification, split by job: scheduler
  (`scheduler.py`), model runner (`model_runner.py`: the packed target forward over a paged KV store, `paged.py`),
  batched drafting (`drafting.py`), D-Cut calibration, cost model and policy (`dcut.py`), sampling and verification
  (`verification.py`, `sampling.py`), and the hot steps as Triton kernels beside their torch references
  (`kernels/triton_kernels.py`, `kernels/reference.py`). `SpeculativeEngine` and `generate_batch` are its API.
- `server/`: the TGI-protocol HTTP server on the engine: wire format (`protocol.py`), errors (`errors.py`), text
  (`text.py`: incremental detokenisation, stop strings), the engine's worker thread (`worker.py`), Prometheus metrics
  (`metrics.py`), validation and responses (`serving.py`) and the FastAPI app (`app.py`: `create_app`, `serve`).

The engine knows nothing of the server; the server reaches the engine only through its public API."""
