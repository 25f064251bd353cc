"""`angelspec_sdpa`: transformers' SDPA attention, with a speculative verify's grouped-query attention run in place.

A target with grouped-query attention (SmolLM2-135M: 9 query heads over 3 key/value heads) verifies a draft in one
forward of several query rows, under a 4-D causal mask. For that case transformers' SDPA path copies each layer's
keys and values once per query head of a group (`repeat_kv`) before calling SDPA, because on CUDA a mask with
`enable_gqa=True` would send SDPA to its slow math kernel. On the CPU it does not: the flash kernel takes the mask and
the grouped heads together. So every verify forward on the CPU copies every layer's cached keys and values into
tensors three times their size, a cost that grows with the context (on a 2-core Xeon, 4-8 ms of a 68-72 ms verify
with 256 tokens cached, 11-16 ms of an 82-98 ms one with 1,024: docs/benchmarks.md, "Grouped-query attention in the
verify forward").

`gqa_sdpa_attention` is registered under `GQA_SDPA_ATTENTION` with transformers' `AttentionInterface` (and SDPA's mask
function with `AttentionMaskInterface`). On the CPU, for a module with grouped heads, a query of more than one row and
a mask, it calls SDPA with `enable_gqa=True` on the keys and values as they are; every other call (one-row decode
steps, prefills without a mask, other devices, dropout, extra arguments) is transformers' `sdpa_attention_forward`
itself. SDPA reads the same numbers either way: the outputs are bit for bit those of `sdpa` (tested), so a target
switched to it decodes exactly as before, only its multi-row forwards cost less.

`use_gqa_sdpa(model)` switches a model that runs `sdpa` to it; `angelspec_hf.load_target` and the `generate()` hook
(for a CPU target) do so. Any model loads with it directly: `from_pretrained(..., attn_implementation="angelspec_sdpa")`
after `import angelspec_hf`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA_ATTENTION = "angelspec_sdpa"

__all__ = ["GQA_SDPA_ATTENTION", "gqa_sdpa_attention", "use_gqa_sdpa"]


def _grouped_in_place(module, query, key, value, attention_mask, dropout, kwargs) -> bool:
    """Whether this call is the case `gqa_sdpa_attention` runs itself (see the module docstring)."""
    return (getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and attention_mask is not None
            and query.device.type == "cpu" and not dropout and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False))


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' SDPA attention (`sdpa_attention_forward`: query `[B, H, q, D]`, key/value `[B, Hkv, kv, D]`,
    returns `([B, q, H, D], None)`), with a CPU query of several rows under a mask attending to the grouped
    key/value heads inside SDPA instead of through per-head copies."""
    if not _grouped_in_place(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # what sdpa_attention_forward does here (a mask: not causal, nothing cropped), minus repeat_kv
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA_ATTENTION, gqa_sdpa_attention)
AttentionMaskInterface.register(GQA_SDPA_ATTENTION, sdpa_mask)


def use_gqa_sdpa(model) -> bool:
    """Switch `model` (a transformers model) from `sdpa` to `angelspec_sdpa`; True when it runs `angelspec_sdpa` now.
    Left as it is: a model on another attention implementation (eager, flash, the batched engine's), one whose
    attention does not go through `AttentionInterface` (`is_backend_compatible()` false), and one with sub-models
    (a vision tower may not take it)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if (current == "sdpa" and not getattr(config, "sub_configs", None)
            and getattr(model, "is_backend_compatible", lambda: False)()):
        try:
            model.set_attn_implementation(GQA_SDPA_ATTENTION)
        except (ValueError, ImportError):  # refused: it keeps transformers' SDPA, which computes the same
            return False
        current = config._attn_implementation
    return current == GQA_SDPA_ATTENTION
