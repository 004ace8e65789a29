"""The model families the engine serves, each registered once: no family is a branch elsewhere.

A :class:`ModelFamily` names what the engine needs of a family -- which models are its
(a preset name or a checkpoint directory), its config read from the name alone, its model
class, its loader entry point, its step-cost model, its KV layout -- and the function that
builds an engine's parts for one of its models. :data:`FAMILIES` lists them, the first that
claims a model serves it; :func:`build_parts` is the one factory every engine goes through.

Adding a family is one entry here and its own package (as ``v4/``); the engine, its scheduler
and the services do not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cost_model import CostModel
from .features import check
from .hub import resolve_model
from .kv.layout import CacheSpec, mla_cache_spec
from .loader import LoadedModel, load, model_config
from .model.model import DeepseekForCausalLM
from .parts import EngineParts
from .v3_parts import v3_parts
from .v4.cost import v4_cost_model
from .v4.load import is_v4, load_v4, v4_config
from .v4.model import V4ForCausalLM
from .v4.serving import build_v4_parts, v4_cache_spec

if TYPE_CHECKING:
    from .engine_config import EngineConfig
    from .ep.group import EPGroup
    from .ep.placement import Placement

    PartsBuilder = Callable[
        [EngineConfig, LoadedModel | None, EPGroup | None, Placement | None], EngineParts
    ]


@dataclass(frozen=True)
class ModelFamily:
    """One model family as the engine meets it (module doc)."""

    name: str
    claims: Callable[[str], bool]  # a preset name or checkpoint directory is this family's
    config: Callable[[str], Any]  # its config from the name alone (no weight is read)
    model: type[Any]  # the module tree its checkpoints load into
    load: Callable[..., Any]  # the loader entry point: name -> model with its weights
    cost_model: Callable[..., CostModel]  # a step's cost, calibrated by measured steps
    kv_layout: Callable[..., CacheSpec]  # what one KV block of it holds
    build_parts: PartsBuilder  # (config, loaded, ep, placement) -> the engine's parts


DEEPSEEK_V4 = ModelFamily(
    name="deepseek-v4",
    claims=is_v4,  # V4 presets, and checkpoints with model_type deepseek_v4
    config=v4_config,
    model=V4ForCausalLM,
    load=load_v4,
    cost_model=v4_cost_model,
    kv_layout=v4_cache_spec,
    build_parts=build_v4_parts,
)

DEEPSEEK_V3 = ModelFamily(
    name="deepseek-v3",  # DeepSeek-V2 and V3 (MLA, DeepSeekMoE, MTP): every other model
    claims=lambda _model: True,
    config=model_config,
    model=DeepseekForCausalLM,
    load=load,
    cost_model=CostModel.for_model,
    kv_layout=mla_cache_spec,
    build_parts=v3_parts,
)

# In the order they are asked; the last claims whatever the others do not.
FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V4, DEEPSEEK_V3)


def family_for(model: str) -> ModelFamily:
    """The family that serves ``model`` (a preset name or a checkpoint directory)."""
    return next(f for f in FAMILIES if f.claims(model))


def routed_experts(model: str) -> int:
    """How many routed experts ``model`` (a preset, a checkpoint directory or a Hub repo id)
    has, from its config alone: what an EP placement is sized by before a weight is read."""
    source = resolve_model(model)  # a Hub repo id: its snapshot directory
    return int(family_for(source).config(source).n_routed_experts)


def build_parts(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    ep: EPGroup | None = None,
    placement: Placement | None = None,
) -> EngineParts:
    """The parts of an engine for the model ``config`` names (a Hub repo id resolved to its
    snapshot directory first), built by its family: the model loaded (unless ``loaded``),
    its KV cache sized and allocated, cost model, sampler and runner. ``ep``/``placement``:
    this process is one rank of an expert-parallel group, its experts placed so."""
    source = resolve_model(config.model)  # a Hub repo id: its snapshot directory
    if source != config.model:
        config = dataclasses.replace(config, model=source)
    family = family_for(config.model)
    check(config.setup(family.name, ep is not None))  # the combinations refused, by name
    return family.build_parts(config, loaded, ep, placement)
