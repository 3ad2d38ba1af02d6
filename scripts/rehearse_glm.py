"""Full-width GLM-5.3-Flash rehearsal on one GPU: a synthetic block-FP8 checkpoint with the
real dimensions, then every step of the job, each measured and projected to the whole model.

    PYTHONPATH=$HOME/sq:$PWD python3 scripts/rehearse_glm.py --steps gen,convert-ct-wo
    PYTHONPATH=$HOME/sq:$PWD python3 scripts/rehearse_glm.py --steps report
    python scripts/rehearse_glm.py --scale-down 16 --device cpu --steps all   # a local trial

On the H200 machine (16 cores, 64 GiB disk, each command under 8 minutes; a fresh machine
regenerates the source first, about a minute):

    rehearse_glm.py --steps gen,plain-io,convert-ct-mixed,convert-mo-mixed,convert-ct-wo,convert-mo-wo,report
    rehearse_glm.py --steps gen,calibrate,w4a4,check,plan,verify,report
    rehearse_glm.py --seed-from rehearse_seed --steps scales-mse,scales-mse-act,gptq,report

(``rehearse_seed``: the second command's $OUT copied into the repository, for its
calibration statistics.) No step starts after ``--stop-after-s`` (300 s) and a running one
is killed at ``--hard-limit-s`` (450 s), its partial per-layer times still recorded.

THIS IS A TRUNCATED REHEARSAL. The source holds a few decoder layers of each kind the real
``glm5_next`` layer schedule has (by default layer 0 = dense MLP + KDA, layer 3 = MoE + MLA/DSA,
layer 4 = MoE + KDA, in the order of the full model) plus the MTP layer, the embeddings, the
LM head and the vision tower, at transformers' ``Glm5NextConfig`` defaults (hidden 4096, 288
routed experts of 2048 x 4096 plus the shared expert, MLA q_lora 1536 / kv_lora 512 with NoPE
heads of 256, DSA indexer 32 x 128, KDA 64 heads of 128, mHC 4 streams). ``config.json`` says
``num_hidden_layers: 3`` (the layers written); its per-layer lists (``mlp_layer_types``,
``layer_types``, ``indexer_types``) are the picked layers' entries of the full schedule.
Names, shapes and storage (FP8 / BF16 / F32) come from ``quantize.data.fixtures.release_tensors``
(the real transformers class, on the meta device); values are random: Linear weights normal
(std ``initializer_range``, a log-normal factor per row so block scales vary) quantized to
e4m3 with 128 x 128 ``weight_scale_inv``, norms ones, the rest as transformers initialises them.
The numbers the steps compute from these weights are meaningless; the rehearsal measures time,
memory and bytes.

Steps (``--steps``, comma-separated, run in the order given; ``all`` = every step in
:data:`STEPS` order). Everything lives under ``--home`` (default ``$HOME/rehearse``); a step
whose result is already recorded there is skipped (``--redo`` runs it again), and a step whose
input is missing (source, calibration statistics, W4A4 build) first makes it, so every command
line works on a fresh machine too:

- ``gen``: write the source (``--home``/src); prints the size plan and the disk it needs first.
- ``plain-io``: a plain read of the source shards (page cache dropped first) and a write of
  the same bytes (fsync), the floor a conversion is compared with.
- ``convert-{ct,mo}-{wo,mixed}``: ``quantize nvfp4`` in compressed-tensors / modelopt with the
  weight-only / spark-mixed recipe; the build is deleted once measured.
- ``calibrate``: ``quantize calibrate --dataset random`` (``--samples`` x ``--seq-len`` tokens).
- ``w4a4``: a compressed-tensors ``--scheme w4a4 --kv-cache fp8`` build from those statistics
  (recipe spark-mixed-w4a4), kept for ``check``, ``verify`` and ``plan``.
- ``scales-mse``, ``scales-mse-act``: the block-scale search (``--scales mse`` / ``mse-act``).
- ``gptq``: ``quantize nvfp4 --method gptq`` (plus ``--gptq-args``); recorded as skipped when
  the CLI refuses it (no such method, or the llm-compressor environment is missing).
- ``report``: the markdown table of every recorded step.

Each step prints one JSON line: wall seconds, peak RSS of the CLI's process tree (``/proc``
polled every 0.5 s), peak GPU memory (``nvidia-smi`` polled every 0.5 s, minus what was in use
before the step), bytes read / written by the process tree (``/proc/<pid>/io``: storage
``read_bytes`` / ``write_bytes`` and syscall ``rchar`` / ``wchar``), the time per layer (from
the CLI's progress bar: the shard a conversion is on, the layer calibration has finished;
the source's shards never span two layers) and the projection to the full model: fixed costs
once, each layer kind's time times the number of such layers in the full schedule (45 decoder
layers: 3 dense + KDA, 31 MoE + KDA, 11 MoE + MLA/DSA; plus the MTP layer). Results go to
``--home``/results.jsonl and, when ``$OUT`` is set, to ``$OUT``/rehearse_results.jsonl,
``$OUT``/rehearse_report.md and ``$OUT``/logs/.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

STEPS = ("gen", "plain-io", "convert-ct-wo", "convert-ct-mixed", "convert-mo-wo", "convert-mo-mixed",
         "calibrate", "w4a4", "check", "verify", "plan", "scales-mse", "scales-mse-act", "gptq",
         "report")
# weight-only quantizes the KDA projections, which vLLM's glm5next cannot load (the converter
# refuses the recipe for --engine vllm), so the weight-only builds are planned for SGLang
# (compressed-tensors) and TRT-LLM (modelopt: SGLang takes only FP8 / NVFP4 quant_algo there).
CONVERTS = {"convert-ct-wo": ("compressed-tensors", "weight-only", "sglang"),
            "convert-ct-mixed": ("compressed-tensors", "spark-mixed", "vllm"),
            "convert-mo-wo": ("modelopt", "weight-only", "trtllm"),
            "convert-mo-mixed": ("modelopt", "spark-mixed", "vllm")}
DEFAULT_LAYERS = (0, 3, 4)  # dense + KDA, MoE + MLA/DSA, MoE + KDA in the full schedule
BLOCK = 128
E4M3_MAX = 448.0
GB = 1e9

# ---- the truncated config ---------------------------------------------------------------


def layer_kind(mlp: str, attn: str) -> str:
    """``dense+kda``, ``sparse+mla`` ...: a decoder layer's kind from its schedule entries."""
    return f"{mlp}+{'kda' if attn == 'linear_attention' else 'mla'}"


def full_schedule() -> dict:
    """The full model's text config (transformers ``glm5_next`` defaults, as the release's
    ``config.json``: ``quantize.data.fixtures.release_config(size="full")``)."""
    from quantize.archs import text_config
    from quantize.data.fixtures import release_config

    return text_config(release_config("glm5_next", "full"))


def full_kind_counts(text: dict) -> dict[str, int]:
    """Decoder layers of each kind in the full model, plus ``mtp`` (num_nextn_predict_layers)."""
    counts: dict[str, int] = {}
    for i in range(text["num_hidden_layers"]):
        k = layer_kind(text["mlp_layer_types"][i], text["layer_types"][i])
        counts[k] = counts.get(k, 0) + 1
    counts["mtp"] = int(text.get("num_nextn_predict_layers", 1))
    return counts


def rehearsal_config(layers: tuple[int, ...], scale_down: int = 1) -> dict:
    """``config.json`` of the truncated source: the full release config with
    ``num_hidden_layers = len(layers)`` and the per-layer lists cut to ``layers`` (indices in
    the full schedule, increasing). ``scale_down`` > 1 divides the widths (hidden,
    intermediate sizes, q_lora_rank, head counts, routed experts, vocabulary) by that factor
    for local trials; head dims (KDA 128, MLA 256, kv_lora 512, indexer 128) stay real.

    Raises:
        ValueError: a layer index outside the full schedule, or not increasing.
    """
    from transformers import AutoConfig

    from quantize.archs import portable_layer_types, text_config
    from quantize.data.fixtures import _TINY_VISION, release_config

    full = release_config("glm5_next", "full")
    ft = text_config(full)
    n = ft["num_hidden_layers"]
    if not layers or any(i < 0 or i >= n for i in layers) or list(layers) != sorted(set(layers)):
        raise ValueError(f"--layers must be increasing indices in 0..{n - 1}, got {list(layers)}")
    text = {k: v for k, v in ft.items() if k not in ("model_type",)}
    text["num_hidden_layers"] = len(layers)
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):
        text[key] = [ft[key][i] for i in layers]
    vision = None
    if scale_down > 1:
        s = scale_down
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank",
                    "vocab_size"):
            text[key] = max(ft[key] // s, 16) // 16 * 16
        for key in ("num_attention_heads", "num_key_value_heads", "linear_num_heads", "index_n_heads"):
            text[key] = max(ft[key] // s, 1)
        text["n_routed_experts"] = max(ft["n_routed_experts"] // s, ft["num_experts_per_tok"] + 1)
        text["pad_token_id"] = 0
        vision = dict(_TINY_VISION, out_hidden_size=text["hidden_size"])
    # rebuild through the config class so derived keys (qk_head_dim ...) follow the new widths
    kwargs = {"text_config": {k: v for k, v in text.items() if k not in ("qk_head_dim", "head_dim")}}
    if vision is not None:
        kwargs["vision_config"] = vision
    cfg = AutoConfig.for_model("glm5_next", **kwargs).to_dict()
    tc = text_config(cfg)
    for key, value in ft.items():  # release keys the config class drops (archs.ReleaseLayout.config_keys)
        if key not in tc:
            tc[key] = text.get(key, value)
    tc["layer_types"] = portable_layer_types(tc["layer_types"])
    cfg["architectures"] = full["architectures"]
    cfg["quantization_config"] = dict(full["quantization_config"])
    for k in ("transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    return cfg


# ---- the generator ----------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)language_model\.layers\.(\d+)\.")


def tensor_group(name: str) -> str:
    """``layer.<i>`` for a decoder (or MTP) layer's tensor, else ``other``."""
    m = _LAYER_RE.search(name)
    return f"layer.{int(m.group(1))}" if m else "other"


def _nbytes(storage: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    if storage == "fp8":
        return n + 4 * (-(-shape[0] // BLOCK)) * (-(-shape[1] // BLOCK))
    return n * (4 if storage == "F32" else 2)


def plan_shards(tensors: dict[str, tuple], shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in name order: the non-layer tensors first, then each layer;
    a shard never spans two groups (so its conversion time is one layer's) and holds at most
    ``shard_bytes`` unless one tensor alone is larger."""
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors):
        groups.setdefault(tensor_group(name), []).append(name)
    order = ["other"] + sorted((g for g in groups if g != "other"), key=lambda g: int(g.split(".")[1]))
    shards = []
    for g in order:
        cur, size = [], 0
        for name in groups.get(g, []):
            b = _nbytes(tensors[name][0], tensors[name][1])
            if cur and size + b > shard_bytes:
                shards.append(cur)
                cur, size = [], 0
            cur.append(name)
            size += b
        if cur:
            shards.append(cur)
    return shards


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] on any device -> (e4m3 [N, K], weight_scale_inv float32 [ceil(N/128),
    ceil(K/128)]) with ``scale = block amax / 448`` (the release's direction: dequantized =
    e4m3 * weight_scale_inv); same arithmetic as ``quantize.kernels.fp8.quantize_fp8_block``,
    which works on CPU only."""
    n, k = w.shape
    pn, pk = -(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK
    if (pn, pk) != (n, k):
        padded = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
        padded[:n, :k] = w
    else:
        padded = w
    amax = padded.view(pn // BLOCK, BLOCK, pk // BLOCK, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def synth_value(name: str, storage: str, shape: tuple[int, ...], std: float, device: torch.device,
                seed: int) -> dict[str, torch.Tensor]:
    """The on-disk tensor(s) of ``name`` (CPU): random, initialised as transformers' glm5_next
    ``_init_weights`` does where a value matters for a forward pass (norms 1, ``A_log`` 0,
    ``dt_bias`` inverse-softplus of U(1e-3, 1e-1), mHC base 0 / scale 1, kpool ape 0 / gate 1),
    e_score_correction_bias N(0, 0.1), everything else N(0, std) with a log-normal factor per
    row. FP8 entries give ``weight`` and ``weight_scale_inv``."""
    g = torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))
    dt = {"fp8": torch.float32, "F32": torch.float32, "BF16": torch.bfloat16}[storage]
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "index_kpool_compress_gate")) or re.search(r"hc_(attn|ffn)_scale$", name):
        v = torch.ones(shape, device=device)
    elif name.endswith((".bias", "index_kpool_compress_ape", "A_log")) and "e_score" not in leaf \
            or re.search(r"hc_(attn|ffn)_base$", name):
        v = torch.zeros(shape, device=device)
    elif leaf == "dt_bias":
        d = torch.empty(shape, device=device).uniform_(-6.907755, -2.302585, generator=g).exp()
        v = d + torch.log(-torch.expm1(-d))
    elif leaf == "e_score_correction_bias":
        v = torch.randn(shape, device=device, generator=g) * 0.1
    else:
        v = torch.randn(shape, device=device, generator=g) * std
        if v.ndim == 2:
            v *= torch.exp(0.3 * torch.randn(shape[0], 1, device=device, generator=g))
    if storage == "fp8":
        q, s = block_fp8(v)
        return {name: q.cpu(), name + "_scale_inv": s.cpu()}
    return {name: v.to(dt).cpu()}


def source_layout(layers: tuple[int, ...], scale_down: int) -> tuple[dict, dict[str, tuple]]:
    """(config, {name: (storage, shape, None)}) of the rehearsal source."""
    from quantize.data.fixtures import release_tensors

    config = rehearsal_config(layers, scale_down)
    return config, release_tensors(config, with_data=False)


def generate(folder: Path, layers: tuple[int, ...], scale_down: int, device: str,
             shard_gb: float = 5.0, seed: int = 0, log=print) -> dict:
    """Write the rehearsal source into ``folder`` (resumable: complete shards are kept).

    Returns:
        ``{"bytes": total tensor bytes, "shards": n, "groups": {group: bytes},
        "group_shards": {shard name: group}}``.
    """
    from formats.checkpoint import write_index, write_json_atomic
    from formats.shards import write_shard_atomic
    from quantize.archs import text_config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config, tensors = source_layout(layers, scale_down)
    std = float(text_config(config).get("initializer_range", 0.02))
    shards = plan_shards(tensors, int(shard_gb * GB))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    dev = torch.device(device)
    for i, (shard, members) in enumerate(zip(names, shards)):
        path = folder / shard
        if path.exists():
            continue
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        for name in members:
            storage, shape, _ = tensors[name]
            out.update(synth_value(name, storage, tuple(shape), std, dev, seed))
        t1 = time.perf_counter()
        write_shard_atomic(out, path)
        size = sum(v.numel() * v.element_size() for v in out.values())
        log(f"  {shard}: {tensor_group(members[0])}, {len(out)} tensors, {size / GB:.2f} GB "
            f"(values {t1 - t0:.1f} s, write {time.perf_counter() - t1:.1f} s)")
        del out
    for stale in folder.glob("model-*.safetensors"):
        if stale.name not in names:
            stale.unlink()
    write_index(folder, names)
    write_json_atomic(config, folder / "config.json")
    return layout_summary(tensors, shards, names)


def layout_summary(tensors: dict, shards: list[list[str]], names: list[str]) -> dict:
    groups: dict[str, int] = {}
    for n, (storage, shape, _) in tensors.items():
        g = tensor_group(n)
        groups[g] = groups.get(g, 0) + _nbytes(storage, tuple(shape))
    return {"bytes": sum(groups.values()), "shards": len(names), "groups": groups,
            "group_shards": {s: tensor_group(m[0]) for s, m in zip(names, shards)}}


def nvfp4_bytes(tensors: dict) -> int:
    """Upper estimate of a build: FP8 weights as NVFP4 (K/2 bytes + K/16 e4m3 scales per row +
    a global scale), everything else kept as it is stored."""
    total = 0
    for storage, shape, _ in tensors.values():
        if storage == "fp8":
            total += shape[0] * (shape[1] // 2 + -(-shape[1] // 16)) + 4
        else:
            total += _nbytes(storage, tuple(shape))
    return total


# ---- measurement ------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/*/stat)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return tree


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _io(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except (OSError, ValueError):
        return {}


def _gpu_used_mib() -> int | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=5, check=False)
        return int(r.stdout.split()[0]) if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class Monitor(threading.Thread):
    """Polls a process tree every ``period`` s: peak RSS (sum over the tree), last /proc io
    counters of every pid seen, peak GPU memory in use (nvidia-smi)."""

    def __init__(self, pid: int, period: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.stop = threading.Event()
        self.peak_rss = 0
        self.io: dict[int, dict[str, int]] = {}
        self.gpu_base = _gpu_used_mib()
        self.gpu_peak = self.gpu_base

    def run(self):
        while not self.stop.is_set():
            tree = _children(self.pid)
            self.peak_rss = max(self.peak_rss, sum(_rss(p) for p in tree))
            for p in tree:
                if c := _io(p):
                    self.io[p] = c
            if self.gpu_base is not None:
                used = _gpu_used_mib()
                if used is not None:
                    self.gpu_peak = max(self.gpu_peak, used)
            self.stop.wait(self.period)

    def totals(self) -> dict:
        agg = {k: sum(c.get(k, 0) for c in self.io.values()) for k in ("read_bytes", "write_bytes", "rchar", "wchar")}
        gpu = None if self.gpu_base is None else self.gpu_peak - self.gpu_base
        return {"peak_rss_gib": round(self.peak_rss / 2**30, 2),
                "peak_gpu_gib": None if gpu is None else round(gpu / 1024, 2),
                "read_gb": round(agg["read_bytes"] / GB, 2), "write_gb": round(agg["write_bytes"] / GB, 2),
                "rchar_gb": round(agg["rchar"] / GB, 2), "wchar_gb": round(agg["wchar"] / GB, 2)}


_SHARD_RE = re.compile(r"(model-\d{5}-of-\d{5}\.safetensors)\]")
_LAYER_BAR_RE = re.compile(r"calibrate:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")


def run_cli(args: list[str], log_path: Path, timeout: float) -> dict:
    """Run ``python -m quantize.cli ARGS`` measured (see :class:`Monitor`); every output line
    (split at \\r too, so progress bars count) is timestamped. Returns rc, wall, the
    measurements, ``events`` [(seconds, line)], and the output tail."""
    # every progress-bar update printed (tqdm >= 4.66 reads TQDM_* defaults): the per-layer times
    # come from those lines; no Hub lookups (kernels hub, model cards) on an offline machine
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               TQDM_MINITERS="1", TQDM_MININTERVAL="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    cmd = [sys.executable, "-m", "quantize.cli", *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    mon = Monitor(proc.pid)
    mon.start()
    events: list[tuple[float, str]] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)

    def reader():
        buf = b""
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            while chunk := proc.stdout.read1(65536):
                buf += chunk
                *lines, buf = re.split(rb"[\r\n]", buf)
                now = time.perf_counter() - t0
                # tqdm writes "\r" + status: the text after the last "\r" is already the
                # current status line (possibly cut short by the read), so it counts now
                for raw in [*lines, buf]:
                    line = raw.decode("utf-8", "replace").strip()
                    if line and (not events or events[-1][1] != line):
                        events.append((now, line))
                        log.write(f"[{now:8.2f}] {line}\n")

    rt = threading.Thread(target=reader, daemon=True)
    rt.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's session, started above
        proc.wait()
    wall = time.perf_counter() - t0
    mon.stop.set()
    mon.join()
    rt.join(timeout=10)
    tail = [line for _, line in events if "%|" not in line][-15:]
    return {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(wall, 2), **mon.totals(),
            "events": events, "tail": tail}


# ---- per-layer times and projection ------------------------------------------------------


def shard_times(events: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per source shard from the conversion bar: the converter names a shard in the
    bar's postfix when it has read and quantized it (``quantize/convert/pipeline.py``, the
    shard is then handed to the writer thread), so a shard's time runs from the previous
    shard's naming (the first one: from the bar's first line) to its own. Writing overlaps the
    next shard; the last shard's write falls into the fixed costs."""
    begin, out, prev = None, {}, None
    for t, line in events:
        if begin is None and line.startswith("convert:"):
            begin = t
        if (m := _SHARD_RE.search(line)) and m.group(1) not in out:
            start = prev if prev is not None else (begin if begin is not None else t)
            out[m.group(1)] = max(t - start, 0.0)
            prev = t
    return out


def split_warmup(per_layer: dict[str, float], nbytes: dict[str, int]) -> tuple[dict[str, float], float]:
    """Take kernel compilation out of the per-layer times: the layer on which the converter
    first meets a tensor shape compiles the quantization kernels for it (Triton / inductor),
    which the full model pays once, not per layer. A layer whose rate (bytes per second) is
    below half the median rate of all layers gets its bytes at that median rate; the excess
    is returned as warm-up (a fixed cost). Needs three layers or more."""
    layers = [g for g in per_layer if g.startswith("layer.") and per_layer[g] > 0]
    if len(layers) < 3:
        return per_layer, 0.0
    rates = sorted(nbytes[g] / per_layer[g] for g in layers)
    median = rates[len(rates) // 2]
    out, warm = dict(per_layer), 0.0
    for g in layers:
        if nbytes[g] / per_layer[g] < median / 2:
            out[g] = nbytes[g] / median
            warm += per_layer[g] - out[g]
    return out, warm


def calib_layer_times(events: list[tuple[float, str]]) -> tuple[float | None, list[float]]:
    """(seconds until the layer loop starts — capture of the embeddings included —, seconds of
    each decoder layer) from the ``calibrate`` bar."""
    seen: dict[int, float] = {}
    for t, line in events:
        if m := _LAYER_BAR_RE.search(line):
            seen.setdefault(int(m.group(1)), t)
    if 0 not in seen:
        return None, []
    n = max(seen)
    return seen[0], [seen[i + 1] - seen[i] for i in range(n) if i in seen and i + 1 in seen]


def rehearsal_kinds(config: dict) -> dict[int, str]:
    """Rehearsal layer index -> kind (``mtp`` for the layer after the decoder stack)."""
    from quantize.archs import text_config

    t = text_config(config)
    kinds = {i: layer_kind(t["mlp_layer_types"][i], t["layer_types"][i]) for i in range(t["num_hidden_layers"])}
    kinds[t["num_hidden_layers"]] = "mtp"
    return kinds


def project(per_layer: dict[str, float], kinds: dict[int, str], counts: dict[str, int],
            fixed: float) -> tuple[float | None, dict[str, float]]:
    """Full-model seconds: ``fixed`` (what does not grow with depth) + for each kind, the mean time of the rehearsal's layers
    of that kind times the full model's count. A kind the rehearsal lacks takes the mean of
    the MoE kinds (``sparse+*``); returns (None, ...) when no layer time is known."""
    by_kind: dict[str, list[float]] = {}
    for g, t in per_layer.items():
        if g.startswith("layer."):
            by_kind.setdefault(kinds[int(g.split(".")[1])], []).append(t)
    mean = {k: sum(v) / len(v) for k, v in by_kind.items()}
    if not mean:
        return None, {}
    moe = [v for k, v in mean.items() if k.startswith("sparse") or k == "mtp"] or list(mean.values())
    fallback = sum(moe) / len(moe)
    total = fixed
    for k, c in counts.items():
        total += c * mean.get(k, fallback)
    return total, {k: round(v, 2) for k, v in mean.items()}


# ---- the rehearsal ----------------------------------------------------------------------


class Rehearsal:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.home = Path(a.home).expanduser()
        self.src = self.home / "src"
        self.builds = self.home / "builds"
        self.calib = self.home / "calib"
        self.results_path = self.home / "results.jsonl"
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        self.t_start = time.perf_counter()
        self.layers = tuple(int(x) for x in a.layers.split(","))
        self.device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self._layout = None
        if a.seed_from:
            self.seed(Path(a.seed_from))

    def seed(self, folder: Path):
        """Take the results and calibration statistics a previous command left in its $OUT
        (``rehearse_results.jsonl``, ``calib/``) where this home has none: a fresh machine
        then regenerates only the source, not the statistics."""
        if not folder.is_dir():
            raise SystemExit(f"rehearse: --seed-from {folder}: no such folder")
        self.home.mkdir(parents=True, exist_ok=True)
        res = folder / "rehearse_results.jsonl"
        if res.is_file() and not self.results_path.exists():
            shutil.copyfile(res, self.results_path)
            print(f"rehearse: results of earlier steps taken from {res}", flush=True)
        if (folder / "calib").is_dir() and not self.calib.exists():
            shutil.copytree(folder / "calib", self.calib)
            print(f"rehearse: calibration statistics taken from {folder / 'calib'}", flush=True)

    # results
    def results(self) -> dict[str, dict]:
        out = {}
        if self.results_path.exists():
            for line in self.results_path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    out[r["step"]] = r
        return out

    def record(self, r: dict) -> dict:
        r = {"step": r.pop("step"), **r, "scale_down": self.a.scale_down, "device": self.device,
             "layers": list(self.layers), "truncated_rehearsal": True}
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.results_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)
        self.export()
        return r

    def export(self):
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if self.results_path.exists():
            shutil.copyfile(self.results_path, self.out / "rehearse_results.jsonl")
        (self.out / "rehearse_report.md").write_text(self.table())
        logs = self.home / "logs"
        if logs.is_dir():
            shutil.copytree(logs, self.out / "logs", dirs_exist_ok=True)
        if self.calib.is_dir() and not (self.out / "calib").exists():  # small: amax per Linear
            size = sum(f.stat().st_size for f in self.calib.rglob("*") if f.is_file())
            if size < 48 * 2**20:
                shutil.copytree(self.calib, self.out / "calib")

    # layout
    def layout(self) -> dict:
        if self._layout is None:
            cfg, tensors = source_layout(self.layers, self.a.scale_down)
            shards = plan_shards(tensors, int(self.a.shard_gb * GB))
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            self._layout = dict(layout_summary(tensors, shards, names), config=cfg,
                                build_bytes=nvfp4_bytes(tensors))
        return self._layout

    def full_bytes(self) -> tuple[int, int]:
        """(rehearsal source bytes, projected full-model source bytes)."""
        lay = self.layout()
        kinds = rehearsal_kinds(lay["config"])
        counts = full_kind_counts(full_schedule())
        per: dict[str, list[int]] = {}
        for g, b in lay["groups"].items():
            if g.startswith("layer."):
                per.setdefault(kinds[int(g.split(".")[1])], []).append(b)
        mean = {k: sum(v) / len(v) for k, v in per.items()}
        moe = [v for k, v in mean.items() if k.startswith("sparse")] or list(mean.values())
        full = lay["groups"].get("other", 0) + sum(c * mean.get(k, sum(moe) / len(moe)) for k, c in counts.items())
        return lay["bytes"], int(full)

    def remaining(self) -> float:
        return self.a.hard_limit_s - (time.perf_counter() - self.t_start)

    # steps
    def ensure_source(self):
        if not (self.src / "model.safetensors.index.json").exists() or "gen" not in self.results():
            self.step_gen()

    def step_gen(self):
        lay = self.layout()
        free = shutil.disk_usage(self.home if self.home.exists() else self.home.parent).free
        have = sum(p.stat().st_size for p in self.src.glob("*.safetensors")) if self.src.is_dir() else 0
        _, full_b = self.full_bytes()
        need = lay["bytes"] + lay["build_bytes"] + int(self.a.work_gb * GB)
        kinds = rehearsal_kinds(lay["config"])
        print("TRUNCATED REHEARSAL of GLM-5.3-Flash (glm5_next): decoder layers "
              f"{list(self.layers)} of the full 45 ({', '.join(kinds[i] for i in range(len(self.layers)))}) "
              f"+ MTP, scale-down {self.a.scale_down}", flush=True)
        print(f"size plan: source {lay['bytes'] / GB:.2f} GB in {lay['shards']} shards "
              f"({', '.join(f'{g} {b / GB:.2f}' for g, b in lay['groups'].items())} GB); largest build "
              f"<= {lay['build_bytes'] / GB:.2f} GB; work space {self.a.work_gb:.0f} GB; needs "
              f"{need / GB:.2f} GB, free {(free + have) / GB:.2f} GB (full model source "
              f"{full_b / GB:.1f} GB)", flush=True)
        if need > free + have and not self.a.force:
            raise SystemExit(f"rehearse: not enough disk under {self.home}: {need / GB:.1f} GB needed "
                             f"(source + largest build + work space), {(free + have) / GB:.1f} GB free; "
                             "pass fewer --layers or --force")
        t0 = time.perf_counter()
        info = generate(self.src, self.layers, self.a.scale_down, self.device, self.a.shard_gb,
                        log=lambda s: print(s, flush=True))
        wall = time.perf_counter() - t0
        self.record({"step": "gen", "rc": 0, "wall_s": round(wall, 2), "source_gb": round(info["bytes"] / GB, 2),
                     "shards": info["shards"], "gb_per_s": round(info["bytes"] / GB / wall, 3),
                     "full_source_gb": round(full_b / GB, 1)})

    def step_plain_io(self):
        """Read every source shard (64 MiB reads, its pages dropped from the page cache first)
        and write the same bytes to one file (fsync at the end); GB/s of source bytes."""
        self.ensure_source()
        self._make_room(None, self.layout()["bytes"] + int(self.a.work_gb * GB))
        tmp = self.home / "plain-io.tmp"
        shards = sorted(self.src.glob("model-*.safetensors"))
        total, t0 = 0, time.perf_counter()
        with open(tmp, "wb") as w:
            for shard in shards:
                with open(shard, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    while chunk := f.read(64 << 20):
                        w.write(chunk)
                        total += len(chunk)
            w.flush()
            os.fsync(w.fileno())
        wall = time.perf_counter() - t0
        tmp.unlink()
        _, full_b = self.full_bytes()
        self.record({"step": "plain-io", "rc": 0, "wall_s": round(wall, 2), "read_gb": round(total / GB, 2),
                     "write_gb": round(total / GB, 2), "gb_per_s": round(total / GB / wall, 3),
                     "projected_full_s": round(full_b / (total / wall), 1), "projection": "bytes"})

    def _measure(self, step: str, args: list[str], per_layer_from: str | None, scale_rule: str,
                 extra: dict | None = None, record: bool = True) -> dict:
        """Run the CLI, derive per-layer times and the full-model projection, record (unless
        ``record`` is False); returns the result ({} when too little time is left)."""
        budget = min(self.remaining(), self.a.step_timeout_s)
        if budget < 30:
            print(f"rehearse: {step} not started: {budget:.0f} s left under --hard-limit-s", flush=True)
            return {}
        r = run_cli(args, self.home / "logs" / f"{step}.log", budget)
        events = r.pop("events")
        lay = self.layout()
        kinds = rehearsal_kinds(lay["config"])
        counts = full_kind_counts(full_schedule())
        src_b, full_b = self.full_bytes()
        per_layer: dict[str, float] = {}
        fixed, warmup, raw = r["wall_s"], 0.0, {}
        if per_layer_from == "shards":
            for shard, secs in shard_times(events).items():
                g = lay["group_shards"].get(shard, "other")
                per_layer[g] = per_layer.get(g, 0.0) + secs
            raw = dict(per_layer)
            per_layer, warmup = split_warmup(per_layer, lay["groups"])
            # start-up, the non-layer shards (embeddings, head, vision) and the final checks
            fixed = r["wall_s"] - sum(t for g, t in per_layer.items() if g.startswith("layer."))
        elif per_layer_from == "calib":
            start, layer_s = calib_layer_times(events)
            if start is not None:
                per_layer = {f"layer.{i}": t for i, t in enumerate(layer_s)}
                fixed = r["wall_s"] - sum(layer_s)
        proj, kind_s = (None, {})
        if per_layer:
            proj, kind_s = project(per_layer, kinds, counts, fixed)
            if per_layer_from == "calib" and "mtp" not in kind_s:
                kind_s["mtp"] = None  # the decoder stack only; MTP is projected as a MoE layer
        if proj is None:
            proj = r["wall_s"] * (full_b / src_b if scale_rule == "bytes" else 1.0)
        res = {"step": step, "rc": r["rc"], "timed_out": r["timed_out"], "wall_s": r["wall_s"],
               "peak_rss_gib": r["peak_rss_gib"], "peak_gpu_gib": r["peak_gpu_gib"],
               "read_gb": r["read_gb"], "write_gb": r["write_gb"], "rchar_gb": r["rchar_gb"],
               "wchar_gb": r["wchar_gb"], "fixed_s": round(fixed, 2), "warmup_s": round(warmup, 2),
               "layer_s": {g: round(t, 2) for g, t in per_layer.items()}, "kind_s": kind_s,
               **({"layer_s_raw": {g: round(t, 2) for g, t in raw.items()}} if warmup else {}),
               "projected_full_s": round(proj, 1), "projection": per_layer_from or scale_rule,
               "cmd": "quantize " + " ".join(args), **(extra or {})}
        if r["rc"] != 0:
            res["tail"] = r["tail"]
        return self.record(res) if record else res

    def _nvfp4(self, step: str, out: Path, extra_args: list[str], keep: bool) -> dict:
        self.ensure_source()
        self._make_room(out)
        args = ["nvfp4", "--src", str(self.src), "--out", str(out), "--device", self.device, *extra_args]
        res = self._measure(step, args, "shards", "bytes")
        if res and out.is_dir():
            res_size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            print(f"  {step}: build {res_size / GB:.2f} GB", flush=True)
            if not keep or res.get("rc") != 0:
                shutil.rmtree(out)
        return res

    def _make_room(self, out: Path | None, need: int | None = None):
        """Delete other builds when the next one would not fit (free < ``need``, default the
        largest build + work space)."""
        if need is None:
            need = self.layout()["build_bytes"] + int(self.a.work_gb * GB)
        if out is not None and out.exists():
            shutil.rmtree(out)
        if self.builds.is_dir():
            for b in sorted(self.builds.iterdir()):
                if shutil.disk_usage(self.home).free >= need:
                    break
                print(f"  removing {b} to make room", flush=True)
                shutil.rmtree(b)
        self.builds.mkdir(parents=True, exist_ok=True)

    def step_convert(self, step: str):
        fmt, recipe, engine = CONVERTS[step]
        self._nvfp4(step, self.builds / step, ["--format", fmt, "--recipe", recipe, "--engine", engine],
                    keep=False)

    def ensure_calib(self):
        if not (self.calib.is_dir() and any(self.calib.iterdir())) or "calibrate" not in self.results():
            self.step_calibrate()

    def step_calibrate(self):
        self.ensure_source()
        if self.calib.exists():
            shutil.rmtree(self.calib)
        args = ["calibrate", "--src", str(self.src), "--dataset", "random", "--samples", str(self.a.samples),
                "--seq-len", str(self.a.seq_len), "--out", str(self.calib), "--device", self.device,
                "--dtype", self.a.calib_dtype]
        self._measure("calibrate", args, "calib", "bytes",
                      {"tokens": self.a.samples * self.a.seq_len})

    def w4a4_args(self) -> list[str]:
        return ["--format", "compressed-tensors", "--recipe", "spark-mixed-w4a4", "--scheme", "w4a4",
                "--calibration", str(self.calib), "--kv-cache", "fp8"]

    def ensure_w4a4(self):
        if not (self.builds / "w4a4" / "spark_quant_manifest.json").exists():
            self.step_w4a4()

    def step_w4a4(self):
        self.ensure_calib()
        self._nvfp4("w4a4", self.builds / "w4a4", self.w4a4_args(), keep=True)

    def step_check(self):
        self.ensure_w4a4()
        self._measure("check", ["check", str(self.builds / "w4a4")], None, "bytes")

    def step_verify(self):
        self.ensure_w4a4()
        self._measure("verify", ["verify", str(self.builds / "w4a4"), "--src", str(self.src)], None, "bytes")

    def step_plan(self):
        self.ensure_w4a4()
        self._measure("plan", ["plan", "--src", str(self.builds / "w4a4")], None, "none")

    def step_scales(self, step: str):
        method = "mse" if step == "scales-mse" else "mse-act"
        extra = ["--format", "compressed-tensors", "--recipe", "spark-mixed", "--scales", method]
        if method == "mse-act":
            self.ensure_calib()
            extra += ["--calibration", str(self.calib)]
        self._nvfp4(step, self.builds / step, extra, keep=False)

    def step_gptq(self):
        self.ensure_source()
        help_r = subprocess.run([sys.executable, "-m", "quantize.cli", "nvfp4", "--help"], cwd=REPO,
                                capture_output=True, text=True, check=False,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                    p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p)))
        if not re.search(r"--method \{[^}]*gptq", help_r.stdout):
            self.record({"step": "gptq", "rc": None, "skipped": "quantize nvfp4 has no --method gptq"})
            return
        out = self.builds / "gptq"
        self._make_room(out)
        args = ["nvfp4", "--src", str(self.src), "--out", str(out), "--device", self.device,
                "--method", "gptq", "--dataset", "random", "--samples", str(self.a.samples),
                "--seq-len", str(self.a.seq_len), *self.a.gptq_args.split()]
        res = self._measure("gptq", args, "shards", "bytes", record=False)
        if res and res.get("rc") != 0:
            tail = "\n".join(res.get("tail", []))
            if "needs an environment with llm-compressor" in tail or "Dense (no routed experts)" in tail:
                res["skipped"] = "refused by quantize nvfp4 --method gptq: " + res["tail"][-1][:300]
        if res:
            self.record(res)
        if out.exists():
            shutil.rmtree(out)

    def table(self) -> str:
        res = self.results()
        if not res:
            return "no steps recorded\n"
        src_b, full_b = self.full_bytes() if res else (0, 0)
        lines = [("TRUNCATED REHEARSAL of GLM-5.3-Flash: decoder layers "
                  f"{list(self.layers)} of 45 + MTP (scale-down {self.a.scale_down}); source "
                  f"{src_b / GB:.1f} GB, full model {full_b / GB:.1f} GB. Projection: fixed costs once + "
                  "per-layer time of each kind x its count in the full schedule "
                  f"{full_kind_counts(full_schedule())}; steps without layer times scale by bytes, start-up "
                  "included (an upper bound, marked <=)."), "",
                 ("| step | rc | wall s | peak RSS GiB | peak GPU GiB | read GB | written GB | s per layer kind | "
                  "projected full model |"), "|---|---|---|---|---|---|---|---|---|"]
        for step in STEPS:
            r = res.get(step)
            if r is None or step == "report":
                continue
            if r.get("skipped"):
                lines.append(f"| {step} | skipped | | | | | | {r['skipped']} | |")
                continue
            proj = r.get("projected_full_s")
            kinds = ", ".join(f"{k} {v}" for k, v in (r.get("kind_s") or {}).items() if v is not None)
            if step in ("gen", "plain-io"):
                kinds = f"{r.get('gb_per_s')} GB/s"
            if r.get("warmup_s"):
                kinds += f" (warm-up {r['warmup_s']} s once)"
            io = res.get("plain-io", {}).get("projected_full_s")
            vs_io = f" ({proj / io:.2f}x plain I/O)" if step.startswith("convert") and proj and io else ""
            cells = [step, r.get("rc"), r.get("wall_s"), r.get("peak_rss_gib"), r.get("peak_gpu_gib"),
                     r.get("read_gb"), r.get("write_gb", r.get("source_gb")), kinds,
                     None if proj is None else
                     f"{'<= ' if r.get('projection') == 'bytes' and step != 'plain-io' else ''}"
                     f"{proj / 60:.1f} min{vs_io}"]
            lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
        return "\n".join(lines) + "\n"

    def run(self, steps: list[str]):
        dispatch = {"gen": self.step_gen, "plain-io": self.step_plain_io, "calibrate": self.step_calibrate, "w4a4": self.step_w4a4,
                    "check": self.step_check, "verify": self.step_verify, "plan": self.step_plan,
                    "gptq": self.step_gptq}
        for step in steps:
            done = self.results()
            if step == "report":
                print(self.table(), flush=True)
                self.export()
                continue
            if step in done and not self.a.redo and not (step == "gen" and not self.src.is_dir()):
                print(f"rehearse: {step} already recorded (--redo to run again)", flush=True)
                continue
            if time.perf_counter() - self.t_start > self.a.stop_after_s:
                print(f"rehearse: stopping before {step}: past --stop-after-s {self.a.stop_after_s:.0f}", flush=True)
                break
            if step in CONVERTS:
                self.step_convert(step)
            elif step.startswith("scales-"):
                self.step_scales(step)
            else:
                dispatch[step]()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="all", help=f"comma-separated, from: {', '.join(STEPS)}; or all")
    p.add_argument("--home", default=os.path.join(os.path.expanduser("~"), "rehearse"),
                   help="state folder (source, builds, statistics, results); default $HOME/rehearse")
    p.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                   help="decoder layers of the full schedule to write (default 0,3,4)")
    p.add_argument("--scale-down", type=int, default=1,
                   help="divide widths, head counts, experts and vocabulary by this (local trials)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (generation and every step)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="largest source shard, GB")
    p.add_argument("--work-gb", type=float, default=6.0, help="disk kept free beside source and build")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--calib-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gptq-args", default="", help="extra arguments for the gptq step")
    p.add_argument("--stop-after-s", type=float, default=300.0,
                   help="start no further step after this many seconds (default 300)")
    p.add_argument("--hard-limit-s", type=float, default=450.0,
                   help="kill a running step so the whole command ends by then (default 450)")
    p.add_argument("--step-timeout-s", type=float, default=450.0)
    p.add_argument("--redo", action="store_true", help="run recorded steps again")
    p.add_argument("--seed-from", help="a previous command's $OUT (results, calib/) to start from")
    p.add_argument("--force", action="store_true", help="write the source even if the disk plan fails")
    a = p.parse_args(argv)
    steps = list(STEPS) if a.steps == "all" else [s.strip() for s in a.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        p.error(f"unknown step(s) {bad}; valid: {', '.join(STEPS)}")
    Rehearsal(a).run(steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
