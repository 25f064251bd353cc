"""Configuration of the MTP drafter (autoregressive multi-token prediction, DeepSeek-V3 MTP / EAGLE style)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict

from ..configuration_drafter import DrafterConfig

LAYOUTS = ("angelspec", "eagle3")


def engines_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """The target layers vLLM and SGLang feed an EAGLE-3 drafter whose config names none (`get_eagle3_aux_hidden_state_
    layers` / `set_eagle3_layers_to_capture` of their Llama and Qwen models): the inputs of layers 2, L // 2, L - 3,
    i.e. our (0-based output) layers 1, L // 2 - 1, L - 4."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """An EAGLE-3 drafter's default target layers: the engines' own (`engines_eagle3_layer_ids`), so that its export
    needs no layer ids; targets too shallow for that formula get three spread layers instead. The last layer is
    never used: neither engine can capture its output."""
    if num_target_layers < 4:
        raise ValueError(f"an EAGLE-3 drafter reads 3 target layers before the last; the target has {num_target_layers}")
    ids = engines_eagle3_layer_ids(num_target_layers)
    if len(set(ids)) == 3 and ids == sorted(ids):
        return ids
    last = num_target_layers - 2
    return [0, (last + 1) // 2, last]


@strict
class MTPConfig(DrafterConfig):
    r"""
    num_draft_tokens (`int`, defaults to 4):
        Tokens drafted per verification round, one drafter step each.
    layout (`str`, defaults to `"angelspec"`):
        The drafter's architecture. `"angelspec"`: the input at position t is
        `eh_proj([hnorm(h_t); enorm(embed(x_{t+1}))])` (DeepSeek-V3's MTP module), then `num_hidden_layers` Qwen3
        decoder layers (QK-norm) and a final norm. `"eagle3"`: exactly EAGLE-3's draft model as vLLM
        (`Eagle3LlamaForCausalLM`) and SGLang (`LlamaForCausalLMEagle3`) run it, so that it exports to their layout
        (`export_eagle`): `fc` fuses three target layers `[h1; h2; h3]` into one state `g`, then one Llama decoder
        layer whose attention reads `[input_layernorm(embed(x_{t+1})); hidden_norm(g)]` (2 * hidden_size wide, no
        QK-norm) with `g` as its residual, then the final norm. Chained steps feed the previous pre-norm output in
        place of `g` (no `fc`), as both engines do.
    target_layer_ids (`list[int]`):
        `"angelspec"`: exactly one target layer, by default the last. `"eagle3"`: three increasing layers before the
        last, by default the engines' own choice (`eagle3_layer_ids`).
    """

    model_type = "angelspec_mtp"

    num_draft_tokens: int = 4
    layout: str = "angelspec"

    def __post_init__(self, **kwargs):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        super().__post_init__(**kwargs)
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        ids = list(self.target_layer_ids)
        if self.layout == "angelspec" and len(ids) != 1:
            raise ValueError(f"an MTP drafter reads exactly one target layer, got target_layer_ids={ids}")
        if self.layout == "eagle3":
            # What vLLM's and SGLang's EAGLE-3 code can run (llama_eagle3.py in both): more layers are stacked
            # differently by the two engines, and SGLang's layer has no q/k/v bias.
            if self.num_hidden_layers != 1:
                raise ValueError(f"layout='eagle3' has exactly one decoder layer, got num_hidden_layers={self.num_hidden_layers}")
            if len(ids) != 3 or ids != sorted(ids):
                raise ValueError(f"layout='eagle3' reads three target layers in increasing order, got {ids}")
            if self.num_target_layers is not None and max(ids) > self.num_target_layers - 2:
                raise ValueError(f"layout='eagle3' cannot read the target's last layer ({self.num_target_layers - 1}): "
                                 f"vLLM and SGLang capture layer inputs only; got target_layer_ids={ids}")
            if self.attention_bias:
                raise ValueError("layout='eagle3' has no attention bias (SGLang's EAGLE-3 layer has none)")

    def _default_layer_ids(self) -> list[int]:
        if self.layout != "eagle3":
            return super()._default_layer_ids()
        if self.num_target_layers is None:
            raise ValueError("layout='eagle3' needs target_layer_ids (three layers) or num_target_layers")
        return eagle3_layer_ids(self.num_target_layers)

    @classmethod
    def target_defaults(cls, target_config, overrides: dict) -> dict:
        depth = target_config.num_hidden_layers
        if overrides.get("layout") == "eagle3":
            return {"num_hidden_layers": 1, "target_layer_ids": eagle3_layer_ids(depth)}
        return {"num_hidden_layers": 1, "target_layer_ids": [depth - 1]}
