"""The fit planner: seeds' session arithmetic, prediction == converter bytes, memory terms,
speculation arms, verdict, CLI."""

import json
from dataclasses import asdict

import pytest

from formats.checkpoint import INDEX_NAME
from formats.shards import read_header
from quantize.cli import main
from quantize.convert.pipeline import convert
from quantize.fit import (
    GIB,
    Reserve,
    build_tensors,
    parse_draft,
    parse_size,
    plan_fit,
    sessions,
)

NO_RESERVE = Reserve(0, 0, 0)


# ---- the seeds' arithmetic -------------------------------------------------------------------

@pytest.mark.parametrize("pool, expected", [
    (520_192, {128_000: 4.0, 256_000: 2.0}),
    (982_464, {128_000: 7.6, 256_000: 3.8, 512_000: 1.9}),
    (1_703_232, {128_000: 13.1, 256_000: 6.6, 512_000: 3.3}),
])
def test_session_counts_reproduce_the_seeds(pool, expected):
    got = {n: round(sessions(pool, n, answer_tokens=2048), 1) for n in expected}
    assert got == expected


def test_four_128k_sessions_fill_520192_exactly():
    assert 4 * (128_000 + 2048) == 520_192 and sessions(520_192, 128_000) == 4.0
    assert 2 * (256_000 + 2048) == 516_096  # two 256k sessions, 4,096 tokens to spare
    # a per-sequence state costs tokens: 4 sessions no longer fit
    assert sessions(520_192, 128_000, state_tokens=100) < 4.0


# ---- prediction == what the converter writes -------------------------------------------------

@pytest.mark.parametrize("which, recipe, fmt", [
    ("llama", "weight-only", "compressed-tensors"),
    ("glm5_next", "experts-only", "compressed-tensors"),  # weight-only: refused for vLLM
    ("glm5_next", "spark-mixed", "compressed-tensors"),
    ("glm5_next", "spark-mixed", "modelopt"),
])
def test_prediction_equals_converted_bytes(which, recipe, fmt, tiny_fp8_llama, glm5_next_src,
                                           tmp_path):
    src = tiny_fp8_llama if which == "llama" else glm5_next_src
    out = tmp_path / "build"
    convert(src, out, progress=False, device="cpu", recipe=recipe, fmt=fmt, tp=2)
    index = json.loads((out / INDEX_NAME).read_text())
    written = sum(i.nbytes for s in set(index["weight_map"].values())
                  for i in read_header(out / s).values())
    src_plan = plan_fit(src, nodes=2, draft="mtp" if which == "glm5_next" else "none",
                        recipe=recipe, fmt=fmt)
    assert src_plan.recipe == recipe
    assert src_plan.build_bytes == written == index["metadata"]["total_size"]
    # the build read as stored splits over ranks exactly as predicted from the source
    build_plan = plan_fit(out, nodes=2, draft="mtp" if which == "glm5_next" else "none")
    assert build_plan.recipe == "as stored"
    assert build_plan.build_bytes == written
    assert [asdict(w) for w in build_plan.weights] == [asdict(w) for w in src_plan.weights]
    assert build_plan.weights_bytes == src_plan.weights_bytes
    assert build_plan.draft_bytes == src_plan.draft_bytes


# ---- memory terms ----------------------------------------------------------------------------

def test_memory_terms_tiny_llama_tp2(tiny_fp8_llama):
    """Hand-computed: NVFP4 q [64,64] = 2048 packed + 256 scale + 4 global B, k/v [32,64]
    1024 + 128 + 4, o like q, gate/up [128,64] and down [64,128] 4096 + 512 + 4 (20,764 B per
    layer). Packed and block scales split over 2 ranks: 10,368 B per layer; the 14 global scales
    (4 B) and five 128-B norms replicated; bf16 embedding 32,768 / 2. Tied lm_head: not written."""
    rep = plan_fit(tiny_fp8_llama, nodes=2, node_mem_gib=0.001, reserve=NO_RESERVE,
                   kv_dtype="fp8")
    assert rep.build_bytes == 32_768 + 640 + 2 * 20_764
    assert {w.what: w.per_rank_bytes for w in rep.weights} == {
        "replicated: vector": 640 + 14 * 4, "split over TP2": 16_384 + 2 * 10_368}
    assert rep.weights_bytes == 37_816
    assert rep.budget_bytes == int(0.001 * GIB * 0.9) == 966_367
    assert rep.kv_pool_bytes == 966_367 - 37_816
    assert rep.bytes_per_token == 2 * (2 * 1 * 16)  # 2 layers, K+V, 1 KV head per rank, D 16
    assert rep.kv_pool_tokens == (928_551 // (64 * 64)) * 64 == 14_464
    assert rep.margin_bytes == 928_551 - 512 * 64 and rep.fits
    # two ranks on one node share its memory
    two_on_one = plan_fit(tiny_fp8_llama, nodes=1, tp=2, node_mem_gib=0.001, reserve=NO_RESERVE)
    assert two_on_one.budget_bytes == int(0.001 * GIB * 0.9 / 2)


def test_reserve_and_verdict(tiny_fp8_llama):
    rep = plan_fit(tiny_fp8_llama, nodes=1, node_mem_gib=0.001, reserve=NO_RESERVE)
    # shrink the node until one max-model-len request (512 tokens x 128 B) no longer fits
    need = rep.weights_bytes + 512 * rep.bytes_per_token
    just = plan_fit(tiny_fp8_llama, nodes=1, node_mem_gib=need / GIB / 0.9 + 1e-9,
                    reserve=NO_RESERVE)
    assert just.fits and 0 <= just.margin_bytes <= 1
    short = plan_fit(tiny_fp8_llama, nodes=1, node_mem_gib=(need - 64) / GIB / 0.9,
                     reserve=NO_RESERVE)
    assert not short.fits and -65 <= short.margin_bytes < 0
    reserved = plan_fit(tiny_fp8_llama, nodes=1, reserve=Reserve(4.0, 1.0, 1.0))
    unreserved = plan_fit(tiny_fp8_llama, nodes=1, reserve=NO_RESERVE)
    assert unreserved.kv_pool_bytes - reserved.kv_pool_bytes == 6 * GIB


def test_glm_terms_replication_and_state(glm5_next_src):
    """Tiny GLM-5.3-Flash release fixture: layers 0-2 KDA (4 heads x 128, conv 4), layer 3
    MLA (kv_lora_rank 512, no RoPE) + indexer (key 128, kpool 16), layer 4 MTP."""
    rep = plan_fit(glm5_next_src, nodes=2, kv_dtype="fp8", reserve=NO_RESERVE)
    roles = {w.what for w in rep.weights}
    assert {"replicated: mla_a_proj", "replicated: indexer", "replicated: kda_a_proj",
            "replicated: router", "replicated: vector", "split over TP2"} <= roles
    # MTP not loaded without a draft: named in a note, not in the weights
    assert any("MTP layer" in n for n in rep.notes) and rep.draft_bytes == 0
    # fp8 MLA latent 512 e4m3 + 4 f32 scales; indexer (128 e4m3 + 4 B scale) per 16 tokens
    assert rep.bytes_per_token == 528 + 132 / 16
    # 3 KDA layers, 4 heads / 2 ranks: conv 3*2*128*3*2 B + f32 state 2*128*128*4 B;
    # indexer in-progress pool: bf16 key + gate, 16 x 128 each
    assert rep.bytes_per_seq == 3 * (4608 + 131072) + 2 * 2 * 16 * 128
    assert rep.state_tokens == rep.bytes_per_seq / rep.bytes_per_token


def test_speculation_arms_order_and_exact_costs(glm5_next_src):
    """none > mtp > external FP8 > external BF16, the seeds' order, for an external draft
    (a DFlash-like model with its own KV, 64 B/token per rank here) that costs more than the MTP
    layer (1.43 MB per rank and one 536.25 B/token MLA + indexer record, on the tiny fixture);
    each arm costs exactly its weights per rank plus its KV."""
    build = build_tensors(glm5_next_src)
    arms = {a: plan_fit(build, nodes=2, reserve=NO_RESERVE, node_mem_gib=0.05, draft=a)
            for a in ("none", "mtp", "external:44MB,kv=64", "external:88MB,kv=64")}
    none, mtp, fp8, bf16 = arms.values()
    assert none.kv_pool_tokens > mtp.kv_pool_tokens > fp8.kv_pool_tokens > bf16.kv_pool_tokens
    assert none.kv_pool_bytes - mtp.kv_pool_bytes == mtp.draft_bytes > 0
    assert mtp.bytes_per_token - none.bytes_per_token == 528 + 132 / 16  # one MLA + indexer layer
    assert mtp.bytes_per_seq - none.bytes_per_seq == 8192  # the MTP indexer's in-progress pool
    assert fp8.kv_pool_bytes - bf16.kv_pool_bytes == 44_000_000 // 2
    assert none.kv_pool_bytes - fp8.kv_pool_bytes == fp8.draft_bytes == 22_000_000
    assert fp8.bytes_per_token == none.bytes_per_token + 64


def test_mtp_draft_needs_an_mtp_layer(tiny_fp8_llama):
    with pytest.raises(ValueError, match="no MTP layer"):
        plan_fit(tiny_fp8_llama, draft="mtp")


# ---- parsing and CLI -------------------------------------------------------------------------

def test_parse_size_and_draft():
    assert parse_size("5GiB") == 5 * GIB and parse_size("4.5GB") == 4_500_000_000
    assert parse_size("3e9") == 3_000_000_000 and parse_size("512") == 512
    assert parse_size("600KB") == 600_000 and parse_size("2 MiB") == 2 * 2**20
    d = parse_draft("external:6GiB,kv=20KiB")
    assert (d.kind, d.size_bytes, d.kv_bytes_per_token) == ("external", 6 * GIB, 20 * 1024)
    for bad in ("eagle", "external:lots", "external:5GB,kv"):
        with pytest.raises(ValueError):
            parse_draft(bad)


def test_cli_plan_table_and_json(glm5_next_src, capsys):
    assert main(["plan", "--src", str(glm5_next_src), "--nodes", "2", "--kv-dtype", "nvfp4",
                 "--draft", "mtp"]) == 0
    table = capsys.readouterr().out
    assert "TP2" in table and "KV pool" in table and "sessions at once" in table
    assert main(["plan", "--src", str(glm5_next_src), "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tp"] == 2 and data["kv_dtype"] == "fp8" and data["fits"] is True
    # max_position_embeddings 512: no session length fits a request
    assert data["sessions"] == {"128k": None, "256k": None, "512k": None, "1M": None}
    assert main(["plan", "--src", str(glm5_next_src), "--tp", "3", "--nodes", "2"]) == 1


# ---- full-size GLM-5.3-Flash descriptor ------------------------------------------------------

@pytest.fixture(scope="module")
def glm53_full(tmp_path_factory):
    """The full-size GLM-5.3-Flash FP8 release as a header-only descriptor, planned through
    weight-only once (~30 s on 2 cores), for TRT-LLM: vLLM refuses a weight-only glm5_next plan
    (its MLA / indexer / KDA are built unquantized); TRT-LLM's NVFP4 rows are vLLM's (K % 16), so
    the bytes are the weight-only build's."""
    from quantize.data.fixtures import write_release_descriptor

    path = write_release_descriptor(tmp_path_factory.mktemp("full") / "glm53.descriptor.json",
                                    "glm5_next", "full")
    return build_tensors(path, "weight-only", tp=2, engine="trtllm")


def test_full_size_glm53_arms_and_nodes(glm53_full):
    """The seeds' order of the four speculation arms on two nodes, with an external draft shaped
    like the GLM DSpark/DFlash speculators (5 decoder layers at hidden 4096, ~1.05 B params:
    1.05 GB in FP8, 2.1 GB in BF16; 8 KV heads x 128 in bf16 = 20,480 B/token, 10,240 per rank
    at TP2)."""
    arms = {a: plan_fit(glm53_full, nodes=2, draft=a)
            for a in ("none", "mtp", "external:1.05GB,kv=10240", "external:2.1GB,kv=10240")}
    none, mtp, fp8, bf16 = arms.values()
    assert none.kv_pool_tokens > mtp.kv_pool_tokens > fp8.kv_pool_tokens > bf16.kv_pool_tokens
    assert all(r.fits for r in arms.values())
    # the MTP layer (an MLA + MoE decoder layer, NVFP4 in weight-only) is loaded only for mtp
    assert none.draft_bytes == 0 and mtp.draft_bytes > 2 * GIB
    # weight-only NVFP4 GLM-5.3-Flash does not fit one GB10 node; two nodes leave a KV pool
    one = plan_fit(glm53_full, nodes=1)
    assert "predicted for TP2" in one.notes[0]
    assert not one.fits and one.kv_pool_tokens == 0 and one.weights_bytes > one.budget_bytes
    assert none.weights_bytes < one.weights_bytes / 2 + 2 * GIB  # replicated part is small
    assert none.sessions["128k"] > 10 and none.max_model_len == 1_048_576
