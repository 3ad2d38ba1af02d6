"""Shared fixtures: small checkpoints written in the exact on-disk layout of FP8 releases."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from formats.manifest import CHECK_STATS_NAME, MANIFEST_NAME
from quantize.kernels.fp8 import quantize_fp8_block


def ct_nvfp4_reference(w: torch.Tensor, amax: torch.Tensor | None = None):
    """compressed-tensors' own NVFP4 path on float32 ``w`` [N, K]: ``generate_gparam`` (over
    ``amax``, e.g. a fused group's, default the tensor's) -> ``calculate_qparams`` ->
    ``quantize_and_pack_fp4``. Returns (packed u8, block scale e4m3, global scale f32 [1])."""
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        generate_gparam,
    )

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            symmetric=True, scale_dtype=torch.float8_e4m3fn)
    if amax is None:
        g = generate_gparam(w.min(), w.max())
    else:
        g = generate_gparam(-amax.reshape(1), amax.reshape(1))
    n, k = w.shape
    blocks = w.view(n, k // 16, 16)
    s, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
    return quantize_and_pack_fp4(w, s, global_scale=g, group_size=16), s.to(torch.float8_e4m3fn), g

BLOCK_FP8_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], config: dict,
                     shard_of: dict[str, int] | None = None, n_shards: int = 1) -> Path:
    """Write ``tensors`` as safetensors shards + index + config.json.

    ``shard_of`` maps a tensor name to a shard number (default: round robin by sorted name).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shard_of = shard_of or {}
    buckets: dict[int, dict] = {i: {} for i in range(n_shards)}
    for i, n in enumerate(names):
        buckets[shard_of.get(n, i % n_shards)][n] = tensors[n]
    weight_map, total = {}, 0
    for i, b in buckets.items():
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in b.items()}, str(folder / fname))
        for k, v in b.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit_shard(path: Path, fn) -> None:
    """Rewrite a shard after ``fn`` changed its tensors dict in place (fault injection)."""
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def edit_json(path: Path, fn) -> None:
    """Rewrite a JSON file after ``fn`` changed it in place (fault injection)."""
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, found through its index."""
    from safetensors import safe_open

    out = {}
    for name, shard in json.loads((Path(folder) / "model.safetensors.index.json").read_text())["weight_map"].items():
        with safe_open(str(Path(folder) / shard), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def fp8_pair(name: str, w: torch.Tensor, block=(128, 128)) -> dict[str, torch.Tensor]:
    """``{name.weight: fp8, name.weight_scale_inv: f32}`` for a float weight."""
    q, s = quantize_fp8_block(w, block)
    return {f"{name}.weight": q, f"{name}.weight_scale_inv": s}


@pytest.fixture
def tiny_fp8_llama(tmp_path) -> Path:
    """A 2-layer llama-shaped block-FP8 checkpoint in 3 shards (random weights)."""
    g = torch.Generator().manual_seed(0)
    h, inter, vocab = 64, 128, 256
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g).bfloat16(),
         "model.norm.weight": torch.ones(h).bfloat16()}
    for layer in range(2):
        p = f"model.layers.{layer}"
        for m, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (32, h)),
                         ("self_attn.v_proj", (32, h)), ("self_attn.o_proj", (h, h)),
                         ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                         ("mlp.down_proj", (h, inter))]:
            t.update(fp8_pair(f"{p}.{m}", torch.randn(*shape, generator=g) * 0.05))
        t[f"{p}.input_layernorm.weight"] = torch.ones(h).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
              "quantization_config": BLOCK_FP8_QC}
    # one weight and its scale in different shards
    shard_of = {"model.layers.0.mlp.down_proj.weight": 0,
                "model.layers.0.mlp.down_proj.weight_scale_inv": 2}
    folder = write_checkpoint(tmp_path / "src", t, config, shard_of, n_shards=3)
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="session")
def demo_src(tmp_path_factory) -> Path:
    """The real demo source (SmolLM2-135M-Instruct as 3-shard block FP8), built once."""
    from quantize.data.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def demo_build(demo_src, tmp_path_factory) -> Path:
    """The demo source converted to NVFP4 (compressed-tensors), once per session."""
    from quantize.convert.pipeline import convert

    out = tmp_path_factory.mktemp("demo") / "nvfp4"
    convert(demo_src, out, progress=False, device="cpu")
    return out


@pytest.fixture(scope="session")
def glm5_next_src(tmp_path_factory) -> Path:
    """Tiny GLM-5.3-Flash (``glm5_next``) FP8 release fixture, built once per session."""
    from quantize.data.fixtures import write_release_fixture

    return write_release_fixture(tmp_path_factory.mktemp("glm5_next") / "src", "glm5_next")


def assert_same_build(a: Path, b: Path, same_source: bool = True) -> None:
    """Every file byte-identical; the manifest equal (but for the source path when the two
    builds read copies of one source). The local check statistics (identities of each
    folder's own files) are left out."""
    local = {CHECK_STATS_NAME}
    assert sorted(p.name for p in a.iterdir() if p.name not in local) == \
        sorted(p.name for p in b.iterdir() if p.name not in local)
    for p in sorted(q for q in a.iterdir() if q.name not in local):
        if p.name == MANIFEST_NAME:
            x, y = json.loads(p.read_text()), json.loads((b / p.name).read_text())
            if not same_source:
                x["source"].pop("path"), y["source"].pop("path")
            assert x == y
        else:
            assert p.read_bytes() == (b / p.name).read_bytes(), p.name


def killed_at_write(monkeypatch, n: int):
    """Make the converter's ``n``-th shard write raise KeyboardInterrupt (a kill while that
    shard is written); ``monkeypatch.undo()`` lets the next run write again."""
    import quantize.convert.pipeline as pl

    real, calls = pl.write_shard_atomic, {"n": 0}

    def dying(tensors, path, metadata=None, sha256=False):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(tensors, path, metadata, sha256)

    monkeypatch.setattr(pl, "write_shard_atomic", dying)
