"""Layer-streamed forward: same outputs and statistics as the whole transformers model."""

import pytest
import torch
from tiny_models import build_tiny, load_reference
from torch import nn

from calibrate import calibrate_sequences
from calibrate.data import CalibSet
from calibrate.layerwise import StreamedModel
from formats.sources import open_source


def _seqs(n=3, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, L), generator=g) for L in (9, 17, 24)[:n]]


def _streamed_outputs(src, seqs):
    source = open_source(src)
    try:
        sm = StreamedModel(source)
        hidden, kwargs = sm.capture(seqs)
        carried = [{} for _ in hidden]
        for layer in sm.layers():
            sm.run_layer(layer, hidden, kwargs, carried)
        return sm.logits(hidden)
    finally:
        source.close()


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "glm5_next"])
def test_streamed_forward_matches_whole_model(tmp_path, kind):
    src, ref = build_tiny(tmp_path, kind, n_layers=2)
    model = load_reference(ref, kind)
    seqs = _seqs()
    out = _streamed_outputs(src, seqs)
    for ids, got in zip(seqs, out):
        with torch.no_grad():
            r = model(ids)
        want = r.logits if hasattr(r, "logits") else r.last_hidden_state
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-4 * want.abs().max()


def _reference_input_amax(model, seqs) -> dict[str, float]:
    amax, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and "lm_head" not in name:
            def rec(_m, args, _n=name):
                amax[_n] = max(amax.get(_n, 0.0), float(args[0].abs().amax()))
            hooks.append(mod.register_forward_pre_hook(rec))
    with torch.no_grad():
        for ids in seqs:
            model(ids)
    for h in hooks:
        h.remove()
    return amax


def test_dense_stats_equal_hooks_on_whole_model(tmp_path):
    src, ref = build_tiny(tmp_path, "llama", n_layers=2)
    model = load_reference(ref, "llama")
    seqs = _seqs()
    stats = calibrate_sequences(src, CalibSet(seqs, {"dataset": "test"}), progress=False)
    want = _reference_input_amax(model, seqs)
    assert set(stats.input_amax) == set(want)
    for name, a in want.items():
        assert stats.input_amax[name] == pytest.approx(a, rel=1e-5), name
    # gate and up read the same tensor
    assert stats.input_amax["model.layers.1.mlp.gate_proj"] == stats.input_amax["model.layers.1.mlp.up_proj"]
    # V is v_proj's output (no RoPE): its amax over the same tokens
    outs = []
    h = model.model.layers[1].self_attn.v_proj.register_forward_hook(lambda _m, _a, o: outs.append(o))
    with torch.no_grad():
        for ids in seqs:
            model(ids)
    h.remove()
    vmax = max(float(o.abs().amax()) for o in outs)
    kv = stats.kv_amax["model.layers.1.self_attn"]
    assert kv["v"] == pytest.approx(vmax, rel=1e-5)
    assert kv["mla"] is False and kv["k"] > 0
    # channel statistics: mean of x^2 per input channel, K entries
    ch = stats.channel_sq_mean["model.layers.0.mlp.down_proj"]
    assert ch.shape == (96,) and (ch >= 0).all() and ch.sum() > 0


def test_moe_mla_stats(tmp_path):
    src, ref = build_tiny(tmp_path, "deepseek_v3", n_layers=2)
    seqs = _seqs()
    tokens = sum(s.numel() for s in seqs)
    stats = calibrate_sequences(src, CalibSet(seqs, {"dataset": "test"}), progress=False)
    for layer in (0, 1):
        counts = stats.expert_tokens[f"model.layers.{layer}.mlp.experts"]
        assert sum(counts) == tokens * 2  # top-2 routing
        kv = stats.kv_amax[f"model.layers.{layer}.self_attn"]
        assert kv["mla"] is True
        # the cached latent is exactly what kv_b_proj reads
        assert kv["k"] == pytest.approx(stats.input_amax[f"model.layers.{layer}.self_attn.kv_b_proj"], rel=1e-6)
        for e in range(4):
            if counts[e]:
                g = stats.input_amax[f"model.layers.{layer}.mlp.experts.{e}.gate_proj"]
                assert g == stats.input_amax[f"model.layers.{layer}.mlp.experts.{e}.up_proj"]
                # an expert sees a subset of the tokens the shared expert sees
                assert g <= stats.input_amax[f"model.layers.{layer}.mlp.shared_experts.gate_proj"]


def test_all_experts_mode_sees_every_token(tmp_path):
    src, _ = build_tiny(tmp_path, "deepseek_v3", n_layers=2)
    seqs = _seqs()
    routed = calibrate_sequences(src, CalibSet(seqs, {}), progress=False)
    every = calibrate_sequences(src, CalibSet(seqs, {}), all_experts=True, progress=False)
    shared = every.input_amax["model.layers.1.mlp.shared_experts.gate_proj"]
    for e in range(4):
        # with all tokens, every expert's gate input amax is the whole layer's
        assert every.input_amax[f"model.layers.1.mlp.experts.{e}.gate_proj"] == pytest.approx(shared)
    # routing (and so the layer outputs) are unchanged
    assert every.expert_tokens == routed.expert_tokens
    assert every.kv_amax == routed.kv_amax
