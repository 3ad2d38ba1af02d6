"""Config vs checkpoint layout: layers, MTP layers, experts per layer, routers."""

from quantize.archs import check_layout, moe_layer_indices


def deepseek_shapes(n_layers=3, mtp=1, experts=4, dense=1, h=64):
    """Tensor name -> shape of a DeepSeek-V3-style checkpoint (FP8 scales included)."""
    s = {"model.embed_tokens.weight": (128, h), "lm_head.weight": (128, h)}
    for layer in range(n_layers + mtp):
        p = f"model.layers.{layer}"
        s[f"{p}.self_attn.q_a_proj.weight"] = (32, h)
        s[f"{p}.self_attn.q_a_proj.weight_scale_inv"] = (1, 1)
        if layer < dense:
            s[f"{p}.mlp.gate_proj.weight"] = (96, h)
            continue
        s[f"{p}.mlp.gate.weight"] = (experts, h)
        s[f"{p}.mlp.gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            for m in ("gate_proj", "up_proj", "down_proj"):
                shape = (h, 32) if m == "down_proj" else (32, h)
                s[f"{p}.mlp.experts.{e}.{m}.weight"] = shape
                s[f"{p}.mlp.experts.{e}.{m}.weight_scale_inv"] = (1, 1)
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        for k in range(mtp):
            s[f"model.layers.{n_layers + k}.{part}"] = (h,) if "norm" in part else (h, 2 * h)
    return s


CONFIG = {"num_hidden_layers": 3, "num_nextn_predict_layers": 1, "n_routed_experts": 4,
          "first_k_dense_replace": 1}


def errors(found):
    return [m for level, m, _ in found if level == "error"]


def test_consistent_checkpoint_has_no_findings():
    assert check_layout(CONFIG, deepseek_shapes()) == []
    assert moe_layer_indices(CONFIG) == {1, 2}


def test_missing_layer_and_extra_layer():
    s = {k: v for k, v in deepseek_shapes().items() if not k.startswith("model.layers.2.")}
    assert errors(check_layout(CONFIG, s)) == [
        "config.json declares 3 decoder layer(s) (0-2, num_hidden_layers=3) and 1 MTP layer(s) "
        "(3, num_nextn_predict_layers=1) but the checkpoint has no tensors for decoder layer(s) 2"]
    extra = dict(deepseek_shapes(), **{"model.layers.7.mlp.gate_proj.weight": (96, 64)})
    assert check_layout(CONFIG, extra) == [
        ("warning", "checkpoint has layer(s) 7 beyond the 3 decoder layer(s) (0-2, "
                    "num_hidden_layers=3) and 1 MTP layer(s) (3, num_nextn_predict_layers=1) "
                    "config.json declares; they are converted as stored", None)]


def test_mtp_layer_missing_parts_named():
    s = {k: v for k, v in deepseek_shapes().items() if "eh_proj" not in k and "hnorm" not in k}
    assert check_layout(CONFIG, s) == [
        ("error", "MTP layer 3 (num_hidden_layers + 0) lacks hnorm.weight, eh_proj.weight",
         "model.layers.3.hnorm.weight")]


def test_expert_count_parts_and_shapes():
    s = deepseek_shapes()
    del s["model.layers.1.mlp.experts.3.up_proj.weight"]
    del s["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    s["model.layers.2.mlp.experts.1.down_proj.weight"] = (64, 48)
    for k in [k for k in s if k.startswith("model.layers.3.mlp.experts.2.")]:
        del s[k]
    s["model.layers.3.mlp.experts.9.gate_proj.weight"] = (32, 64)
    assert errors(check_layout(CONFIG, s)) == [
        "layer 1: expert(s) 3 lack mlp.experts.N.up_proj.weight, which the other experts have",
        "layer 1: expert(s) 3 lack mlp.experts.N.up_proj.weight_scale_inv, which the other "
        "experts have",
        "layer 2: mlp.experts.N.down_proj.weight of expert(s) 1 is [64, 48], the other experts' "
        "[64, 32]",
        "layer 3 has 4 routed experts, config.json declares 4; missing expert(s) 2; unexpected "
        "expert(s) 9",
        "layer 3: expert(s) 9 lack mlp.experts.N.down_proj.weight, which the other experts have",
        "layer 3: expert(s) 9 lack mlp.experts.N.down_proj.weight_scale_inv, which the other "
        "experts have",
        "layer 3: expert(s) 9 lack mlp.experts.N.gate_proj.weight_scale_inv, which the other "
        "experts have",
        "layer 3: expert(s) 9 lack mlp.experts.N.up_proj.weight, which the other experts have",
        "layer 3: expert(s) 9 lack mlp.experts.N.up_proj.weight_scale_inv, which the other "
        "experts have"]


def test_router_rows_and_moe_placement_checked():
    s = deepseek_shapes()
    s["model.layers.1.mlp.gate.weight"] = (8, 64)  # would be quantized as a plain Linear
    cfg = dict(CONFIG, first_k_dense_replace=2)
    assert errors(check_layout(cfg, s)) == [
        "config.json makes layer 1 dense but the checkpoint has 4 routed experts there",
        "layer 1: router mlp.gate.weight has 8 rows but config.json declares 4 routed experts"]


def test_glm5_mlp_layer_types_and_prefixed_names():
    s = {f"model.language_model.{k[len('model.'):]}": v for k, v in deepseek_shapes().items()}
    s["model.visual.layers.0.attn.weight"] = (8, 8)  # vision tower layers are not text layers
    cfg = {"text_config": dict(CONFIG, mlp_layer_types=["dense", "sparse", "dense"])}
    assert errors(check_layout(cfg, s)) == [
        "config.json makes layer 2 dense but the checkpoint has 4 routed experts there"]


def test_unknown_shapes_still_checked_for_presence():
    s = dict(deepseek_shapes())
    s["model.layers.1.mlp.experts.0.up_proj.weight"] = None  # shard header unreadable
    assert check_layout(CONFIG, s) == []


def test_config_without_layer_count_is_reported_not_guessed():
    assert check_layout({"n_routed_experts": 8}, {"model.layers.1.mlp.experts.0.up_proj.weight": (4, 4)}) == [
        ("info", "config.json has no num_hidden_layers: layers, MTP layers and experts not "
                 "checked against it", None)]
