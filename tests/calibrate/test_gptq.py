"""GPTQ for NVFP4 (quantize/kernels/gptq.py, calibrate/gptq.py) and builds that take its results."""

import json
import shutil

import pytest
import torch
from conftest import load_all

from calibrate.data import CalibSet
from calibrate.gptq import expert_min_tokens, gptq_calib_set, run_gptq, work_folder
from formats.calib_stats import CalibStats
from formats.gptq_results import GPTQ_FILE, GPTQResults
from quantize.base.errors import CalibrationError
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.kernels.gptq import gptq_nvfp4, quantize_nvfp4_rows
from quantize.kernels.nvfp4 import (
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
    quantize_nvfp4_scale2,
    scale_2_from_amax,
)
from quantize.kernels.scale_search import quantize_nvfp4_search


# ---- the kernel -------------------------------------------------------------------------
def _problem(r=32, k=128, n=512, seed=0):
    """A weight and correlated, outlier-channel calibration inputs (as real activations)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(r, k, generator=g) * 0.05
    base = torch.randn(n, k, generator=g)
    x = base @ (torch.randn(k, k, generator=g) / k**0.5) + 0.3 * base
    x[:, :4] *= 10
    return w, x, (x.T @ x) * 2 / n


def _out_err(x, w, deq):
    return float(((x @ w.T - x @ deq.T) ** 2).sum())


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scales", ["rtn", "mse", "mse-act"])
def test_gptq_output_error_below_rtn(act_order, scales):
    w, x, h = _problem()
    g = global_scale_from_amax(w.abs().amax())
    rtn = dequantize_nvfp4(*quantize_nvfp4(w, g), g)
    packed, bs, deq, damp = gptq_nvfp4(w[None], h[None], g.expand(1, 32).clone(), act_order=act_order,
                                       scales=scales)
    assert damp == [0.01]
    # the returned values are exactly what the stored bytes dequantize to
    assert torch.equal(deq[0], dequantize_nvfp4(packed[0], bs[0], g))
    ratio = _out_err(x, w, deq[0]) / _out_err(x, w, rtn)
    assert ratio < 0.3  # measured 0.16 .. 0.21 on this problem


def test_huge_damping_is_rtn_byte_for_byte_in_both_orders():
    w, _, h = _problem()
    g = global_scale_from_amax(w.abs().amax())
    s2 = scale_2_from_amax(w.abs().amax())
    p, s, _, _ = gptq_nvfp4(w[None], h[None], g.expand(1, 32).clone(), damp=1e9)
    rp, rs = quantize_nvfp4(w, g)
    assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    p, s, _, _ = gptq_nvfp4(w[None], h[None], s2.reshape(1).expand(1, 32).clone(), order="scale_2", damp=1e9)
    rp, rs = quantize_nvfp4_scale2(w, s2)
    assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    # with the search: the least-error block scales of the weight itself, the candidates and
    # the score of --scales mse, in both orders
    p, s, _, _ = gptq_nvfp4(w[None], h[None], g.expand(1, 32).clone(), damp=1e9, scales="mse")
    rp, rs = quantize_nvfp4_search(w, g)
    assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    assert not torch.equal(rs.view(torch.uint8), quantize_nvfp4(w, g)[1].view(torch.uint8))  # not RTN
    p, s, _, _ = gptq_nvfp4(w[None], h[None], s2.reshape(1).expand(1, 32).clone(), order="scale_2",
                            damp=1e9, scales="mse")
    rp, rs = quantize_nvfp4_search(w, s2, order="scale_2")
    assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))


def test_identity_hessian_and_fallback_rows_are_rtn_exactly():
    w, _, _ = _problem()
    g = global_scale_from_amax(w.abs().amax())
    rp, rs = quantize_nvfp4(w, g)
    eye = 3 * torch.eye(128)[None]
    for act_order in (False, True):
        p, s, _, _ = gptq_nvfp4(w[None], eye, g.expand(1, 32).clone(), act_order=act_order)
        assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    p, s, deq = quantize_nvfp4_rows(w[None], g.expand(1, 32).clone())
    assert torch.equal(p[0], rp) and torch.equal(deq[0], dequantize_nvfp4(rp, rs, g))


def test_dead_input_channel_keeps_its_weight_and_batches_are_independent():
    w, _, h = _problem()
    h[5, :] = 0
    h[:, 5] = 0  # no token ever reached channel 5
    g = global_scale_from_amax(w.abs().amax())
    p1, s1, deq1, _ = gptq_nvfp4(w[None], h[None], g.expand(1, 32).clone())
    assert torch.isfinite(deq1).all() and deq1[0, :, 5].abs().sum() > 0
    # batched with another problem, each result is the same as alone
    w2, _, h2 = _problem(seed=1)
    g2 = global_scale_from_amax(w2.abs().amax())
    pb, sb, _, _ = gptq_nvfp4(torch.stack([w, w2]), torch.stack([h, h2]),
                              torch.stack([g.expand(32), g2.expand(32)]))
    assert torch.equal(pb[0], p1[0]) and torch.equal(sb[0].view(torch.uint8), s1[0].view(torch.uint8))


def test_kernel_refuses_bad_input():
    w, _, h = _problem()
    g = torch.ones(1, 32)
    with pytest.raises(ValueError, match="damping must be > 0"):
        gptq_nvfp4(w[None], h[None], g, damp=0)
    with pytest.raises(ValueError, match="block must be a positive multiple of 16"):
        gptq_nvfp4(w[None], h[None], g, block=24)
    with pytest.raises(ValueError, match=r"scalar has shape \(32,\), expected per row \(1, 32\)"):
        gptq_nvfp4(w[None], h[None], g[0])
    with pytest.raises(ValueError, match="Hessian must be float32"):
        gptq_nvfp4(w[None], h[None].double(), g)


# ---- layer-streamed GPTQ and builds ------------------------------------------------------
def _calib(n=4, length=32, seed=2):
    g = torch.Generator().manual_seed(seed)
    return CalibSet([torch.randint(0, 256, (1, length), generator=g) for _ in range(n)], {"dataset": "t"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tiny_models import build_tiny

    root = tmp_path_factory.mktemp("gptq")
    src, _ = build_tiny(root, "llama", n_layers=2, reference=False)
    return root, src


def test_dense_build_takes_gptq_results_with_shared_global_scales(llama, tmp_path):
    from formats.sources import open_source

    _, src = llama
    work = tmp_path / "w"
    run = run_gptq(src, _calib(), work, progress=False)
    assert run.fallback == {} and len(run.gptq) == 14  # 7 Linears x 2 layers
    # Linears fed the very same input share its first reader's Hessian
    assert run.shared == {f"model.layers.{i}.{m}": f"model.layers.{i}.{o}" for i in (0, 1)
                          for m, o in (("self_attn.k_proj", "self_attn.q_proj"), ("self_attn.v_proj", "self_attn.q_proj"),
                                       ("mlp.up_proj", "mlp.gate_proj"))}
    out = tmp_path / "b"
    convert(src, out, gptq=work, progress=False, device="cpu")
    t, res, source = load_all(out), GPTQResults(work), open_source(src)
    p = "model.layers.1.self_attn"
    amax = max(float(source.read(f"{p}.{m}_proj.weight").abs().amax()) for m in "qkv")
    for m in "qkv":  # the fused group shares the global scale of its whole amax
        assert torch.equal(t[f"{p}.{m}_proj.weight_global_scale"], global_scale_from_amax(amax))
    for mod in res.modules:  # the build holds exactly the GPTQ bytes
        packed, bs, scalar = res.get(mod)
        assert torch.equal(t[f"{mod}.weight_packed"], packed)
        assert torch.equal(t[f"{mod}.weight_scale"].view(torch.uint8), bs.view(torch.uint8))
        assert torch.equal(t[f"{mod}.weight_global_scale"], scalar)
    # GPTQ moved the bytes away from round-to-nearest
    w = source.read("model.layers.0.mlp.down_proj.weight")
    rp, _ = quantize_nvfp4(w, global_scale_from_amax(w.abs().amax()))
    assert not torch.equal(t["model.layers.0.mlp.down_proj.weight_packed"], rp)
    manifest = json.loads((out / "spark_quant_manifest.json").read_text())
    assert manifest["options"]["method"] == "gptq" and manifest["options"]["gptq_sha256"] == res.sha256
    source.close()


def test_build_refuses_results_of_another_order_or_global_scale(llama, tmp_path):
    _, src = llama
    work = tmp_path / "w"
    run_gptq(src, _calib(n=2), work, layers=[1], progress=False)
    with pytest.raises(CalibrationError, match="made in the 'global' NVFP4 order; this output format "
                                               "needs 'scale_2'"):
        convert(src, tmp_path / "m", gptq=work, fmt="modelopt", progress=False, device="cpu")
    # a result whose global scale is not its fused group's is refused, naming the tensor
    name = "model.layers.1.self_attn.k_proj"
    f = work / GPTQResults(work).modules[name]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(f))
    tensors[f"{name}::scalar"] = tensors[f"{name}::scalar"] * 2
    save_file(tensors, str(f))
    with pytest.raises(CalibrationError, match=f"GPTQ result of {name}.weight was made with NVFP4 scalar"):
        convert(src, tmp_path / "c", gptq=work, progress=False, device="cpu")
    (work / GPTQ_FILE).unlink()
    with pytest.raises(CalibrationError, match="the GPTQ pass did not finish"):
        convert(src, tmp_path / "d", gptq=work, progress=False, device="cpu")


def test_moe_fixture_end_to_end_with_expert_fallback(tmp_path):
    from formats.sources import open_source
    from quantize.data.fixtures import write_release_fixture
    from quantize.inspect.verify import verify

    src = write_release_fixture(tmp_path / "src", "deepseek_v3")
    out = tmp_path / "b"
    # the "random" set: 4 x 32 tokens, top-2 of 8 experts -> 32 routings per expert on average,
    # against the fallback floor max(16, K/8) = 32 for gate/up (K 256) and 16 for down (K 128)
    assert main(["nvfp4", "--src", str(src), "--out", str(out), "--method", "gptq", "--dataset", "random",
                 "--samples", "4", "--seq-len", "32", "--recipe", "experts-only", "--quiet",
                 "--device", "cpu"]) == 0
    assert not work_folder(out).exists()  # removed once the build has its manifest
    opts = json.loads((out / "spark_quant_manifest.json").read_text())["options"]
    fallback = opts["gptq"]["fallback"]
    source = open_source(src)
    assert 0 < len(fallback) < opts["gptq"]["modules"]
    t = load_all(out)
    for mod, tokens in fallback.items():  # fallback: exactly the round-to-nearest bytes
        k = source.tensors[mod + ".weight"].shape[1]
        assert tokens < expert_min_tokens(k)
        grp = [mod.rsplit(".", 1)[0] + f".{p}" for p in ("gate_proj", "up_proj")] if "down" not in mod else [mod]
        amax = max(float(source.read(m + ".weight").abs().amax()) for m in grp)
        rp, _ = quantize_nvfp4(source.read(mod + ".weight"), global_scale_from_amax(amax))
        assert torch.equal(t[f"{mod}.weight_packed"], rp)
    gptqd = [m[: -len(".weight_packed")] for m in t if m.endswith(".weight_packed")
             and ".experts." in m and m[: -len(".weight_packed")] not in fallback]
    assert gptqd
    for mod in gptqd:  # GPTQ'd experts dequantize to finite values near the source
        deq = dequantize_nvfp4(t[f"{mod}.weight_packed"], t[f"{mod}.weight_scale"],
                               t[f"{mod}.weight_global_scale"])
        w = source.read(mod + ".weight")
        assert torch.isfinite(deq).all() and float((deq - w).norm() / w.norm()) < 0.3
    source.close()
    assert verify(out).ok


def test_calibration_stats_rebuild_or_ask_for_a_dataset(llama, tmp_path):
    _, src = llama
    calib = gptq_calib_set(src, dataset="random", samples=2, seq_len=8)
    stats = CalibStats(meta=dict(calib.meta))
    stats.save(tmp_path / "s")
    again = gptq_calib_set(src, calibration=tmp_path / "s")
    assert again.meta["tokens_sha256"] == calib.meta["tokens_sha256"]
    stats.meta["tokens_sha256"] = "0" * 64
    stats.save(tmp_path / "s")
    with pytest.raises(CalibrationError, match="rebuilds to other tokens .* a stats folder does not hold "
                                               "the X\\^T X Hessians GPTQ needs, so pass --dataset D"):
        gptq_calib_set(src, calibration=tmp_path / "s")
    CalibStats(meta={"dataset": "t"}).save(tmp_path / "old")
    with pytest.raises(CalibrationError, match="records no rebuildable calibration set"):
        gptq_calib_set(src, calibration=tmp_path / "old")
    with pytest.raises(CalibrationError, match="--method gptq needs calibration tokens: --dataset D"):
        gptq_calib_set(src)


def test_cli_gptq_options_belong_to_gptq(llama, tmp_path, capsys):
    _, src = llama
    assert main(["nvfp4", "--src", str(src), "--out", str(tmp_path / "x"), "--dataset", "random"]) == 1
    assert ("--dataset, --samples, --seq-len, --damp and --act-order are options of --method gptq"
            in capsys.readouterr().err)
    assert main(["nvfp4", "--src", str(src), "--out", str(tmp_path / "y"), "--method", "gptq", "--quiet"]) == 1
    assert ("--method gptq needs calibration tokens: --dataset D, or --calibration STATS of `quantize "
            "calibrate` to rebuild its set") in capsys.readouterr().err
    shutil.rmtree(tmp_path, ignore_errors=True)
