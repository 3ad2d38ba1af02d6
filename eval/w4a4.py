"""Run a W4A4 NVFP4 build's activation quantization in a transformers model on CPU.

transformers + compressed-tensors decompress the weights of an ``nvfp4-pack-quantized`` build
(``eval.models.load_build_model``) but drop ``input_global_scale``: the model then runs
weight-only. :func:`attach_activation_quant` adds what a W4A4 GEMM does to its input - each
16-element block along K rounded to e2m1 against a dynamic e4m3 block scale over the static
calibrated global scale (``quantize.kernels.act_scales.fake_quantize_nvfp4_activation``) - as
forward pre-hooks on the modules that carry an input scale.
"""

from pathlib import Path

import torch

from quantize.kernels.act_scales import fake_quantize_nvfp4_activation

__all__ = ["input_global_scales", "attach_activation_quant"]

_SUFFIX = ".input_global_scale"


def input_global_scales(build: str | Path) -> dict[str, torch.Tensor]:
    """module name -> float32 [1] input global scale, from every shard of ``build``."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(Path(build).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k[: -len(_SUFFIX)]: f.get_tensor(k).to(torch.float32)
                        for k in f.keys() if k.endswith(_SUFFIX)})
    return out


def attach_activation_quant(model, build: str | Path | dict[str, torch.Tensor]) -> list:
    """Register NVFP4 input fake-quantization on every module of ``model`` named in the
    build's ``input_global_scale`` tensors (or in a ``{module: float32 [1]}`` dict of input
    global scales). Returns the hook handles (``.remove()`` them to go back to weight-only).

    Raises:
        KeyError: a scaled module does not exist in ``model`` (names must match, as they do
            for dense architectures; fused in-memory experts are not supported).
    """
    modules = dict(model.named_modules())
    scales = build if isinstance(build, dict) else input_global_scales(build)
    handles = []
    for name, g in sorted(scales.items()):
        if name not in modules:
            raise KeyError(f"{name} has an input scale in {build} but is not a module of "
                           f"{type(model).__name__}")

        def pre(_mod, args, _g=g):
            return (fake_quantize_nvfp4_activation(args[0], _g), *args[1:])

        handles.append(modules[name].register_forward_pre_hook(pre))
    return handles
