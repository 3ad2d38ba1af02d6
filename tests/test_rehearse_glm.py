"""scripts/rehearse_glm.py: the truncated GLM-5.3-Flash source it writes (at 1/32 width here)
is a glm5_next release that pre-flight and ``quantize plan`` accept, with the real layer
schedule; the per-layer timing is read from progress lines, never from the clock."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import rehearse_glm as rh

from quantize.archs import text_config


def test_full_schedule_counts_and_truncated_config():
    assert rh.full_kind_counts(rh.full_schedule()) == {"dense+kda": 3, "sparse+kda": 31,
                                                      "sparse+mla": 11, "mtp": 1}
    t = text_config(rh.rehearsal_config((0, 3, 4)))
    assert (t["num_hidden_layers"], t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"],
            t["q_lora_rank"], t["kv_lora_rank"], t["qk_head_dim"], t["linear_num_heads"], t["hc_mult"],
            t["vocab_size"], t["num_nextn_predict_layers"]) == (3, 4096, 288, 2048, 1536, 512, 256, 64, 4,
                                                                154880, 1)
    assert t["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert t["layer_types"] == ["linear_attention", "deepseek_sparse_attention", "linear_attention"]
    assert t["mhc"] is True and t["topk_method"] == "noaux_tc"  # release keys kept
    with pytest.raises(ValueError, match="increasing indices in 0..44"):
        rh.rehearsal_config((3, 0))


def test_tiny_source_passes_preflight_and_plan(tmp_path, capsys):
    from formats.sources import open_source
    from quantize.cli import main
    from quantize.inspect.preflight import preflight
    from quantize.plan.recipe import load_recipe

    src = tmp_path / "src"
    info = rh.generate(src, (0, 3, 4), 32, "cpu", log=lambda s: None)
    cfg = json.loads((src / "config.json").read_text())
    t = text_config(cfg)
    assert cfg["model_type"] == "glm5_next" and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert (t["num_hidden_layers"], t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"]) == \
        (3, 128, 9, 64)
    # one shard per group: the non-layer tensors, layers 0..2, the MTP layer (3)
    assert info["group_shards"] == {f"model-0000{i + 1}-of-00005.safetensors": g for i, g in
                                    enumerate(["other", "layer.0", "layer.1", "layer.2", "layer.3"])}
    expected = {}
    for name, (storage, shape, _) in rh.source_layout((0, 3, 4), 32)[1].items():
        expected[name] = shape
        if storage == "fp8":
            expected[name + "_scale_inv"] = (-(-shape[0] // 128), -(-shape[1] // 128))
    on_disk = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                on_disk[k] = tuple(f.get_slice(k).get_shape())
    assert on_disk == expected
    expert = "model.language_model.layers.1.mlp.experts.8.down_proj.weight"
    with safe_open(src / "model-00003-of-00005.safetensors", "pt") as f:
        q, s = f.get_tensor(expert), f.get_tensor(expert + "_scale_inv")
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (1, 1)
    w = q.float() * s
    assert w.abs().max().item() == pytest.approx(s.item() * 448.0, rel=1e-6)  # block amax -> 448
    assert 0.015 < w.std().item() < 0.03  # N(0, 0.02) with a log-normal row factor

    source = open_source(src)
    assert source.config["model_type"] == "glm5_next"
    report = preflight(source, recipe=load_recipe("spark-mixed"))
    assert report.errors == [], report.render()
    assert main(["plan", "--src", str(src), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["model"], plan["recipe"]) == ("glm5_next", "spark-mixed")
    groups = {w["what"] for w in plan["weights"]}  # KDA, MLA, DSA indexer, mHC all planned
    assert {"replicated: kda_a_proj", "replicated: mla_a_proj", "replicated: indexer",
            "replicated: mhc", "replicated: router"} <= groups
    assert plan["weights_bytes"] == sum(w["total_bytes"] for w in plan["weights"])


def test_layer_times_from_progress_lines():
    ev = [(1.0, "loading"), (2.0, "convert:   0%|  | 0.00/10.0G [00:00<?, ?B/s]"),
          (5.0, "convert:   0%|  | 0.00/10.0G [00:03<?, ?B/s, model-00001-of-00003.safetensors]"),
          (5.5, "convert:  10%|  | 1.00/10.0G [00:03<?, ?B/s, model-00001-of-00003.safetensors]"),
          (12.0, "convert:  10%|  | 1.00/10.0G [00:10<?, ?B/s, model-00002-of-00003.safetensors]"),
          (14.0, "convert:  60%|  | 6.00/10.0G [00:12<?, ?B/s, model-00003-of-00003.safetensors]")]
    assert rh.shard_times(ev) == {"model-00001-of-00003.safetensors": 3.0,
                                  "model-00002-of-00003.safetensors": 7.0,
                                  "model-00003-of-00003.safetensors": 2.0}
    cal = [(3.0, "calibrate:   0%|          | 0/3 [00:00<?, ?layer/s]"),
           (9.0, "calibrate:  33%|███▎      | 1/3 [00:06<00:12, 6.0s/layer]"),
           (19.0, "calibrate:  67%|██████▋   | 2/3 [00:16<00:08, 8.0s/layer]"),
           (20.0, "calibrate: 100%|██████████| 3/3 [00:17<00:00, 5.6s/layer]"),
           (20.0, "calibrate: 100%|██████████| 3/3 [00:17<00:00, 5.6s/layer]")]
    assert rh.calib_layer_times(cal) == (3.0, [6.0, 10.0, 1.0])


def test_warmup_split_and_projection():
    # layer 1 compiled the kernels: 4 bytes in 20 s against a median of 2 bytes/s
    per = {"other": 1.0, "layer.0": 1.0, "layer.1": 20.0, "layer.2": 2.0, "layer.3": 3.0}
    nbytes = {"other": 5, "layer.0": 2, "layer.1": 4, "layer.2": 4, "layer.3": 6}
    out, warm = rh.split_warmup(per, nbytes)
    assert out == {"other": 1.0, "layer.0": 1.0, "layer.1": 2.0, "layer.2": 2.0, "layer.3": 3.0}
    assert warm == 18.0
    assert rh.split_warmup(out, nbytes) == (out, 0.0)  # nothing slow: unchanged
    kinds = {0: "dense+kda", 1: "sparse+mla", 2: "sparse+kda", 3: "mtp"}
    counts = {"dense+kda": 3, "sparse+mla": 11, "sparse+kda": 31, "mtp": 1}
    total, by_kind = rh.project(out, kinds, counts, fixed=20.0)
    assert total == 20.0 + 3 * 1.0 + 11 * 2.0 + 31 * 2.0 + 1 * 3.0
    assert by_kind == {"dense+kda": 1.0, "sparse+mla": 2.0, "sparse+kda": 2.0, "mtp": 3.0}
    # a kind the rehearsal lacks (MTP in calibration) takes the mean of the MoE kinds
    total, _ = rh.project({"layer.0": 1.0, "layer.1": 2.0, "layer.2": 4.0}, kinds, counts, fixed=0.0)
    assert total == 3 * 1.0 + 11 * 2.0 + 31 * 4.0 + 1 * 3.0
