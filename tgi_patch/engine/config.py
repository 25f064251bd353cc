"""`EngineConfig`: every setting of `SpeculativeEngine` as one typed, validated, frozen dataclass.

Each field has a default and a help text (`field(metadata={"help": ...})`); `angelspec serve` turns every field into a
command-line flag (`angelspec_hf.cli.add_config_arguments`), so the flags, their help and the engine's defaults are one
list. Runtime objects (a `CostModel`, an `AcceptanceCalibrator`) are not settings: `SpeculativeEngine` takes them as
keyword arguments of their own.

    config = EngineConfig(verify="depth:3", max_batch_size=8)
    engine = SpeculativeEngine(target, drafter, config)
    engine = SpeculativeEngine(target, drafter, config, lookup_tokens=0)  # a keyword overrides the config's field
"""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from .dcut import parse_verify  # the one parser of verification modes


def check_fields(config) -> None:
    """Raises `ValueError` naming the first field of the dataclass `config` whose value is not of its annotated type
    (an `int` field refuses a bool or a float; a `float` field takes an int) or is outside its `metadata["min"]` and
    `metadata["max"]`.
    None passes where the annotation allows it (it means the default)."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, allowed = getattr(config, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if value is None and type(None) in allowed:
            continue
        if not any(_is_a(value, kind) for kind in allowed):
            names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in allowed)
            raise ValueError(f"{f.name} must be {names}, got {value!r}")
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if low is not None and value < low:
            raise ValueError(f"{f.name} must be at least {low}, got {value}")
        if high is not None and value > high:
            raise ValueError(f"{f.name} must be at most {high}, got {value}")


def _is_a(value, kind) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is Path:
        return isinstance(value, os.PathLike)
    return isinstance(value, kind) if isinstance(kind, type) else True


@dataclass(frozen=True)
class EngineConfig:
    """The settings of the batched speculative engine (`SpeculativeEngine`). Invalid values raise `ValueError`
    naming the field, when the config is built."""

    verify: str | int = field(default="auto", metadata={"help": (
        "auto: D-Cut, the verification budget that maximises expected tokens per second under the profiled cost "
        "model, backing off to plain steps where speculation does not pay | N or budget:N: N draft tokens verified "
        "per step, shared by the batch | depth:K: up to K per request | full: every request's whole block")})
    max_batch_size: int = field(default=32, metadata={"min": 1, "help": "requests decoded together (engine slots)"})
    max_prefill_tokens: int = field(default=4096, metadata={"min": 1, "help": (
        "prompt tokens prefilled per step; also the longest prompt the engine accepts")})
    kv_cache_tokens: int | None = field(default=None, metadata={"min": 1, "help": (
        "tokens the target's and the drafter's KV pools hold before they grow (default: 1024 per "
        "--max-batch-size); reserved, not written: on the CPU memory is used as tokens are held, on a GPU it is "
        "allocated up front")})
    lookup_tokens: int | None = field(default=None, metadata={"min": 0, "help": (
        "draft tokens an n-gram lookup of a request's own context may propose in place of the drafter's block; "
        "0: no lookups (default: the drafter config's lookup_tokens)")})
    corpus_window_tokens: int = field(default=0, metadata={"min": 0, "max": 1 << 20, "help": (
        "with lookups on: grow the lookup corpus with the replies served, each finished request's prompt tail and "
        "reply, the last this many tokens of them looked up beside the drafter's corpus (SuffixDecoding-style; "
        "0: off; at most 1,048,576). A request's speed then depends on what earlier requests generated: leave it "
        "off where clients must not learn about each other's traffic")})
    probe_every: int = field(default=8, metadata={"min": 1, "help": (
        "auto: steps a back-off to plain decoding lasts before drafting is tried again (doubling while it keeps "
        "losing, up to 8x)")})
    measure_rates: bool = field(default=True, metadata={"help": (
        "auto: back off to plain steps when the speculative steps measured at a batch size delivered fewer tokens "
        "per second than plain ones (off: decisions do not depend on this machine's timing)")})
    early_stop_drafting: bool | None = field(default=None, metadata={"help": (
        "auto: stop drafting at the first position no request could have verified, which reads the device once "
        "per drafted position (default: on the CPU only)")})
    isolate_faults: bool = field(default=True, metadata={"help": (
        "a step that raises is retried without the requests it fails for, which finish with "
        "finish_reason=error (off: the exception propagates)")})
    cost_model_cache: str | Path | None = field(default=None, metadata={"metavar": "DIR", "help": (
        "auto: folder of profiled cost models (default: $ANGELSPEC_COST_MODELS, else "
        "$ANGELSPEC_CACHE/cost_models, else ~/.cache/angelspec/cost_models)")})

    def __post_init__(self):
        check_fields(self)
        parse_verify(self.verify)
