"""Batched speculative decoding: the continuous-batching engine with D-Cut adaptive verification (`engine.py`), its
paged KV store and ragged attention (`paged.py`), batched drafting (`drafting.py`), calibration and cost model
(`dcut.py`), and the hot steps as Triton kernels with torch references (`triton_kernels.py`, `reference.py`)."""
