"""The speculation policy's parts, each written once and used by both policies:

- the batched engine's D-Cut (`angelspec_hf.tgi_patch.engine.dcut.DCutPolicy`): each step, whether to draft, how
  wide, where an n-gram lookup replaces a block, and which draft tokens to verify under a budget;
- the `generate()` hook's draft length (`angelspec_hf.modeling.draft_policy.DraftLengthPolicy`): each batch-1 round,
  whether to draft and when to stop.

| concept | module |
|---|---|
| clock, hardware key, online fits, the profile cache (cached only when profiled on a quiet machine) | `costs` |
| batch-1 round costs (`RoundCosts`, `StepCost`), profiled and refined | `round_costs` |
| the engine's cost model (`CostModel`), profiled and refined | `cost_model` |
| acceptance calibration, and the two exactness rules for sampled requests | `acceptance` |
| step kinds, measured rates, back-off | `rates` |
| n-gram lookups in the request's context (`NgramIndex`) | `lookup` |
| lookups in a corpus of the target's earlier outputs (`CorpusIndex`) | `corpus` |
"""

from .acceptance import AcceptanceCalibrator, draft_confidence, plan_acceptance
from .cost_model import CostModel, load_or_profile, profile_cost_model
from .costs import (
    LinearFit,
    OnlineLeastSquares,
    OtherLoad,
    QuietWindow,
    clock,
    default_cache_dir,
    hardware_key,
    max_other_load,
    packed_linear,
    profile_cached,
)
from .corpus import CorpusIndex, GrowingCorpus
from .lookup import NgramIndex
from .rates import BackOff, MeasuredRates, StepKind
from .round_costs import RoundCosts, StepCost, load_or_profile_round_costs, profile_round_costs

__all__ = [
    "AcceptanceCalibrator", "BackOff", "CorpusIndex", "CostModel", "GrowingCorpus", "LinearFit", "MeasuredRates",
    "NgramIndex",
    "OnlineLeastSquares", "OtherLoad", "QuietWindow", "RoundCosts", "StepCost", "StepKind", "clock",
    "default_cache_dir", "draft_confidence", "hardware_key", "load_or_profile", "load_or_profile_round_costs",
    "max_other_load", "packed_linear", "plan_acceptance", "profile_cached", "profile_cost_model", "profile_round_costs",
]
