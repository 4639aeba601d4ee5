"""The target layers a fused head reads (``aux_layers``): EAGLE-3's default and the check every
fused head (EAGLE-3, P-EAGLE, DFlash and their kin) and their training apply.

Layer ids are HF ``hidden_states`` indices: ``L`` is the input of decoder layer ``L`` (``0`` the
embeddings, ``N`` the last layer's output after the final norm).
"""

from __future__ import annotations

from draftsmith.config import RecipeError


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: ``[2, N // 2, N - 3]`` (as vLLM and speculators)."""
    return [2, num_layers // 2, num_layers - 3]


def _fit(layers: list[int], num_layers: int) -> bool:
    """Whether ``layers`` are distinct target layer ids in ``[0, num_layers]`` (what vLLM and
    speculators take)."""
    return bool(layers) and len(set(layers)) == len(layers) and min(layers) >= 0 and max(layers) <= num_layers


def check_aux_layers(layers: list[int], num_layers: int, where: str = "drafter.aux_layers") -> list[int]:
    """``layers`` if they are distinct target layer ids in ``[0, num_layers]``; else a one-line error."""
    layers = [int(layer) for layer in layers]
    if not _fit(layers, num_layers):
        raise RecipeError(
            f"{where} = {layers}: give distinct target layer ids in [0, {num_layers}] "
            f"(the target has {num_layers} decoder layers; default {default_aux_layers(num_layers)})"
        )
    return layers


def resolve_aux_layers(layers: list[int] | None, num_layers: int, where: str = "drafter.aux_layers") -> list[int]:
    """``layers`` checked (:func:`check_aux_layers`), or the default for a target of ``num_layers`` when
    None; a target too shallow for the default (fewer than 7 layers: it would repeat a layer or
    name one below 0) is a one-line error asking for them, as speculators' trainer refuses it."""
    if layers is not None:
        return check_aux_layers(layers, num_layers, where)
    default = default_aux_layers(num_layers)
    if not _fit(default, num_layers):
        raise RecipeError(
            f"{where} is not set and EAGLE-3's default {default} does not fit a target of {num_layers} "
            f"decoder layers: give {len(default)} distinct target layer ids in [0, {num_layers}]"
        )
    return default
