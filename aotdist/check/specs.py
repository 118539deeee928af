"""A model spec, as ``aotdist check`` and ``aotdist zoo`` take it, resolved to a :class:`Family`:
a listed family, ``hf:TYPE``, ``torchvision:NAME``, ``timm:ARCH``, ``titan:NAME``,
``diffusers:CLASS``, ``peft:TYPE`` or a user's ``module:factory``."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from aotdist.check.families import FAMILIES, Family, hf_family, torchvision_family
from aotdist.check.families_diffusers import DIFFUSERS_MODELS
from aotdist.check.families_peft import PEFT_MODELS, peft_family
from aotdist.check.families_timm import TIMM_MODELS, timm_family
from aotdist.check.families_titan import titan_family


def resolve(spec: str) -> Family:
    """A family from a spec: a name in :data:`FAMILIES`, ``hf:TYPE`` (a ``transformers``
    model type, causal LM unless listed), ``torchvision:NAME``, ``timm:ARCH`` (a
    ``timm.create_model`` architecture), ``titan:NAME`` (a torchtitan model:
    :data:`~aotdist.check.families_titan.TITAN_MODELS`), ``diffusers:CLASS`` (a diffusers
    model class of :data:`~aotdist.check.families_diffusers.DIFFUSERS_MODELS`, at its tiny
    size), ``peft:TYPE`` (a LoRA adapter on a tiny ``transformers`` causal LM), or
    ``module:factory`` (a zero-argument function returning ``(model, inputs)``, ``inputs``
    a dict of keyword arguments or a tuple of positional ones).

    Raises:
        ValueError: an unknown family name, or a diffusers class not listed.
    """
    kind, _, rest = spec.partition(":")
    known = {f.name: f for f in FAMILIES}
    if not rest:
        if spec in known:
            return known[spec]
        raise ValueError(
            f"unknown model {spec!r}: give a family ({', '.join(known)}), "
            "hf:TYPE, torchvision:NAME, timm:ARCH, titan:NAME, diffusers:CLASS, "
            "peft:TYPE or module:factory"
        )
    listed = known.get(rest)
    if kind == "hf":
        return (
            listed
            if listed is not None and listed.source == "transformers"
            else hf_family(rest, "transformers model")
        )
    if kind == "torchvision":
        return (
            listed
            if listed is not None and listed.source == "torchvision"
            else torchvision_family(rest, "torchvision model")
        )
    if kind == "timm":  # one of the sweep's at its size, else at the architecture's own
        return next((f for f in TIMM_MODELS if f.name == rest), None) or timm_family(rest)
    if kind == "titan":
        return titan_family(rest)
    if kind == "diffusers":  # a class's forward takes its own inputs: only the listed ones
        found = next((f for f in DIFFUSERS_MODELS if f.name == rest), None)
        if found is None:
            raise ValueError(
                f"unknown diffusers model {spec!r}: the classes checked at a tiny size are "
                f"{', '.join(f.name for f in DIFFUSERS_MODELS)}; check another as "
                "module:factory (a function returning the model and its forward's inputs)"
            )
        return found
    if kind == "peft":
        return next((f for f in PEFT_MODELS if f.name == rest), None) or peft_family(rest)

    def build(seed: int):
        torch.manual_seed(seed)
        made = getattr(importlib.import_module(kind), rest)()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
            raise TypeError(
                f"{spec} must return (model, inputs): inputs a dict of keyword "
                f"arguments or a tuple of positional ones; got {type(made).__name__}"
            )
        model, inputs = made
        return model, inputs if isinstance(inputs, dict) else {"*": tuple(inputs)}

    return Family(spec, "user model", build, "user")
