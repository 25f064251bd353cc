"""`ServeConfig`: every setting of `angelspec serve` as one typed, validated, frozen dataclass, from which
`angelspec_hf.tgi_patch.server.build_app` builds the whole server (target, drafter, engine, app).

The settings are the model (`target`, `drafter`, `device`, `dtype`, `linear_kernels`, `threads`), where to listen
(`host`, `port`), TGI's request limits (`max_input_tokens`, `max_total_tokens`, `max_concurrent_requests`, ...) and the
engine's own settings (`engine: EngineConfig`). Every field, the engine's included, is an `angelspec serve` flag with
the field's help (`angelspec_hf.cli.add_config_arguments`). Importing this module needs neither the serve extra nor a
model.

    config = ServeConfig(drafter="dfly", port=8080, engine=EngineConfig(verify="depth:3", max_batch_size=8))
    app, engine = build_app(config)  # then `serve(app, config.host, config.port)`
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from angelspec_hf.cpu_kernels import KERNELS
from angelspec_hf.tgi_patch.engine.config import EngineConfig, check_fields

# the fields `create_app` reads (the rest say what to load and where to listen)
APP_LIMITS = ("max_input_tokens", "max_total_tokens", "max_concurrent_requests", "max_stop_sequences",
              "max_stop_length", "max_payload_bytes", "max_client_batch_size", "graceful_shutdown_s")


@dataclass(frozen=True)
class ServeConfig:
    """The settings of `angelspec serve`. Invalid values raise `ValueError` naming the field, when the config is
    built. `build_app` clamps the token limits to what the target and the engine take."""

    target: str | None = field(default=None, metadata={"help": (
        "HF id or folder (default: the embedded SmolLM2-135M-Instruct)")})
    drafter: str = field(default="dfly", metadata={"help": (
        "mtp | dflash | dfly (the shipped one; n-gram lookup where none fits the target) | untrained[:FAMILY] (for "
        "experiments) | none | a drafter folder/id")})
    lookup_corpus: str | None = field(default=None, metadata={"help": (
        "a lookup corpus for the drafter's lookups to look in beside each request's context (lookups turned on "
        "where neither the drafter nor --lookup-tokens sets them): a lookup_corpus.safetensors, a drafter folder "
        "holding one, or a folder of the target's regenerated replies (`angelspec regenerate`'s output); none: "
        "the context alone (default: the drafter's own, from its folder)")})
    device: str = field(default="auto", metadata={"help": (
        "where the models run: auto (cuda when a GPU is visible, else cpu), cpu, cuda, cuda:N")})
    dtype: str = field(default="auto", metadata={"help": (
        "the target's (and drafter's) dtype: auto (float32 on cpu, bfloat16 on cuda), float32 (fp32), bfloat16 "
        "(bf16), float16 (fp16)")})
    linear_kernels: str = field(default="auto", metadata={"choices": KERNELS, "help": (
        "prepacked: the fp32 CPU linears read oneDNN-prepacked weights (CPU only); stock: torch's F.linear; auto: on "
        "the CPU whichever of the two runs the target's steps faster on this machine (timed at start, ~1 s), "
        "elsewhere stock")})
    threads: int = field(default=min(2, os.cpu_count() or 1), metadata={"min": 1, "help": "torch CPU threads"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8080, metadata={"min": 0, "help": "port to listen on (0: any free port)"})
    max_concurrent_requests: int = field(default=128, metadata={"min": 1, "help": (
        "requests admitted at once, running or queued for a slot; beyond this: 429 overloaded")})
    max_input_tokens: int = field(default=1024, metadata={"min": 1, "help": (
        "prompt tokens per request (at most --max-total-tokens - 1 and --max-prefill-tokens)")})
    max_total_tokens: int = field(default=2048, metadata={"min": 2, "help": (
        "prompt + new tokens per request (at most the target's max_position_embeddings)")})
    max_stop_sequences: int = field(default=4, metadata={"min": 0, "help": "stop strings per request"})
    max_stop_length: int = field(default=256, metadata={"min": 1, "help": "characters per stop string"})
    max_payload_bytes: int = field(default=2_000_000, metadata={"min": 1, "flags": ("--payload-limit",), "help": (
        "request body bytes; larger: 413 (TGI's --payload-limit)")})
    max_client_batch_size: int = field(default=4, metadata={"min": 1, "help": "prompts per /v1/completions request"})
    graceful_shutdown_s: float = field(default=30.0, metadata={"min": 0, "help": (
        "on shutdown, seconds open streams get to finish before they are cut")})
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": (
        "continuous batching, D-Cut verification, KV pools, n-gram lookups")})

    def __post_init__(self):
        check_fields(self)
        if self.port > 65535:
            raise ValueError(f"port must be at most 65535, got {self.port}")
        if self.linear_kernels not in KERNELS:
            raise ValueError(f"linear_kernels must be one of {', '.join(KERNELS)}, got {self.linear_kernels!r}")

    @property
    def app_limits(self) -> dict:
        """The keyword arguments of `create_app` this config sets."""
        return {name: getattr(self, name) for name in APP_LIMITS}
