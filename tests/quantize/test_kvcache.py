"""KV records per dtype, layer layouts read from configs, and the GLM-5.3-Flash lead."""

import pytest

from quantize.archs import AttnKind, attention_layers
from quantize.archs.kvcache import (
    KVDtype,
    gqa_record,
    indexer_record,
    indexer_tail_state,
    kda_state,
    kv_model,
    mla_record,
)

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "num_attention_heads": 128, "hidden_size": 7168}


def glm5_next_defaults() -> dict:
    transformers = pytest.importorskip("transformers")
    return transformers.Glm5NextTextConfig().to_dict()


def test_mla_records_on_deepseek_geometry():
    # 512 latent + 64 RoPE: BF16 (512+64)*2; FlashMLA fp8_ds_mla 512 e4m3 + 4 f32 + 64 bf16
    # (docs/eval.md §4.3: bytes 0-511, 512-527, 528-655); NVFP4 derived (§4.5): 256+32+128.
    assert mla_record(512, 64, KVDtype.BF16).nbytes == 1152
    fp8 = mla_record(512, 64, KVDtype.FP8)
    assert [b for _, b in fp8.fields] == [512, 16, 128] and fp8.nbytes == 656
    assert mla_record(512, 64, KVDtype.NVFP4).nbytes == 416


def test_deepseek_v3_bytes_per_token_match_the_worked_checks():
    # docs/eval.md §6.2: 61 layers -> 70,272 B/token BF16 and 40,016 B fp8_ds_mla.
    assert kv_model(DEEPSEEK_V3, KVDtype.BF16, tp=2).bytes_per_token == 70_272
    assert kv_model(DEEPSEEK_V3, KVDtype.FP8, tp=8).bytes_per_token == 40_016


def test_gqa_records_match_vllm_logs():
    # Qwen3-0.6B: 28 layers x 8 KV heads x 128 x 2 x 2 B = 114,688 B/token (vLLM log, GB10).
    qwen = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_size": 1024}
    assert kv_model(qwen, KVDtype.BF16, tp=1).bytes_per_token == 114_688
    # Qwen3-4B: 36 layers -> 147,456 B/token BF16, halved in FP8 (vLLM quantized_kvcache doc).
    qwen4 = dict(qwen, num_hidden_layers=36)
    assert kv_model(qwen4, KVDtype.BF16, tp=1).bytes_per_token == 147_456
    assert kv_model(qwen4, KVDtype.FP8, tp=1).bytes_per_token == 73_728
    # NVFP4 per head per K or V: 64 B codes + 8 e4m3 scales = 72 B (3.56x smaller than BF16).
    assert gqa_record(1, 128, KVDtype.NVFP4).nbytes == 144
    # TP splits KV heads, never below one head per rank.
    assert kv_model(qwen, KVDtype.BF16, tp=2).bytes_per_token == 114_688 // 2
    mqa = dict(qwen, num_key_value_heads=1)
    assert kv_model(mqa, KVDtype.BF16, tp=4).bytes_per_token == 28 * 512


def test_glm5_next_layout_from_transformers_defaults():
    cfg = glm5_next_defaults()
    layers = attention_layers(cfg)
    mla = [x.index for x in layers if x.kind is AttnKind.MLA]
    assert len(layers) == 45 and mla == list(range(3, 45, 4))  # 11 MLA + DSA, every fourth
    assert sum(x.kind is AttnKind.KDA for x in layers) == 34
    assert all(x.indexer for x in layers if x.kind is AttnKind.MLA)
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["index_head_dim"],
            cfg["index_kpool"]) == (512, 0, 128, 16)


def test_glm5_next_records_and_the_lead():
    """The lead: 1,024 + 128 = 1,152 (bf16) and 512 + 16 + 128 = 656 (fp8) per MLA layer.
    From the config the latent has no RoPE part and the indexer key is one fp8 entry (128 e4m3 +
    one f32 scale) per 16-token pool, so the records are 1024 / 528 / 288 + 8.25 B."""
    cfg = glm5_next_defaults()
    per_layer = {}
    for dtype in KVDtype:
        terms = {t.what: t for t in kv_model(cfg, dtype, tp=1).terms}
        mla, idx = terms[f"MLA latent ({dtype.value})"], terms["DSA indexer key (fp8)"]
        assert mla.layers == idx.layers == 11
        per_layer[dtype] = (mla.per_token, idx.per_token)
    assert per_layer == {KVDtype.BF16: (1024, 8.25), KVDtype.FP8: (528, 8.25),
                         KVDtype.NVFP4: (288, 8.25)}
    assert {d: sum(v) for d, v in per_layer.items()} != {KVDtype.BF16: 1152, KVDtype.FP8: 656,
                                                         KVDtype.NVFP4: 368}
    # The seeds' 1152 / 656 are the DeepSeek records with 64 RoPE dims this config lacks.
    assert mla_record(512, 64, KVDtype.BF16).nbytes == 1024 + 128
    assert mla_record(512, 64, KVDtype.FP8).nbytes == 512 + 16 + 128


def test_glm5_next_per_sequence_state():
    cfg = glm5_next_defaults()
    # KDA, 64 heads x 128: bf16 q/k/v conv windows 3*8192*3*2 + f32 state 64*128*128*4.
    assert kda_state(64, 128, 4, tp=1) == 147_456 + 4_194_304
    assert kda_state(64, 128, 4, tp=2) == (147_456 + 4_194_304) // 2
    # kpool tail: raw bf16 key + gate score for 16 tokens.
    assert indexer_tail_state(128, 16) == 8192 and indexer_tail_state(128, 1) == 0
    m = kv_model(cfg, KVDtype.FP8, tp=2)
    assert m.bytes_per_seq == 34 * 2_170_880 + 11 * 8192
    assert m.bytes_per_token == 11 * (528 + 8.25)


def test_indexer_per_token_without_kpool():
    # GLM-5 / DeepSeek-V3.2: one 128 e4m3 + f32 scale per token (vLLM DeepseekV32IndexerCache).
    assert indexer_record(128).nbytes == 132
    glm5 = dict(DEEPSEEK_V3, index_head_dim=128, index_topk=2048, qk_rope_head_dim=64)
    assert kv_model(glm5, KVDtype.FP8, tp=2).bytes_per_token == 61 * (656 + 132)


def test_mtp_layers_add_full_attention_records():
    cfg = glm5_next_defaults()
    base = kv_model(cfg, KVDtype.FP8, tp=2)
    with_mtp = kv_model(cfg, KVDtype.FP8, tp=2, mtp_layers=1)
    assert with_mtp.bytes_per_token - base.bytes_per_token == 528 + 8.25
    assert with_mtp.bytes_per_seq - base.bytes_per_seq == 8192


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_model({"kv_lora_rank": 512}, KVDtype.FP8, tp=1)
    with pytest.raises(ValueError, match="'index_head_dim'|'linear_num_heads'"):
        kv_model({"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                  "kv_lora_rank": 512}, KVDtype.FP8, tp=1)
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        attention_layers({"num_hidden_layers": 2, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="multiple of 16"):
        mla_record(520, 0, KVDtype.NVFP4)
