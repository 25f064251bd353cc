"""angelspec-hf: lossless speculative decoding for Hugging Face causal LMs with trained drafters.

`import angelspec_hf` does two things: it registers the drafters with `AutoConfig` / `AutoModel`, and it enables the
generate() hook (`enable_generate_hook`), which wraps two methods of transformers' `GenerationMixin` for the whole
process so that `target.generate(assistant_model=drafter)` routes an AngelSpec drafter to its own candidate generator
(every other assistant falls through unchanged; see `angelspec_hf.modeling.candidate_generator`).
`disable_generate_hook()` undoes it. Constructing or loading a drafter patches nothing. It also registers the
`angelspec_sdpa` attention implementation with transformers (`angelspec_hf.attention`: SDPA, with a CPU verify forward's
grouped-query attention run without copying the KV cache).
"""

from transformers import AutoConfig, AutoModel

from angelspec_hf.modeling import (
    DRAFTERS,
    DFlashConfig,
    DFlashDrafter,
    DFlyConfig,
    DFlyDrafter,
    DrafterPreTrainedModel,
    MTPConfig,
    MTPDrafter,
    SpeculationStats,
    disable_generate_hook,
    enable_generate_hook,
    generate_hook_enabled,
    load_foreign_checkpoint,
)
from angelspec_hf.attention import GQA_SDPA_ATTENTION, use_gqa_sdpa
from angelspec_hf.cpu_kernels import prepack_linears
from angelspec_hf.targets import load_default_target, load_target

for _config_cls, _model_cls in DRAFTERS.values():
    AutoConfig.register(_config_cls.model_type, _config_cls, exist_ok=True)
    AutoModel.register(_config_cls, _model_cls, exist_ok=True)
enable_generate_hook()


def load_drafter(name_or_path, device=None, dtype=None, **kwargs) -> DrafterPreTrainedModel:
    """A drafter from a folder or Hub id: native AngelSpec, z-lab DFlash or AngelSpec DFly layout, in eval mode.
    `device`: None → the CPU (as `from_pretrained` loads), else any name `angelspec_hf.devices.resolve_device` reads
    ("auto", "cuda:1", a `torch.device`); `dtype`: None → the stored dtype, else a `torch.dtype` or a name
    (`resolve_dtype`; "auto" is float32 on the CPU, bfloat16 on CUDA). To run beside a target, pass the target's
    `device` and `dtype` (`angelspec_hf.shipped.drafter_for_target` does)."""
    from angelspec_hf.devices import resolve_device, resolve_dtype

    device = resolve_device("cpu" if device is None else device)
    if dtype is not None:
        kwargs["dtype"] = resolve_dtype(dtype, device)
    model = load_foreign_checkpoint(None, name_or_path, **kwargs)
    if model is not None:
        return model.to(device)
    if kwargs.get("local_files_only") and "adapter_kwargs" not in kwargs:
        # transformers 5.24's AutoModel.from_pretrained does not hand `local_files_only` / `cache_dir` on to its PEFT
        # adapter look-up (adapter_config.json), which then asks the Hub even so
        kwargs["adapter_kwargs"] = {k: kwargs[k] for k in ("local_files_only", "cache_dir") if k in kwargs}
    return AutoModel.from_pretrained(name_or_path, **kwargs).to(device).eval()


__version__ = "0.1.0"
__all__ = [
    "DFlashConfig", "DFlashDrafter", "DFlyConfig", "DFlyDrafter", "DrafterPreTrainedModel", "GQA_SDPA_ATTENTION",
    "MTPConfig", "MTPDrafter", "SpeculationStats", "disable_generate_hook", "enable_generate_hook",
    "generate_hook_enabled", "load_default_target", "load_drafter", "load_target", "prepack_linears", "use_gqa_sdpa",
]


def generate_batch(target, drafter, prompts, **kwargs):
    """Batched speculative generation (continuous batching + D-Cut): see `angelspec_hf.tgi_patch.engine`."""
    from angelspec_hf.tgi_patch.engine import generate_batch as _generate_batch

    return _generate_batch(target, drafter, prompts, **kwargs)


def __getattr__(name):
    """`angelspec_hf.EngineConfig`, the batched engine's settings, imported on first use (the engine needs torch
    kernels that `import angelspec_hf` does not load)."""
    if name == "EngineConfig":
        from angelspec_hf.tgi_patch.engine import EngineConfig

        return EngineConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ += ["EngineConfig", "generate_batch"]
