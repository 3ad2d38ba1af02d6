"""KV-cache storage formats: byte-level round trips, the record engines keep, bytes per token."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from eval.kl import teacher_forced_kl
from eval.kvcache import (
    bf16_roundtrip,
    calibrate_scales,
    fp8_roundtrip,
    kv_bytes_per_token,
    kv_cache_factory,
    nvfp4_roundtrip,
    scales_from_build,
)
from quantize.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4, unpack_e2m1


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def tiny_mla():
    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           vocab_size=128, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                           qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                           max_position_embeddings=256)
    return DeepseekV3ForCausalLM(cfg).eval()


class _Tap:
    """Cache factory wrapper that records the raw K/V handed to ``update`` for layer 0."""

    def __init__(self, factory):
        self.factory, self.raw = factory, []

    def __call__(self):
        cache, raw = self.factory(), self.raw
        orig = cache.update

        def update(k, v, layer, *a, **kw):
            if layer == 0:
                raw.append((k.clone(), v.clone()))
            return orig(k, v, layer, *a, **kw)

        cache.update = update
        return cache


def test_fp8_roundtrip_values():
    x = torch.tensor([0.0, 1.0, -3.3, 500.0, -1000.0, 0.0017])
    # scale 1: saturate at 448; 3.3 -> e4m3 3.25; 0.0017 -> subnormal 2^-9 * 1 = 0.001953125
    assert fp8_roundtrip(x, 1.0).tolist() == [0.0, 1.0, -3.25, 448.0, -448.0, 0.001953125]
    # scale 2: fp8(x / 2) * 2 (250 -> 256; 0.00085 rounds to 0)
    assert fp8_roundtrip(x, 2.0).tolist() == [0.0, 1.0, -3.25, 512.0, -896.0, 0.0]  # 0.00085 < 2^-10
    assert fp8_roundtrip(x.bfloat16(), 1.0).dtype == torch.bfloat16


def test_nvfp4_roundtrip_is_the_kernel_and_exact_on_the_grid():
    torch.manual_seed(1)
    x = torch.randn(3, 2, 5, 32)
    y = nvfp4_roundtrip(x, 0.5)
    g = torch.tensor([2.0])
    packed, block = quantize_nvfp4(x.reshape(-1, 32), g)
    assert torch.equal(y, dequantize_nvfp4(packed, block, g).reshape(x.shape))
    # a head vector already on the grid comes back exactly: amax 6 -> block scale 1.0 (scale 1)
    v = torch.tensor([6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0] * 2)
    assert torch.equal(nvfp4_roundtrip(v.view(1, 16), 1.0), v.view(1, 16))
    # 4.5 bits per value: 16 values -> 8 code bytes + 1 e4m3 scale byte
    p, b = quantize_nvfp4(v.view(1, 16), torch.tensor([1.0]))
    assert p.shape == (1, 8) and b.shape == (1, 1) and b.float().item() == 1.0
    assert unpack_e2m1(p)[0, 1].item() == 0xE  # -4.0
    assert torch.equal(bf16_roundtrip(torch.tensor([1.0 + 2 ** -10])), torch.tensor([1.0]))


def test_bytes_per_token():
    qwen = {"num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536}
    assert [kv_bytes_per_token(qwen, d)["per_layer"] for d in ("bf16", "fp8", "nvfp4")] == [1024, 512, 288]
    assert kv_bytes_per_token(qwen, "nvfp4")["total"] == 288 * 28
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert [kv_bytes_per_token(smol, d)["per_layer"] for d in ("bf16", "fp8", "nvfp4")] == [768, 384, 216]
    dsv3 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128,
            "hidden_size": 7168}
    # docs/eval.md §4.3 / §4.5 / §6.2: 1152 B bf16, 576 B per-tensor fp8, 416 B NVFP4 latent + bf16 RoPE
    assert [kv_bytes_per_token(dsv3, d)["per_layer"] for d in ("bf16", "fp8", "nvfp4")] == [1152, 576, 416]
    assert kv_bytes_per_token(dsv3, "bf16")["total"] == 70272
    hybrid = {**qwen, "layer_types": ["linear_attention", "full_attention"] * 14}
    assert kv_bytes_per_token(hybrid, "bf16")["layers"] == 14
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_bytes_per_token(qwen, "int8")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_mha_cache_stores_post_rope_kv_in_the_format(dtype):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    scales = {0: (0.02, 0.01)}
    tap = _Tap(kv_cache_factory(model.config, dtype, scales))
    cache = tap()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    k_raw, v_raw = tap.raw[0]
    assert k_raw.shape == (1, 2, 24, 32)
    fn = {"bf16": bf16_roundtrip, "fp8": fp8_roundtrip, "nvfp4": nvfp4_roundtrip}[dtype]
    assert torch.equal(cache.layers[0].keys, fn(k_raw, 0.02))
    assert torch.equal(cache.layers[0].values, fn(v_raw, 0.01))
    # layer 1 has no scale: engines' default 1.0
    assert not torch.equal(cache.layers[0].keys, k_raw)


def test_mla_cache_stores_the_latent_record():
    model = tiny_mla()
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    for dtype, rope_fn in (("fp8", lambda x: fp8_roundtrip(x, 0.05)), ("nvfp4", bf16_roundtrip)):
        tap = _Tap(kv_cache_factory(model.config, dtype, {0: (0.05, 7.0)}))
        cache = tap()
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        latent, k_rope = tap.raw[0]
        assert latent.shape == (1, 1, 20, 32) and k_rope.shape == (1, 1, 20, 16)  # not the 4 expanded heads
        latent_fn = fp8_roundtrip if dtype == "fp8" else nvfp4_roundtrip
        assert torch.equal(cache.layers[0].keys, latent_fn(latent, 0.05))
        assert torch.equal(cache.layers[0].values, rope_fn(k_rope))  # the record shares the k scale


def test_parity_kl_orders_the_formats_and_generate_uses_the_cache():
    model = tiny_llama()
    texts = ["".join(chr(97 + (i * 7) % 26) for i in range(300))]

    class Tok:
        def encode(self, t, add_special_tokens=False):
            return [ord(c) % 128 for c in t]

    ref = kv_cache_factory(model.config, "bf16")
    kl = {d: teacher_forced_kl(model, model, Tok(), texts, 200, 100, ref_cache=ref,
                               test_cache=kv_cache_factory(model.config, d))["mean_kl"]
          for d in ("bf16", "fp8", "nvfp4")}
    assert kl["bf16"] == 0.0
    assert 0.0 < kl["fp8"] < kl["nvfp4"]
    ids = torch.tensor([[5, 6, 7, 8]])
    tap = _Tap(kv_cache_factory(model.config, "nvfp4"))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False, cache=tap())
    assert [k.shape[2] for k, _ in tap.raw] == [4, 1, 1]  # prefill, then one token per step


def test_scales_from_build_and_calibration(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
               "model.layers.1.self_attn.k_scale": torch.tensor([2.0]),
               "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert scales_from_build(tmp_path) == {0: (0.5, 0.25), 1: (2.0, 1.0)}
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    tap = _Tap(kv_cache_factory(model.config, "bf16"))
    with torch.no_grad():
        model(input_ids=ids, cache=tap(), use_cache=True)
    k, v = tap.raw[0]
    fp8 = calibrate_scales(model, [ids], "fp8")
    assert fp8[0] == pytest.approx((float(k.abs().max()) / 448, float(v.abs().max()) / 448))
    nv = calibrate_scales(model, [ids], "nvfp4")
    assert nv[0] == pytest.approx((float(k.abs().max()) / 2688, float(v.abs().max()) / 2688))
