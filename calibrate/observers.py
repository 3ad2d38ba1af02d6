"""Forward hooks that record calibration statistics on a filled decoder layer."""

import torch
from torch import nn

from calibrate.layerwise import ExpertList, LoadedLayer
from quantize import archs

__all__ = ["LayerObserver"]


class LayerObserver:
    """Records, for one decoder layer, while samples pass through it:

    - per ``nn.Linear`` (experts included, by checkpoint name): max |x| of its input and,
      if ``channels``, the per-input-channel sum of x^2 and the token count;
    - per attention block: max |K| and max |V| as written to the KV cache;
    - per :class:`ExpertList`: routed tokens per expert (read at :meth:`close`).

    Use as a context manager around the layer's forward passes; results accumulate into
    the dicts given at construction.
    """

    def __init__(self, layer: LoadedLayer, input_amax: dict, sq_sum: dict, counts: dict,
                 channels: bool = True):
        self.layer, self.input_amax, self.sq_sum, self.counts = layer, input_amax, sq_sum, counts
        self.channels = channels
        self.k_amax = 0.0
        self.v_amax = 0.0
        self.kv_seen = False
        self._handles = []

    def _hook(self, name: str):
        def record(_mod, args):
            x = args[0].detach()
            if x.numel() == 0:
                return
            x = x.reshape(-1, x.shape[-1]).to(torch.float32)
            amax = float(x.abs().amax())
            self.input_amax[name] = max(self.input_amax.get(name, 0.0), amax)
            if self.channels:
                sq = (x * x).sum(dim=0).cpu()
                self.sq_sum[name] = self.sq_sum[name] + sq if name in self.sq_sum else sq
                self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        return record

    def on_cache(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """KV-cache writes of this layer (see ``StreamedModel.run_layer``)."""
        if layer_idx != self.layer.index:
            return
        self.kv_seen = True
        if key.numel():
            self.k_amax = max(self.k_amax, float(key.detach().abs().amax()))
        if value.numel():
            self.v_amax = max(self.v_amax, float(value.detach().abs().amax()))

    def __enter__(self):
        for name, mod in self.layer.module.named_modules():
            if isinstance(mod, nn.Linear) and name in self.layer.disk_module:
                self._handles.append(mod.register_forward_pre_hook(self._hook(self.layer.disk_module[name])))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def attention_name(self) -> str | None:
        """Checkpoint name of the layer's attention block (``<layer>.self_attn``)."""
        for child in archs.ATTENTION_CHILDREN:
            if hasattr(self.layer.module, child):
                return f"{self.layer.prefix}.{child}"
        return None

    def expert_tokens(self) -> dict[str, list[int]]:
        """Routed tokens per expert, keyed by the checkpoint name of each experts block."""
        out = {}
        for rel in self.layer.experts:
            mod = self.layer.module.get_submodule(rel)
            assert isinstance(mod, ExpertList)
            out[f"{self.layer.prefix}.{rel}"] = [int(c) for c in mod.tokens]
        return out
