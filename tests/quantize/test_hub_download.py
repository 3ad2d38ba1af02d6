"""``quantize nvfp4 --src ORG/NAME``: the real CLI and the real huggingface_hub client against a
local Hub endpoint (tests/hub_server.py), with HF_ENDPOINT / HF_HOME / HF_TOKEN / HF_HUB_OFFLINE
set in the child's environment as a user would."""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from formats.manifest import MANIFEST_NAME, PROGRESS_NAME
from formats.sources import ShardFiles
from quantize.base.errors import OutputError
from quantize.convert.pipeline import convert
from quantize.inspect import budget
from quantize.kernels.fp8 import quantize_fp8_block
from tests.hub_server import ROOT, FakeHub, client_env, run_quantize

REPO = "org/tiny-fp8"
TOKEN = "hf_test_token"
SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def layered_fp8(folder: Path, layers: int = 4, h: int = 256, inter: int = 512, kv: int = 128,
                vocab: int = 512) -> Path:
    """A llama-shaped block-FP8 checkpoint laid out like the DeepSeek / GLM releases: tensors in
    layer order, one shard per layer, each cut between ``mlp.gate_proj.weight`` and its
    ``weight_scale_inv`` so every shard needs the next one (scale sidecar and the gate/up fused
    group's amax) — the cross-shard case a streaming download has to hold two shards for."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g).bfloat16()}
    order = ["model.embed_tokens.weight"]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(h).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
        for m, shape in [("mlp.down_proj", (h, inter)), ("mlp.gate_proj", (inter, h)),
                         ("mlp.up_proj", (inter, h)), ("self_attn.k_proj", (kv, h)),
                         ("self_attn.o_proj", (h, h)), ("self_attn.q_proj", (h, h)),
                         ("self_attn.v_proj", (kv, h))]:
            q, s = quantize_fp8_block(torch.randn(*shape, generator=g) * 0.05)
            t[f"{p}.{m}.weight"], t[f"{p}.{m}.weight_scale_inv"] = q, s
        order += sorted(n for n in t if n.startswith(p + "."))
    t["model.norm.weight"] = torch.ones(h).bfloat16()
    order.append("model.norm.weight")
    cuts = [order.index(f"model.layers.{i}.mlp.gate_proj.weight_scale_inv") for i in range(layers - 1)]
    bounds = [0, *cuts, len(order)]
    weight_map = {}
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        name = f"model-{i + 1:05d}-of-{len(bounds) - 1:05d}.safetensors"
        save_file({k: t[k].contiguous() for k in order[a:b]}, str(folder / name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(order[a:b], name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "tie_word_embeddings": True,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny FP8\n")
    return folder


def _full_gets(log: list[dict]) -> list[str]:
    return [e["file"] for e in log if e.get("full") and e["file"].endswith(".safetensors")]


def test_stream_within_two_shards_and_resume_after_kill(tmp_path):
    src = layered_fp8(tmp_path / "src")
    sizes = {s: (src / s).stat().st_size for s in SHARDS}
    two_largest = sum(sorted(sizes.values())[-2:])
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        commit = hub.serve_folder(REPO, src, private=True, card_data={"license": "mit"})
        hub.watch = hf_home
        env = client_env(hub, hf_home, HF_TOKEN=TOKEN)
        # A source budget of the two largest shards: shard 3 is fetched only once shard 1 is
        # converted and deleted.
        args = ["nvfp4", "--src", REPO, "--out", str(out), "--quiet", "--device", "cpu",
                "--source-budget", str(two_largest)]
        # Run 1 is killed (SIGKILL, no cleanup) when it asks for shard 3: shard 1 is converted,
        # shard 2 was fetched as shard 1's partner and is not converted yet.
        rc, _, err = run_quantize(args, env, hub,
                               kill_on=lambda ev: ev.get("full") and ev["file"] == SHARDS[2])
        assert rc == -signal.SIGKILL, err
        assert _full_gets(hub.log) == SHARDS[:3]
        ledger = json.loads((out / PROGRESS_NAME).read_text())
        assert sorted(ledger["shards"]) == [SHARDS[0]]
        state = json.loads((out / ".spark-quant-hub.json").read_text())
        assert state["commit"] == commit and set(state["fetched"]) == set(SHARDS[:3])
        blobs = hf_home / "hub" / "models--org--tiny-fp8" / "blobs"
        cached = {p.name for p in blobs.iterdir()}
        sha = {s: hashlib.sha256((src / s).read_bytes()).hexdigest() for s in SHARDS}
        assert sha[SHARDS[0]] not in cached and sha[SHARDS[1]] in cached  # 1 deleted, 2 kept

        n = len(hub.log)
        rc, stdout, err = run_quantize(args + ["--resume"], env, hub)
        assert rc == 0, err
        # Shard 1 (finished) and shard 2 (still cached) are not downloaded again; the gate/up
        # group split over shards 1|2 takes its amax from the resume ledger.
        assert _full_gets(hub.log[n:]) == SHARDS[2:]
        assert "1 resumed" in stdout

        # Peak source bytes on disk, sampled by the server from the cache folder at each shard
        # download: never more than the two largest shards, and two at once (partner held).
        peak = max(s["on_disk"] + s["size"] for s in hub.samples)
        assert peak <= two_largest
        assert peak > max(sizes.values())
        assert hub.blob_bytes() == 0  # every downloaded shard deleted after use
        assert not (out / ".spark-quant-hub.json").exists() and not (out / PROGRESS_NAME).exists()

    man = json.loads((out / MANIFEST_NAME).read_text())
    assert man["source"]["repo"] == REPO and man["source"]["commit"] == commit
    assert man["source"]["license"] == "mit"
    assert {s: man["source"]["files"][s]["sha256"] for s in SHARDS} == sha
    # Byte-identical to converting the same checkpoint from a local folder in one go.
    ref = tmp_path / "ref"
    convert(src, ref, progress=False, device="cpu")
    for name in [*SHARDS, "config.json", "model.safetensors.index.json", "tokenizer_config.json"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


def test_offline_private_and_missing_shard(tmp_path):
    src = layered_fp8(tmp_path / "src")
    hf_home = tmp_path / "hf"
    with FakeHub(token=TOKEN) as hub:
        commit = hub.serve_folder(REPO, src, private=True, card_data={"license": "mit"})
        # Private repo without HF_TOKEN: refused before anything is downloaded.
        rc, _, err = run_quantize(["nvfp4", "--src", REPO, "--out", str(tmp_path / "o0")],
                               client_env(hub, hf_home), hub)
        assert rc == 1 and "HF_TOKEN" in err and REPO in err
        # Fill the cache with huggingface_hub (as `hf download` would), then go offline.
        fill = ("import sys; from huggingface_hub import hf_hub_download as d; "
                f"[d({REPO!r}, f) for f in sys.argv[1:]]")
        subprocess.run([sys.executable, "-c", fill, *sorted(p.name for p in src.iterdir())],
                       env=client_env(hub, hf_home, HF_TOKEN=TOKEN), check=True)
        blobs_before = sorted(p.name for p in (hf_home / "hub/models--org--tiny-fp8/blobs").iterdir())
        n = len(hub.log)
        env = client_env(hub, hf_home, HF_HUB_OFFLINE="1")
        rc, _, err = run_quantize(["nvfp4", "--src", REPO, "--out", str(tmp_path / "o1"), "--quiet",
                                "--device", "cpu"], env, hub)
        assert rc == 0, err
        assert hub.log[n:] == []  # not one request
        blobs_after = sorted(p.name for p in (hf_home / "hub/models--org--tiny-fp8/blobs").iterdir())
        assert blobs_after == blobs_before  # the user's cache is never deleted
        man = json.loads((tmp_path / "o1" / MANIFEST_NAME).read_text())["source"]
        assert (man["repo"], man["commit"], man["offline"], man["license"]) == (REPO, commit, True, "mit")
        # An incomplete cache offline: stop before converting, naming the missing shard.
        (hf_home / "hub/models--org--tiny-fp8/snapshots" / commit / SHARDS[1]).unlink()
        rc, _, err = run_quantize(["nvfp4", "--src", REPO, "--out", str(tmp_path / "o2")], env, hub)
        assert rc == 1 and SHARDS[1] in err and "offline" in err
        assert hub.log[n:] == []


def test_predicted_output_bytes_match_the_build(tmp_path):
    from formats.sources import open_source
    from quantize.plan.recipe import load_recipe
    from quantize.plan.tensors import plan_tensors, predict_outputs

    src = layered_fp8(tmp_path / "src")
    source = open_source(src)
    outputs = predict_outputs(source, plan_tensors(source, load_recipe("weight-only")), "compressed-tensors")
    predicted = budget.predicted_output_bytes(source, outputs)
    summary = convert(src, tmp_path / "out", progress=False, device="cpu")
    assert predicted == summary.bytes_out  # index total_size: tensor bytes actually written


class _ToFetch(ShardFiles):
    def to_fetch(self):
        return {"a": 3 * 2**30, "b": 5 * 2**30, "c": 4 * 2**30}


def test_free_disk_check_stops_with_the_numbers(tmp_path, monkeypatch):
    free = {"v": 10 * 2**30}
    monkeypatch.setattr(budget.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(100 * 2**30, 0, free["v"]))
    # output 2 GiB + the two largest shards still to download (5 + 4 GiB) on one filesystem
    with pytest.raises(OutputError) as e:
        budget.check_free_disk(tmp_path / "out", 2 * 2**30, _ToFetch(tmp_path))
    assert str(e.value).startswith(f"not enough free disk on the filesystem of {tmp_path}: need "
                                   "11.00 GiB (output 2.00 GiB + 2 largest source shards to "
                                   "download 9.00 GiB), free 10.00 GiB.")
    free["v"] = 11 * 2**30
    budget.check_free_disk(tmp_path / "out", 2 * 2**30, _ToFetch(tmp_path))  # fits exactly
    # convert() runs the check before the first shard and writes nothing.
    free["v"] = 2**20
    src = layered_fp8(tmp_path / "src")
    with pytest.raises(OutputError, match=r"need 1\.5 MiB \(output 1\.5 MiB\), free 1\.0 MiB"):
        convert(src, tmp_path / "o", progress=False, device="cpu")
    assert not list((tmp_path / "o").glob("*.safetensors"))


class _Recording(ShardFiles):
    """Local shards, recording when the converter first needs each one and releases it."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.events, self.held = [], set()

    def path(self, shard: str) -> Path:
        if shard not in self.held:
            self.held.add(shard)
            self.events.append(("fetch", shard[10]))
        return super().path(shard)

    def release(self, shard: str) -> None:
        if shard in self.held:
            self.held.discard(shard)
            self.events.append(("release", shard[10]))


def test_stream_releases_each_shard_after_its_last_reader(tmp_path):
    from formats.sources import open_source

    files = _Recording(layered_fp8(tmp_path / "src"))
    convert(open_source(files.folder, files), tmp_path / "out", progress=False, device="cpu")
    # Shard i needs shard i+1 (gate scale and up_proj); it is released as soon as shard i is
    # written, before shard i+2 is fetched: never more than two shards held.
    assert files.events == [("fetch", "1"), ("fetch", "2"), ("release", "1"), ("fetch", "3"),
                            ("release", "2"), ("fetch", "4"), ("release", "3"), ("release", "4")]


class _CrashAt(ShardFiles):
    """Local shards; the first read of ``crash`` raises, like a run killed mid-build."""

    def __init__(self, folder: Path, crash: str):
        super().__init__(folder)
        self.crash = crash

    def path(self, shard: str) -> Path:
        if shard == self.crash:
            raise RuntimeError("interrupted")
        return super().path(shard)


def test_resume_reuses_only_amax_of_unchanged_source_shards(tmp_path):
    from safetensors.torch import load_file

    from formats.sources import open_source

    src = layered_fp8(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="interrupted"):  # shard 1 done, killed in shard 2
        convert(open_source(src, _CrashAt(src, SHARDS[2])), out, progress=False, device="cpu")
    ledger = json.loads((out / PROGRESS_NAME).read_text())
    up0 = "model.layers.0.mlp.up_proj.weight"  # in shard 2, fused with gate_proj in shard 1
    assert up0 in ledger["amax"][SHARDS[1]]["values"]
    # Shard 2 changes (up_proj of layer 0 doubled) before the resume: its recorded amax must not
    # be reused, or the gate/up global scale of layer 0 would come from the old bytes.
    t = load_file(str(src / SHARDS[1]))
    t[up0 + "_scale_inv"] = t[up0 + "_scale_inv"] * 2
    save_file(t, str(src / SHARDS[1]), metadata={"format": "pt"})
    convert(src, out, resume=True, progress=False, device="cpu")
    ref = tmp_path / "ref"
    convert(src, ref, progress=False, device="cpu")
    for name in SHARDS:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


# A child process (the environment of a user pointed at the local Hub) that opens the Hub
# source with a source budget, converts it, and prints the fetcher's trace. Before each
# release it waits until the read-ahead is idle (blocked on the budget or done), so the trace
# shows how far ahead the budget let it go without any timing. A second read of a downloaded
# shard to hash it would call sha256_file: it raises here.
_CHILD = """
import json, sys
from pathlib import Path
import quantize.hub.download as d
from quantize.convert.pipeline import convert

def no_second_read(p):
    raise AssertionError(f"second read of {p} to hash it")

d.sha256_file = no_second_read
source, info, files = d.open_hub_source(sys.argv[1], Path(sys.argv[2]), budget=int(sys.argv[3]))
release = files.release
def release_when_idle(shard):
    assert files.idle.wait(120), "the read-ahead never went idle"
    release(shard)
files.release = release_when_idle
convert(source, sys.argv[2], progress=False, device="cpu", source_info=info)
print(json.dumps({"trace": files.trace, "budget": files.budget, "peak": files.peak_bytes}))
"""


def _child(hub: FakeHub, hf_home: Path, out: Path, budget: int) -> dict:
    env = client_env(hub, hf_home, HF_TOKEN=TOKEN)
    r = subprocess.run([sys.executable, "-c", _CHILD, REPO, str(out), str(budget)], env=env,
                       capture_output=True, text=True, timeout=240, check=False,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_read_ahead_fills_the_budget_and_hashes_the_stream(tmp_path):
    src = layered_fp8(tmp_path / "src")
    size = {s: (src / s).stat().st_size for s in SHARDS}
    budget = size[SHARDS[0]] + size[SHARDS[1]] + size[SHARDS[2]]  # three shards, not four
    assert budget < sum(size.values()) and budget - size[SHARDS[0]] + size[SHARDS[3]] > budget
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        got = _child(hub, hf_home, out, budget)
        assert _full_gets(hub.log) == SHARDS  # each shard downloaded once, in stream order
    assert got["budget"] == budget
    s1, s2, s3, s4 = SHARDS
    # Shards 1-3 are downloaded before the converter lets go of shard 1 (three ahead of a
    # converter that holds two); shard 4 does not fit until shard 2 is deleted too.
    events = [(e, s) for e, s, _ in got["trace"]]
    assert events == [("start", s1), ("done", s1), ("start", s2), ("done", s2), ("start", s3),
                      ("done", s3), ("delete", s1), ("delete", s2), ("start", s4), ("done", s4),
                      ("delete", s3), ("delete", s4)]
    held = [h for _, _, h in got["trace"]]
    assert max(held) == budget and got["peak"] == budget  # within the budget, and all of it
    assert held[-1] == 0
    sha = {hashlib.sha256((src / s).read_bytes()).hexdigest() for s in SHARDS}
    assert not sha & {p.name for p in (hf_home / "hub/models--org--tiny-fp8/blobs").iterdir()}
    ref = tmp_path / "ref"
    convert(src, ref, progress=False, device="cpu")
    for name in SHARDS:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


def test_corrupt_byte_is_fetched_again_then_named(tmp_path):
    src = layered_fp8(tmp_path / "src")
    sha = hashlib.sha256((src / SHARDS[1]).read_bytes()).hexdigest()
    hf_home = tmp_path / "hf"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        env = client_env(hub, hf_home, HF_TOKEN=TOKEN)
        args = ["nvfp4", "--src", REPO, "--quiet", "--device", "cpu"]
        # One flipped byte in shard 2 and a connection dropped in shard 1: the stream's hash
        # catches the byte and shard 2 is downloaded again; shard 1 resumes with a range.
        hub.corrupt = [{"path": SHARDS[1], "offset": 300_000, "times": 1}]
        hub.drop = [{"path": SHARDS[0], "after": 200_000, "times": 1}]
        rc, _, err = run_quantize(args + ["--out", str(tmp_path / "o1")], env, hub)
        assert rc == 0, err
        assert _full_gets(hub.log) == [SHARDS[0], SHARDS[1], SHARDS[1], SHARDS[2], SHARDS[3]]
        header_probe = "bytes=0-100000"  # huggingface_hub's safetensors header read
        assert [e["range"] for e in hub.log if e.get("file") == SHARDS[0] and e.get("bytes")
                and e["range"] != header_probe] == [None, "bytes=200000-"]
        assert f"shard {SHARDS[1]}: sha256 of the received bytes is " in err  # the warning
        ref = tmp_path / "ref"
        convert(src, ref, progress=False, device="cpu")
        for name in SHARDS:
            assert (tmp_path / "o1" / name).read_bytes() == (ref / name).read_bytes(), name
        # The same byte flipped twice in a row: a clear error naming the shard, nothing kept.
        hub.corrupt = [{"path": SHARDS[1], "offset": 300_000, "times": 2}]
        rc, _, err = run_quantize(args + ["--out", str(tmp_path / "o2")], env, hub)
        assert rc == 1
        assert (f"shard {SHARDS[1]} of {REPO}@" in err and f"sha256 differs from the Hub's LFS "
                f"sha256 {sha}" in err and "twice in a row); deleted it, run again to download "
                "it afresh" in err), err
        blobs = hf_home / "hub/models--org--tiny-fp8/blobs"
        assert not [p for p in blobs.iterdir() if p.name.startswith(sha)]



def _cache_emptied_and_local_build(src: Path, hf_home: Path, out: Path, ref: Path) -> None:
    """After a streamed multi-rank build: no source blob left in the cache, no Hub state file
    in the build, and the build byte for byte the local one."""
    sha = {hashlib.sha256((src / s).read_bytes()).hexdigest() for s in SHARDS}
    assert not sha & {p.name for p in (hf_home / "hub/models--org--tiny-fp8/blobs").iterdir()}
    assert not list(out.glob(".spark-quant-hub*"))
    convert(src, ref, progress=False, device="cpu")
    for name in [*SHARDS, "config.json", "model.safetensors.index.json"]:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name

def test_two_workers_from_the_hub_equal_a_local_build(tmp_path):
    src = layered_fp8(tmp_path / "src")
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        env = client_env(hub, hf_home, HF_TOKEN=TOKEN)
        rc, stdout, err = run_quantize(["nvfp4", "--src", REPO, "--out", str(out), "--quiet",
                                        "--device", "cpu", "--workers", "2"], env, hub)
        assert rc == 0, err
        # Both ranks read the shards they share (a scale sidecar or a fused-group partner)
        # from one copy in the cache: every shard is downloaded exactly once, and every one
        # is deleted at the end.
        assert sorted(_full_gets(hub.log)) == SHARDS
    assert "deleted after use" in stdout
    _cache_emptied_and_local_build(src, hf_home, out, tmp_path / "ref")


def test_partner_read_after_its_converter_released_it_is_not_fetched_again(tmp_path):
    """--workers 2: rank 0 converts shards 1 and 4, rank 1 shards 2 and 3 (assign_shards), and
    each takes a gate/up partner's amax from a shard of the other (layered_fp8 cuts gate_proj
    from up_proj at every shard boundary): rank 1 reads layer 0's gate_proj in shard 1, rank 0
    layer 2's in shard 3. Gates (tests/hub_gates.py) hold each of those reads until the rank
    converting the shard has released it: the interleaving a loaded machine produced, in which
    that rank deleted the shard as its only reader and the partner read downloaded it again.
    Both ranks are readers of it, so it stays in the cache until the second one is done:
    downloaded once, deleted once, and the build is the local one."""
    src = layered_fp8(tmp_path / "src")
    hf_home, out, events = tmp_path / "hf", tmp_path / "out", tmp_path / "events"
    events.mkdir()
    gates = f"1:{SHARDS[0]}:0,0:{SHARDS[2]}:1"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        env = client_env(hub, hf_home, HF_TOKEN=TOKEN, SPARK_QUANT_TEST_GATES=str(events))
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "hub_gates.py"), gates, "--",
                            "nvfp4", "--src", REPO, "--out", str(out), "--quiet", "--device",
                            "cpu", "--kernel", "reference", "--workers", "2"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=240,
                           check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        # both gated reads happened, each after the other rank's release of that shard
        assert sorted(p.name for p in events.glob("passed.*")) == [
            f"passed.0.{SHARDS[2]}", f"passed.1.{SHARDS[0]}"]
        assert sorted(_full_gets(hub.log)) == SHARDS
    assert "deleted after use" in r.stdout
    _cache_emptied_and_local_build(src, hf_home, out, tmp_path / "ref")


def test_torchrun_two_ranks_from_the_hub_equal_a_local_build(tmp_path):
    """torchrun (gloo, two ranks on this machine) from the Hub: rank 0 plans from the Hub and
    hands the plan to rank 1, both fetch into one HF_HOME, each shard is downloaded once and
    deleted after its last reader, and the build is the local one byte for byte."""
    src = layered_fp8(tmp_path / "src")
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        env = client_env(hub, hf_home, HF_TOKEN=TOKEN, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", "-m", "quantize.cli", "nvfp4", "--src", REPO,
                            "--out", str(out), "--device", "cpu", "--kernel", "reference",
                            "--quiet"], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=240, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(_full_gets(hub.log)) == SHARDS
        assert [e["file"] for e in hub.log if e.get("file") == "config.json" and e.get("full")
                ] == ["config.json"]  # rank 0 alone resolved and listed the repo
    assert r.stdout.count("deleted after use") == 1  # rank 0 reports, rank 1 stays quiet
    _cache_emptied_and_local_build(src, hf_home, out, tmp_path / "ref")


# A child process that opens the Hub source with a budget of one shard and plans two: shard 1
# is fetched, the read-ahead waits for the budget before shard 2; the converter then lets go
# of shard 2 without reading it (a shard whose only tensor is skipped) and of shard 1.
_RELEASED_UNREAD = """
import json, sys
from pathlib import Path
import quantize.hub.download as d

out = Path(sys.argv[2])
out.mkdir()
source, info, files = d.open_hub_source(sys.argv[1], out, budget=int(sys.argv[3]))
s1, s2 = sys.argv[4:6]
files.will_read([[s1, s2]], 0, [s1, s2])
assert files.idle.wait(120), "the read-ahead never waited for the budget"
files.release(s2)
files.release(s1)
files._thread.join(120)
assert not files._thread.is_alive()
files.finish()
print(json.dumps([(e, s) for e, s, _ in files.trace]))
"""


def test_read_ahead_skips_a_shard_released_before_it_was_fetched(tmp_path):
    src = layered_fp8(tmp_path / "src")
    s1, s2 = SHARDS[:2]
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    with FakeHub(token=TOKEN) as hub:
        hub.serve_folder(REPO, src, private=True)
        r = subprocess.run([sys.executable, "-c", _RELEASED_UNREAD, REPO, str(out),
                            str((src / s1).stat().st_size), s1, s2],
                           env=client_env(hub, hf_home, HF_TOKEN=TOKEN), capture_output=True,
                           text=True, timeout=240, cwd=ROOT, check=False)
        assert r.returncode == 0, r.stderr[-3000:]
        assert _full_gets(hub.log) == [s1]  # shard 2 never downloaded (it would stay cached)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [
        ["start", s1], ["done", s1], ["delete", s1]]
    sha = {hashlib.sha256((src / s).read_bytes()).hexdigest() for s in SHARDS}
    assert not sha & {p.name for p in (hf_home / "hub/models--org--tiny-fp8/blobs").iterdir()}
