"""Run a checkpoint one decoder layer at a time through its transformers classes.

The model is instantiated on the ``meta`` device (no memory). Then:

1. capture: the embeddings are loaded and the text model's own ``forward`` runs once per
   sample with every decoder layer replaced by a recorder, which keeps the hidden state
   entering layer 0 and the exact keyword arguments the model passes to each layer (masks,
   rotary embeddings, position ids); the embeddings are freed.
2. per layer: a copy of the meta layer is filled from the source (FP8 weights dequantized by
   :class:`formats.sources.Source`), every sample's hidden state goes through it, and it is
   freed. Routed experts (fused 3-D parameters in transformers >= 5) are replaced by
   :class:`ExpertList`, one ``nn.Linear`` triple per expert named like the checkpoint, so
   every Linear, experts included, is observable by name.

Peak memory is one layer plus the hidden states of the calibration set, independent of the
depth. Checkpoint names are mapped to module names with transformers' own conversion table
(``transformers.conversion_mapping``): plain renames and concatenations are applied; the
expert merges are not needed because experts stay per expert.
"""

import copy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from formats.sources import Source
from quantize import archs

__all__ = ["ExpertList", "StreamedModel", "LoadedLayer"]


class _StopForward(Exception):
    """Raised by the last recorder: everything after the decoder stack is not needed."""


class _Recorder(nn.Module):
    """Stands in for decoder layer ``idx`` during capture: stores its inputs, passes the
    hidden state through unchanged."""

    def __init__(self, idx: int, n_extra: int, sink: list, last: bool):
        super().__init__()
        self.idx, self.n_extra, self.sink, self.last = idx, n_extra, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise RuntimeError("decoder layer called with positional arguments beyond the hidden "
                               "state; layer-streamed calibration needs keyword arguments")
        self.sink.append((hidden_states if self.idx == 0 else None, kwargs))
        if self.last:
            raise _StopForward
        return (hidden_states, *([None] * self.n_extra)) if self.n_extra else hidden_states


class _Replay(nn.Module):
    """Stands in for decoder layer ``idx`` when only the head is wanted: the last one returns
    the precomputed final hidden state, the others pass through."""

    def __init__(self, final: torch.Tensor | None, n_extra: int):
        super().__init__()
        self.final, self.n_extra = final, n_extra

    def forward(self, hidden_states, *args, **kwargs):
        h = hidden_states if self.final is None else self.final
        return (h, *([None] * self.n_extra)) if self.n_extra else h


class _ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class ExpertList(nn.ModuleList):
    """Drop-in replacement for a transformers fused-experts module, one ``nn.Linear`` triple
    per expert (children ``<e>.gate_proj`` / ``up_proj`` / ``down_proj``, the on-disk names).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` is
    the transformers eager expert loop (``DeepseekV3Experts.forward``): for each routed expert,
    ``down(act(gate(x)) * up(x)) * weight``, summed into the token's row. The activation is
    the original module's ``_apply_gate`` when it has one (GLM-5.3 clamped SwiGLU), else
    ``act_fn(gate) * up``.

    ``tokens`` [E] int64 counts the (token, expert) routings seen. With ``all_experts`` every
    expert also runs on every token (for statistics only; the output uses the routed tokens),
    as ModelOpt ``--calib_all_experts`` does.
    """

    def __init__(self, original: nn.Module, all_experts: bool = False):
        gate_up, down = (getattr(original, p) for p in archs.FUSED_EXPERT_PARAMS)
        n, two_inter, hidden = gate_up.shape
        with torch.device("meta"):
            super().__init__([_ExpertMLP(hidden, two_inter // 2) for _ in range(n)])
        object.__setattr__(self, "_original", original)  # not a submodule: no parameters
        self.all_experts = all_experts
        self.tokens = torch.zeros(n, dtype=torch.long)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        orig = self._original
        if hasattr(orig, "_apply_gate"):
            return orig._apply_gate(torch.cat([gate, up], dim=-1))
        return orig.act_fn(gate) * up

    def _run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        m = self[e]
        return m.down_proj(self._act(m.gate_proj(x), m.up_proj(x)))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        n = len(self)
        final = torch.zeros_like(hidden_states)
        mask = nn.functional.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
        self.tokens += mask[:n].sum(dim=(-1, -2)).to(torch.long).cpu()
        for e in range(n):
            top_k_pos, token_idx = torch.where(mask[e])
            if self.all_experts:
                y = self._run(e, hidden_states)[token_idx]
            elif token_idx.numel():
                y = self._run(e, hidden_states[token_idx])
            else:
                continue
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final


def _replace_experts(layer: nn.Module, all_experts: bool) -> list[str]:
    """Swap every fused-experts child of ``layer`` for an :class:`ExpertList`; returns their
    module paths (relative to the layer)."""
    swapped = []
    for name, mod in list(layer.named_modules()):
        params = dict(mod.named_parameters(recurse=False))
        if all(p in params and params[p].ndim == 3 for p in archs.FUSED_EXPERT_PARAMS):
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, ExpertList(mod, all_experts))
            swapped.append(name)
    return swapped


@dataclass
class _Conversions:
    """Checkpoint -> module name rules for one model type, read from transformers."""

    renames: list[tuple[re.Pattern, str]]
    concats: list[tuple[tuple[str, ...], str, int]]  # (source suffixes, target suffix, dim)

    @classmethod
    def for_model(cls, model_type: str) -> "_Conversions":
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        renames, concats = [], []
        for t in get_checkpoint_conversion_mapping(model_type) or []:
            ops = [type(o).__name__ for o in getattr(t, "operations", [])]
            src, tgt = t._original_source_patterns, t._original_target_patterns
            if not ops:
                renames += [(re.compile(s), g) for s, g in zip(src, tgt * len(src))]
            elif "MergeModulelist" in ops:
                continue  # expert stacking: experts stay per expert (ExpertList)
            elif ops == ["Concatenate"]:
                concats.append((tuple(src), tgt[0], t.operations[0].dim))
            else:
                concats.append((tuple(src), tgt[0], None))  # unsupported: fails if used
        return cls(renames, concats)

    def apply(self, tensors: dict[str, str]) -> tuple[dict[str, list[str]], list[str]]:
        """``{disk_relative_name: disk_full_name}`` -> ``({module_name: [disk names]}, unsupported)``."""
        out: dict[str, list[str]] = {}
        for rel, full in tensors.items():
            name = rel
            for pat, repl in self.renames:
                name = pat.sub(repl, name)
            out.setdefault(name, []).append(full)
        bad = []
        for sources, target, dim in self.concats:
            first = [k for k in out if k == sources[0] or k.endswith("." + sources[0])]
            for k in first:
                stem = k[: len(k) - len(sources[0])]
                parts = [stem + s for s in sources]
                if dim is None:
                    bad.append(k)
                    continue
                if all(p in out for p in parts):
                    out[stem + target] = [out.pop(p)[0] for p in parts] + [f"cat:{dim}"]
        return out, bad


@dataclass
class LoadedLayer:
    """A decoder layer filled from the source. ``disk_module`` maps module paths (relative to
    the layer) of its Linears to checkpoint module names; ``experts`` lists the ExpertList
    paths (relative)."""

    index: int
    module: nn.Module
    prefix: str
    disk_module: dict[str, str]
    experts: list[str]


def _text_config(config):
    return getattr(config, "text_config", None) or config


def _instantiate(config):
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
    )

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel):
        try:
            with torch.device("meta"):
                return auto.from_config(config, attn_implementation="sdpa")
        except ValueError:
            continue
    raise ValueError(f"transformers has no model class for model_type {config.model_type!r}")


class StreamedModel:
    """A checkpoint run layer by layer; see the module docstring.

    Args:
        source: an open :class:`formats.sources.Source` (FP8, compressed-tensors FP8 or dense).
        dtype: compute dtype of weights and hidden states (float32 default; bfloat16 halves
            the per-layer memory; parameters transformers keeps in float32 stay float32).
        device: where the layer runs (``cpu`` or ``cuda``).

    Raises:
        ValueError: transformers has no class for the config, or no decoder stack is found.
    """

    def __init__(self, source: Source, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoConfig

        self.source, self.dtype, self.device = source, dtype, torch.device(device)
        cfg = json.loads(json.dumps(source.config))
        cfg.pop("quantization_config", None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop("quantization_config", None)
        self.config = AutoConfig.for_model(**cfg)
        self.model = _instantiate(self.config)
        self.text_path, self.text = self._find_text_model()
        self.text_config = self.text.config
        self.n_layers = int(_text_config(self.config).num_hidden_layers)
        self.meta_layers = list(self.text.layers)[: self.n_layers]
        self.carry = archs.LAYER_OUTPUT_CARRY.get(self.text_config.model_type, ())
        self.conv = _Conversions.for_model(self.config.model_type)
        self.fp32_keep = tuple(getattr(type(self.model), "_keep_in_fp32_modules_strict", None) or ())
        self._materialize_buffers()

    # ---- structure -------------------------------------------------------------------
    def _find_text_model(self) -> tuple[str, nn.Module]:
        for name, mod in self.model.named_modules():
            if isinstance(getattr(mod, "layers", None), nn.ModuleList) and hasattr(mod, "embed_tokens"):
                return name, mod
        raise ValueError(f"no decoder stack (a module with embed_tokens and layers) in "
                         f"{type(self.model).__name__}")

    def _materialize_buffers(self) -> None:
        """Rebuild non-layer modules whose buffers are computed at init (rotary
        ``inv_freq``): on the meta device they hold no values."""
        for name, mod in list(self.text.named_modules()):
            if not name or name.startswith("layers") or isinstance(mod, nn.ModuleList):
                continue
            if any(b.is_meta for b in mod.buffers(recurse=False)) and not any(True for _ in mod.parameters()):
                fresh = type(mod)(config=mod.config)
                parent_name, _, child = name.rpartition(".")
                parent = self.text.get_submodule(parent_name) if parent_name else self.text
                setattr(parent, child, fresh.to(self.device))

    def _prefix(self, path: str) -> str:
        return f"{self.text_path}.{path}" if self.text_path else path

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t.to(self.device)
        keep = any(k in name for k in self.fp32_keep)
        return t.to(self.device, torch.float32 if keep else self.dtype)

    def _load(self, module: nn.Module, disk_prefix: str, strict_extra: bool = True) -> dict[str, str]:
        """Fill the meta ``module`` from every source tensor under ``disk_prefix``; returns
        ``{module param name: disk tensor name}`` (concatenations give the first part)."""
        pre = disk_prefix + "."
        rel = {n[len(pre):]: n for n in self.source.tensors if n.startswith(pre)}
        mapped, unsupported = self.conv.apply(rel)
        if unsupported:
            raise NotImplementedError(f"weight conversion for {unsupported[0]} is not supported in "
                                      "layer-streamed calibration")
        want = module.state_dict(keep_vars=True)
        missing = sorted(set(want) - set(mapped))
        extra = sorted(set(mapped) - set(want))
        if missing or (extra and strict_extra):
            raise RuntimeError(f"{disk_prefix}: checkpoint and {type(module).__name__} disagree; "
                               f"missing on disk {missing[:5]}, unexpected {extra[:5]}")
        state, origin = {}, {}
        for name in want:
            disk = mapped[name]
            if disk[-1].startswith("cat:"):
                t = torch.cat([self.source.read(d) for d in disk[:-1]], dim=int(disk[-1][4:]))
            else:
                t = self.source.read(disk[0])
            if tuple(t.shape) != tuple(want[name].shape):
                raise RuntimeError(f"{disk[0]}: shape {list(t.shape)} on disk, module expects "
                                   f"{list(want[name].shape)}")
            state[name] = self._cast(f"{disk_prefix}.{name}", t)
            origin[name] = disk[0]
        module.load_state_dict(state, strict=True, assign=True)
        left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"{disk_prefix}: {left[:5]} have no values after loading")
        return origin

    # ---- the three phases ----------------------------------------------------------------
    def capture(self, sequences: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[dict]]]:
        """Embed each sample and record what the model passes to every decoder layer.

        Returns:
            ``(hidden, kwargs)``: hidden[s] is the input of layer 0 for sample s (compute
            dtype, on the device); kwargs[s][i] the keyword arguments of layer i.
        """
        embed = self.text.embed_tokens
        self._load(embed, self._prefix("embed_tokens"))
        saved = list(self.text.layers)
        hidden, kwargs = [], []
        try:
            for ids in sequences:
                sink: list = []
                self.text.layers = nn.ModuleList(
                    [_Recorder(i, len(self.carry), sink, i == self.n_layers - 1) for i in range(self.n_layers)])
                try:
                    with torch.no_grad():
                        self.text(input_ids=ids.to(self.device), use_cache=False)
                except _StopForward:
                    pass
                if len(sink) != self.n_layers:
                    raise RuntimeError(f"captured {len(sink)} of {self.n_layers} decoder layer calls")
                hidden.append(sink[0][0])
                kwargs.append([kw for _, kw in sink])
        finally:
            self.text.layers = nn.ModuleList(saved)
            self.text.embed_tokens = embed.to("meta")
        return hidden, kwargs

    def load_layer(self, i: int, all_experts: bool = False) -> LoadedLayer:
        """A filled copy of decoder layer ``i`` (experts as :class:`ExpertList`)."""
        layer = copy.deepcopy(self.meta_layers[i])
        experts = _replace_experts(layer, all_experts)
        prefix = self._prefix(f"layers.{i}")
        origin = self._load(layer, prefix)
        self.source.close()  # unmap the shards: touched pages would otherwise stay resident
        disk_module = {}
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear) and f"{name}.weight" in origin:
                disk_module[name] = origin[f"{name}.weight"][: -len(".weight")]
        return LoadedLayer(i, layer, prefix, disk_module, experts)

    def run_layer(self, layer: LoadedLayer, hidden: list[torch.Tensor], kwargs: list[list[dict]],
                  carried: list[dict], on_cache: Callable | None = None) -> None:
        """Push every sample through ``layer`` in place (``hidden[s]`` is replaced).

        ``carried[s]`` holds the extras a layer hands to the next (``LAYER_OUTPUT_CARRY``).
        ``on_cache(layer_idx, key_states, value_states)`` sees what the attention writes to
        its KV cache (a fresh transformers ``DynamicCache`` per sample): post-RoPE K and V for
        GQA, the normalised latent and the rope key for MLA.
        """
        from transformers import DynamicCache

        for s in range(len(hidden)):
            kw = dict(kwargs[s][layer.index], **carried[s])
            if on_cache is not None:
                cache = DynamicCache(config=self.text_config)
                update = cache.update

                def recording_update(k, v, layer_idx, *a, _u=update, **k2):
                    on_cache(layer_idx, k, v)
                    return _u(k, v, layer_idx, *a, **k2)

                cache.update = recording_update
                kw["cache"] = cache
            with torch.no_grad():
                out = layer.module(hidden[s], **kw)
            if self.carry:
                hidden[s] = out[0]
                carried[s] = dict(zip(self.carry, out[1:]))
            else:
                hidden[s] = out

    def layers(self, all_experts: bool = False) -> Iterator[LoadedLayer]:
        """Yield each decoder layer filled, freeing the previous one first."""
        for i in range(self.n_layers):
            layer = self.load_layer(i, all_experts)
            yield layer
            del layer

    def logits(self, final_hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Final norm (and whatever the model does after its last layer) plus the LM head,
        applied to the last layer's outputs; a model without a head gives its final hidden
        states. Loads the non-layer weights: for tests and checks, not for statistics."""
        tail = [n for n, _ in self.text.named_children() if n not in ("layers", "embed_tokens")]
        for n in tail:
            mod = getattr(self.text, n)
            if any(p.is_meta for p in mod.parameters()):
                self._load(mod, self._prefix(n))
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is not None:
            head_path = next(n for n, m in self.model.named_modules() if m is head)
            tied = f"{head_path}.weight" not in self.source.tensors
            head = copy.deepcopy(head)
            self._load(head, self._prefix("embed_tokens") if tied else head_path)
        saved = list(self.text.layers)
        out = []
        try:
            for h in final_hidden:
                self.text.layers = nn.ModuleList(
                    [_Replay(h if i == self.n_layers - 1 else None, len(self.carry))
                     for i in range(self.n_layers)])
                emb = torch.zeros(1, h.shape[1], int(self.text_config.hidden_size), dtype=self.dtype,
                                  device=self.device)
                with torch.no_grad():
                    last = self.text(inputs_embeds=emb, use_cache=False).last_hidden_state
                    out.append(head(last.to(head.weight.dtype)) if head is not None else last)
        finally:
            self.text.layers = nn.ModuleList(saved)
        return out
