"""Decide what every source tensor becomes. Pure: reads only names, shapes and the config.

Order of precedence, one place: not a Linear weight -> kept; a sensitive module
(``archs.sensitive_role``) -> kept; else the recipe's first matching rule; an NVFP4 target
whose K is not a multiple of 16 -> kept (reported); finally a fused group in which any
member is not NVFP4 is kept whole, so engines never see a half-quantized fused GEMM
(vLLM "Detected some but not all shards of ... are quantized", formats_spec.md A.2.3).
"""

from dataclasses import dataclass

from formats.sources import LogicalTensor, Source
from quantize import archs
from quantize.kernels.dtypes import NVFP4_GROUP_SIZE
from quantize.recipe import Recipe, Target

__all__ = ["Decision", "plan_tensors", "module_of"]


@dataclass(frozen=True)
class Decision:
    """Target of one logical tensor, why, and its fused group id (if any)."""

    name: str
    target: Target
    reason: str
    group: str | None = None
    members: tuple[str, ...] = ()


def module_of(name: str) -> str | None:
    """Module name of a Linear-style weight (``x.y.weight`` -> ``x.y``), else None."""
    return name[: -len(".weight")] if name.endswith(".weight") and len(name) > len(".weight") else None


def _kept(t: LogicalTensor) -> Target:
    # An FP8 weight cannot be written "as is" into an unquantized slot: it is dequantized.
    return Target.BF16 if t.is_fp8 else Target.KEEP


def plan_tensors(source: Source, recipe: Recipe) -> dict[str, Decision]:
    """Decide every logical tensor of ``source``.

    Returns:
        logical tensor name -> Decision, for every tensor the source has.
    """
    config = source.config
    names = set(source.tensors)
    modules = {m for n in names if (m := module_of(n)) is not None}
    out: dict[str, Decision] = {}
    for t in source.tensors.values():
        mod = module_of(t.name)
        if mod is None or len(t.shape) != 2 or 0 in t.shape:
            out[t.name] = Decision(t.name, _kept(t), "not a Linear weight")
            continue
        role = archs.sensitive_role(mod, t.shape, config, names)
        if role:
            out[t.name] = Decision(t.name, _kept(t), f"sensitive: {role}")
            continue
        target = recipe.resolve(mod)
        if target is Target.KEEP and t.is_fp8:
            target = Target.BF16
        reason = f"recipe {recipe.name}"
        if target is Target.NVFP4 and t.shape[1] % NVFP4_GROUP_SIZE:
            target, reason = _kept(t), f"K={t.shape[1]} is not a multiple of {NVFP4_GROUP_SIZE}"
        grp = archs.fused_group_of(mod, modules)
        gid, members = grp if grp else (None, ())
        out[t.name] = Decision(t.name, target, reason, gid, members)
    # A fused group is quantized whole or not at all.
    for d in list(out.values()):
        if d.group is None or d.target is not Target.NVFP4:
            continue
        odd = [m for m in d.members if out[m + ".weight"].target is not Target.NVFP4]
        if odd:
            t = source.tensors[d.name]
            out[d.name] = Decision(d.name, _kept(t),
                                   f"fused group {d.group}: {odd[0]} is not NVFP4", d.group, d.members)
    return out
