"""Calibration statistics: what is recorded, how it is saved, and the expert fallback.

A stats folder holds ``calibration.json`` (scalars, counts, provenance) and, when channel
statistics were recorded, ``channels.safetensors`` (one float32 [K] mean of x^2 per Linear,
the weights of the activation-weighted scale search). Module names are checkpoint names
(``model.layers.3.mlp.experts.7.up_proj``), whatever transformers calls them in memory.

Expert fallback (FC-13, the rule of ModelOpt's DeepSeek flow ``fixup_moe_expert_amax``,
docs/formats.md §C.1): a routed expert that received fewer than ``min_tokens`` tokens takes,
for each of its projections, the largest input amax of that projection over the experts of
its layer that did reach the threshold (or, if none did, over all experts that saw any
token, then over the shared expert / dense Linears fed the same hidden state). Its weight
scales never depend on routing. Every expert that got the fallback is reported.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from formats.checkpoint import write_json_atomic
from formats.shards import write_shard_atomic
from quantize import archs

__all__ = ["CalibStats", "UncoveredExpert", "STATS_FILE", "CHANNELS_FILE", "DEFAULT_MIN_TOKENS"]

STATS_FILE = "calibration.json"
CHANNELS_FILE = "channels.safetensors"
DEFAULT_MIN_TOKENS = 8
FORMAT_VERSION = 1


@dataclass(frozen=True)
class UncoveredExpert:
    """A routed expert below the token threshold, and the input amax it was given."""

    block: str
    expert: int
    tokens: int
    fallback_amax: dict[str, float]

    def render(self) -> str:
        vals = ", ".join(f"{p} {a:.4g}" for p, a in sorted(self.fallback_amax.items()))
        return f"{self.block}.{self.expert}: {self.tokens} tokens -> fallback input amax ({vals})"


@dataclass
class CalibStats:
    """Per-Linear input amax, per-attention KV amax, per-expert token counts.

    Attributes:
        input_amax: checkpoint module name -> max |x| over every token fed to it (float).
        kv_amax: attention module (``model.layers.L.self_attn``) -> ``{"k": float, "v": float,
            "mla": bool}``; for MLA ``k`` is the latent (kv_a_layernorm output) and ``v`` the
            rope key, both stored in the one latent record.
        expert_tokens: experts block (``model.layers.L.mlp.experts``) -> routed tokens per
            expert.
        channel_sq_mean: module -> float32 [K] mean of x^2 per input channel.
        meta: dataset, samples, seq_len, tokens, token sha256, source, options.
    """

    input_amax: dict[str, float] = field(default_factory=dict)
    kv_amax: dict[str, dict] = field(default_factory=dict)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)
    channel_sq_mean: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    # ---- persistence -----------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        """Write ``calibration.json`` (and ``channels.safetensors``) atomically into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.channel_sq_mean:
            write_shard_atomic({k: v.to(torch.float32).contiguous() for k, v in self.channel_sq_mean.items()},
                               folder / CHANNELS_FILE)
        write_json_atomic({"format_version": FORMAT_VERSION, "meta": self.meta,
                           "input_amax": dict(sorted(self.input_amax.items())),
                           "kv_amax": dict(sorted(self.kv_amax.items())),
                           "expert_tokens": dict(sorted(self.expert_tokens.items()))},
                          folder / STATS_FILE)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "CalibStats":
        """Read a stats folder written by :meth:`save` (or a path to its calibration.json).

        Raises:
            ValueError: missing file, bad JSON, unknown format version, or a non-finite or
                negative amax (naming the module).
        """
        path = Path(folder)
        if path.is_dir():
            path = path / STATS_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"calibration stats {path} not found (run `quantize calibrate` first)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration stats {path} are not valid JSON: {e}") from None
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {data.get('format_version')!r}, expected {FORMAT_VERSION}")
        for name, a in data["input_amax"].items():
            if not (isinstance(a, (int, float)) and math.isfinite(a) and a >= 0):
                raise ValueError(f"{path}: input amax of {name} is {a!r}; expected a finite value >= 0")
        channels = {}
        ch = path.parent / CHANNELS_FILE
        if ch.is_file():
            from safetensors.torch import load_file

            channels = load_file(str(ch))
        return cls(dict(data["input_amax"]), dict(data["kv_amax"]), dict(data["expert_tokens"]),
                   channels, dict(data.get("meta", {})))

    # ---- expert coverage and fallback --------------------------------------------------
    def _tokens(self, block: str, e: int) -> int:
        counts = self.expert_tokens.get(block)
        return int(counts[e]) if counts is not None and e < len(counts) else 0

    def _covered(self, block: str, e: int, min_tokens: int) -> bool:
        if self.meta.get("all_experts"):  # every expert saw every token
            return f"{block}.{e}.{archs.EXPERT_PROJECTIONS[0]}" in self.input_amax
        return self._tokens(block, e) >= min_tokens

    def _layer_fallback(self, block: str, proj: str, min_tokens: int) -> float | None:
        n = len(self.expert_tokens.get(block, []))
        for floor in (min_tokens, 1):
            vals = [self.input_amax[m] for e in range(n)
                    if self._tokens(block, e) >= floor and (m := f"{block}.{e}.{proj}") in self.input_amax]
            if vals:
                return max(vals)
        if proj in archs.EXPERT_PROJECTIONS[:2]:  # gate/up read the hidden state the MLP reads
            parent = block.rsplit(".", 1)[0]
            vals = [a for m, a in self.input_amax.items()
                    if m.startswith(parent + ".") and m.rsplit(".", 1)[-1] in archs.EXPERT_PROJECTIONS[:2]
                    and archs.expert_of(m) is None]
            if vals:
                return max(vals)
        return None

    def input_amax_for(self, module: str, min_tokens: int = DEFAULT_MIN_TOKENS) -> float | None:
        """Input amax to use for ``module``: its own, or the expert fallback (see module
        docstring) for a routed expert below ``min_tokens``; None when nothing applies."""
        ex = archs.expert_of(module)
        if ex is None or self._covered(ex[0], ex[1], min_tokens):
            return self.input_amax.get(module)
        return self._layer_fallback(ex[0], ex[2], min_tokens)

    def uncovered_experts(self, min_tokens: int = DEFAULT_MIN_TOKENS) -> list[UncoveredExpert]:
        """Every routed expert below ``min_tokens`` routed tokens, with its fallback amax per
        projection (missing when no fallback exists)."""
        out = []
        for block, counts in sorted(self.expert_tokens.items()):
            for e in range(len(counts)):
                if self._covered(block, e, min_tokens):
                    continue
                fb = {p: a for p in archs.EXPERT_PROJECTIONS
                      if (a := self._layer_fallback(block, p, min_tokens)) is not None}
                out.append(UncoveredExpert(block, e, self._tokens(block, e), fb))
        return out

    def coverage_report(self, min_tokens: int = DEFAULT_MIN_TOKENS) -> str:
        """Human-readable expert coverage: totals and every uncovered expert."""
        total = sum(len(c) for c in self.expert_tokens.values())
        if not total:
            return "expert coverage: no routed experts"
        bad = self.uncovered_experts(min_tokens)
        lines = [f"expert coverage: {total - len(bad)}/{total} experts received >= {min_tokens} tokens"]
        if bad:
            lines.append(f"  {len(bad)} uncalibrated expert(s) use the layer's max over experts:")
            lines += [f"  {u.render()}" for u in bad]
        return "\n".join(lines)
