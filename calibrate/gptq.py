"""GPTQ for NVFP4, our own, layer-streamed: runs on a model larger than RAM on one GPU or CPU.

``run_gptq(src, calib, work)`` goes through the source one decoder layer at a time with
:class:`calibrate.layerwise.StreamedModel` (the meta-device model, each layer filled from the
source, routed experts as per-expert ``nn.Linear`` through ``ExpertList``). Per layer:

1. forward hooks on every Linear the plan (``quantize.plan.tensors`` over the recipe) makes
   NVFP4 accumulate ``H = 2/n X^T X`` from the calibration activations entering it; a routed
   expert's from the tokens routed to it. Linears fed the very same input tensor (q/k/v,
   gate/up, MLA q_a / kv_a) share one Hessian, and their rows are solved together;
2. each such Linear is quantized by :func:`quantize.kernels.gptq.gptq_nvfp4` (damping,
   optional activation order, blocked lazy updates; the NVFP4 scalar fixed first from the
   amax of the original weight of the tensor or of its whole fused group, the e4m3 block
   scale chosen when GPTQ reaches each 16-column group, in the output format's arithmetic
   order), experts of one shape batched together;
3. the results (packed e2m1, block scales, scalar) are written to the work folder
   (``formats.gptq_results``), the layer's weights are replaced by their dequantized NVFP4
   values, and the calibration set is run through it again: the next layer sees the
   quantized layer's outputs, as in GPTQ's sequential scheme. The Hessians of one layer are
   all taken from the unquantized layer (attention and MLP together, not "true sequential").

Expert fallback: a routed expert's Linear that received fewer than ``min_tokens`` routed
tokens (default: K / 8, an eighth of its input width, at least 16) is not GPTQ'd: with so
few tokens ``X^T X`` has rank far below K and GPTQ would push the rounding error into the
input directions no calibration token spans. It is quantized with the block-scale method
alone, no Hessian (``quantize_nvfp4_rows``: ``rtn`` gives exactly the bytes the normal
conversion writes; ``mse`` / ``mse-act`` the unweighted least-error search), and listed in
``fallback`` of the work folder and in the build's manifest options. Never the pooled
Hessian of its siblings: a down_proj's input space is its own expert's intermediate
activations, unrelated between experts.

Layers that are not in ``layers`` (default all), lm_head, routers, MTP layers and every
tensor the recipe keeps or makes FP8 / MXFP8 are not GPTQ'd: the conversion treats them as
always. Peak memory: one layer (compute dtype), the hidden states of the calibration set,
the Hessians of one layer's NVFP4 Linears (float32, on the device) and one batch of weights
being solved.

``convert_gptq(src, out, ...)`` is ``quantize nvfp4 --method gptq``: the calibration set from
``--dataset`` (or rebuilt from a ``--calibration`` stats folder's record, token sha256
checked), ``run_gptq`` into ``<out>.gptq``, then ``quantize.convert.pipeline.convert`` with
``gptq=`` that folder, which is removed once the build has its manifest.
"""

import gc
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from calibrate.data import CalibSet, build_calib_set, check_dataset
from quantize.base.errors import CalibrationError
from quantize.kernels import resolve_scales

__all__ = [
    "DEFAULT_DAMP",
    "GPTQRun",
    "convert_gptq",
    "expert_min_tokens",
    "gptq_calib_set",
    "gptq_layer",
    "run_gptq",
    "work_folder",
]

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128
_BATCH_BYTES = {"cpu": 1 << 30, "cuda": 8 << 30}  # weights + Hessians + factors of one solve batch


def expert_min_tokens(k: int) -> int:
    """Routed tokens a routed expert's Linear of input width ``k`` needs to be GPTQ'd:
    ``max(16, k // 8)`` (see the module docstring)."""
    return max(16, k // 8)


def work_folder(out: str | Path) -> Path:
    """The GPTQ work folder of a build ``out``: ``<out>.gptq`` beside it."""
    out = Path(out)
    return out.parent / f"{out.name}.gptq"


@dataclass
class GPTQRun:
    """What :func:`run_gptq` did: the work folder, modules GPTQ'd / on the fallback (with
    their routed tokens), Linears that shared another's Hessian (same input tensor), and wall
    seconds per stage (capture, load, hessians, solve, propagate, write)."""

    work: Path
    gptq: list[str] = field(default_factory=list)
    fallback: dict[str, int] = field(default_factory=dict)
    shared: dict[str, str] = field(default_factory=dict)  # Linear -> the one whose Hessian it uses
    seconds: dict[str, float] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)

    def add(self, stage: str, t0: float) -> float:
        t = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + t - t0
        return t


class _HessianHooks:
    """Forward pre-hooks accumulating ``sum x^T x`` (float32) and token counts per target
    Linear of one loaded layer; an input that is the same tensor object as one of the last
    few seen in this sample is attributed to the Linear that saw it first (shared Hessian)."""

    def __init__(self, layer, targets: dict[str, str], device: torch.device):
        self.layer, self.targets, self.device = layer, targets, device
        self.h: dict[str, torch.Tensor] = {}
        self.n: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.alias: dict[str, dict[str, int]] = {}
        self._recent: list[tuple[torch.Tensor, str]] = []
        self._handles = []

    def _hook(self, disk: str):
        def record(_mod, args):
            x = args[0]
            self.calls[disk] = self.calls.get(disk, 0) + 1
            for t, owner in self._recent:
                if t is x:
                    a = self.alias.setdefault(disk, {})
                    a[owner] = a.get(owner, 0) + 1
                    return
            x2 = x.detach().reshape(-1, x.shape[-1]).to(self.device, torch.float32)
            if disk not in self.h:
                self.h[disk] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32, device=self.device)
                self.n[disk] = 0
            self.h[disk].addmm_(x2.T, x2)
            self.n[disk] += x2.shape[0]
            self._recent = [*self._recent[-3:], (x, disk)]
        return record

    def next_sample(self) -> None:
        self._recent = []

    def __enter__(self):
        for rel, disk in self.targets.items():
            mod = self.layer.module.get_submodule(rel)
            self._handles.append(mod.register_forward_pre_hook(self._hook(disk)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._recent = []

    def owners(self) -> dict[str, str]:
        """``{linear: the Linear whose Hessian it uses}`` (itself when it owns one) for every
        target that saw tokens.

        Raises:
            RuntimeError: a Linear shared another's input in some calls only.
        """
        out = {d: d for d in self.h}
        for d, seen in self.alias.items():
            if d in self.h or len(seen) != 1 or next(iter(seen.values())) != self.calls[d]:
                raise RuntimeError(f"{d}: its input is another Linear's in some calibration calls only "
                                   f"({seen}); cannot share or own a Hessian")
            out[d] = next(iter(seen))
        return out


def gptq_calib_set(src: str | Path, *, dataset: str | None = None, calibration: str | Path | None = None,
                   samples: int = 128, seq_len: int = 512, seed: int = 0, chat_template: bool = True,
                   tokenizer=None) -> CalibSet:
    """The token sequences GPTQ runs on: from ``dataset`` (``calibrate.data``), or rebuilt from
    the record of a ``quantize calibrate`` stats folder (its dataset, samples, seq_len, seed,
    chat template) when only ``calibration`` is given.

    A stats folder holds input amax and per-channel mean x^2, not the ``X^T X`` GPTQ needs
    (K^2 floats per Linear, per expert: far too large to store), so the tokens are rebuilt and
    run again; the rebuilt tokens must have the recorded sha256.

    Raises:
        CalibrationError: neither given; the stats record cannot be rebuilt (no dataset in
            it, or other tokens: a moved local file, another tokenizer), asking for --dataset.
    """
    from calibrate import _tokenizer
    from quantize import archs

    if dataset is not None:
        check_dataset(dataset)  # a missing local file is named before the tokenizer loads
    src = Path(src)
    vocab = archs.text_config(json.loads((src / "config.json").read_text())).get("vocab_size")
    tok = tokenizer if tokenizer is not None else _tokenizer(src)
    if dataset is not None:
        return build_calib_set(dataset, tok, samples=samples, seq_len=seq_len, seed=seed,
                               chat_template=chat_template, vocab_size=vocab)
    if calibration is None:
        raise CalibrationError("--method gptq needs calibration tokens: --dataset D, or --calibration "
                               "STATS of `quantize calibrate` to rebuild its set (GPTQ runs the samples "
                               "through the model to build each Linear's Hessian X^T X)")
    from formats.calib_stats import CalibStats

    meta = CalibStats.load(calibration).meta
    need = ("dataset", "samples", "seq_len", "seed", "tokens_sha256")
    if any(k not in meta for k in need):
        raise CalibrationError(
            f"--method gptq: {calibration} records no rebuildable calibration set (needs "
            f"{', '.join(need)} in its meta); a stats folder holds input amax and mean x^2 per "
            "channel, not the X^T X Hessians GPTQ needs: pass --dataset D")
    calib = build_calib_set(meta["dataset"], tok, samples=int(meta["samples"]), seq_len=int(meta["seq_len"]),
                            seed=int(meta["seed"]), chat_template=bool(meta.get("chat_template", True)),
                            vocab_size=vocab)
    if calib.meta["tokens_sha256"] != meta["tokens_sha256"]:
        raise CalibrationError(
            f"--method gptq: the calibration set recorded in {calibration} ({meta['dataset']!r}, "
            f"{meta['samples']} samples) rebuilds to other tokens (sha256 {calib.meta['tokens_sha256'][:12]} "
            f"vs recorded {meta['tokens_sha256'][:12]}); a stats folder does not hold the X^T X "
            "Hessians GPTQ needs, so pass --dataset D")
    return calib


def _solve(jobs: list[dict], read, order: str, damp: float, act_order: bool, block: int, scales: str,
           device: torch.device) -> dict[str, tuple]:
    """Run the GPTQ / fallback jobs of one layer, batched by shape (weights read by
    ``read(module)`` batch by batch); returns ``{module: (packed, block_scale,
    dequantized)}`` (rows of each module)."""
    from quantize.kernels.gptq import gptq_nvfp4, quantize_nvfp4_rows

    out: dict[str, tuple] = {}
    by_shape: dict[tuple, list[dict]] = {}
    for j in jobs:
        by_shape.setdefault((j["rows"], j["k"], j["h"] is None), []).append(j)
    budget = _BATCH_BYTES["cuda" if device.type == "cuda" else "cpu"]
    for (r, k, fallback), group in by_shape.items():
        per = 4 * (r * k + (0 if fallback else 2 * k * k))
        step = max(1, budget // max(per, 1))
        for i in range(0, len(group), step):
            part = group[i:i + step]
            w = torch.stack([torch.cat([read(m) for m, _ in j["members"]]) for j in part])
            scalar = torch.stack([j["scalar"] for j in part])
            if fallback:
                packed, bs, deq = quantize_nvfp4_rows(w, scalar, order=order, scales="rtn" if scales == "rtn" else "mse")
            else:
                h = torch.stack([j["h"] for j in part])
                packed, bs, deq, _ = gptq_nvfp4(w, h, scalar, order=order, damp=damp, act_order=act_order,
                                                block=block, scales=scales)
                del h
            for b, j in enumerate(part):
                row = 0
                for m, n in j["members"]:
                    out[m] = (packed[b, row:row + n], bs[b, row:row + n], deq[b, row:row + n])
                    row += n
            del w, packed, bs, deq
    return out


def run_gptq(src: str | Path, calib: CalibSet, work: str | Path, *, fmt: str = "compressed-tensors",
             recipe: str = "weight-only", tp: int = 1, engine: str = "vllm", damp: float = DEFAULT_DAMP,
             act_order: bool = False, block: int = DEFAULT_BLOCK, scales: str = "rtn",
             min_tokens: int | None = None, layers=None, dtype: torch.dtype = torch.float32,
             device: str = "cpu", progress: bool = True) -> GPTQRun:
    """GPTQ every NVFP4 Linear of the decoder layers of ``src`` into the work folder ``work``
    (see the module docstring; ``formats.gptq_results`` for its layout).

    Args:
        calib: token sequences (:func:`gptq_calib_set`).
        fmt: output format whose arithmetic order and scalar the results are made in.
        recipe, tp, engine: the plan (``quantize.plan.tensors``) that says which tensors are
            NVFP4 and their fused groups; must be the conversion's.
        damp: damping fraction of the mean Hessian diagonal. act_order: group-wise activation
            order. block: lazy-update block (multiple of 16). scales: ``rtn``, ``mse`` or
            ``mse-act`` (search weighted by the Hessian diagonal).
        min_tokens: routed tokens below which a routed expert's Linear takes the fallback;
            None: :func:`expert_min_tokens` of its input width.
        layers: decoder layer indices to GPTQ (default all); the layers before the last of
            them are run unquantized to reach it, the ones after are not run.
        dtype, device: compute dtype and device of the streamed layers (the Hessians and the
            solve are float32 on ``device``).

    Returns:
        :class:`GPTQRun`.

    Raises:
        SourceError, RecipeError: from the source and the plan. ValueError: an unknown
        ``fmt`` / ``scales``, a layer index out of range, a Hessian not positive definite.
    """
    from calibrate.layerwise import StreamedModel
    from formats import get_writer
    from formats.gptq_results import write_layer, write_results
    from formats.sources import open_source
    from quantize import archs
    from quantize.base.memory import bound_allocator, release_freed_memory
    from quantize.kernels.gptq import GPTQ_SCALES
    from quantize.plan.recipe import Target, load_recipe
    from quantize.plan.tensors import plan_tensors

    if scales not in GPTQ_SCALES:
        raise ValueError(f"unknown block-scale method {scales!r} for GPTQ (valid: {', '.join(GPTQ_SCALES)})")
    writer = get_writer(fmt)
    order = writer.NVFP4_ORDER
    work = Path(work)
    run = GPTQRun(work)
    t = time.perf_counter()
    bound_allocator()
    source = open_source(src)
    dev = torch.device(device)
    try:
        decisions = plan_tensors(source, load_recipe(recipe), tp=tp, engine=engine)
        model = StreamedModel(source, dtype=dtype, device=device)
        wanted = sorted(set(range(model.n_layers)) if layers is None else {int(i) for i in layers})
        bad = [i for i in wanted if not 0 <= i < model.n_layers]
        if bad:
            raise ValueError(f"GPTQ layer {bad[0]} does not exist (the source has decoder layers "
                             f"0..{model.n_layers - 1})")
        run.layers = wanted
        hidden, kwargs = model.capture(calib.sequences)
        carried: list[dict] = [{} for _ in hidden]
        t = run.add("capture", t)
        modules: dict[str, str] = {}
        amax_cache: dict[str, torch.Tensor] = {}

        def group_amax(disk: str) -> torch.Tensor:
            d = decisions[disk + ".weight"]
            amax = []
            for m in d.members or (disk,):
                if m not in amax_cache:
                    amax_cache[m] = source.read(m + ".weight").to(torch.float32).abs().amax()
                amax.append(amax_cache[m])
            return torch.stack(amax).amax()

        bar = tqdm(total=wanted[-1] + 1 if wanted else 0, desc="gptq", unit="layer", disable=not progress)
        for i in range(wanted[-1] + 1 if wanted else 0):
            layer = model.load_layer(i)
            t = run.add("load", t)
            if i in wanted:
                targets = {rel: disk for rel, disk in layer.disk_module.items()
                           if (d := decisions.get(disk + ".weight")) is not None and d.target is Target.NVFP4}
                hooks = _HessianHooks(layer, targets, dev)
                with hooks:
                    for s in range(len(hidden)):
                        hooks.next_sample()
                        model.run_layer(layer, [hidden[s]], [kwargs[s]], [dict(carried[s])])
                owners = hooks.owners()
                run.shared.update({d: o for d, o in owners.items() if d != o})
                t = run.add("hessians", t)
                jobs = []
                by_owner: dict[str, list[str]] = {}
                for disk in targets.values():
                    by_owner.setdefault(owners.get(disk, disk), []).append(disk)
                for owner, members in sorted(by_owner.items()):
                    shapes = [tuple(source.tensors[m + ".weight"].shape) for m in members]
                    k = shapes[0][1]
                    n_tok = hooks.n.get(owner, 0)
                    expert = archs.expert_of(owner) is not None
                    floor = expert_min_tokens(k) if min_tokens is None else min_tokens
                    h = None
                    if not (expert and n_tok < floor) and n_tok > 0:
                        h = hooks.h.pop(owner).mul_(2.0 / n_tok)
                    else:
                        hooks.h.pop(owner, None)
                        for m in members:
                            run.fallback[m] = n_tok
                    scalar = torch.cat([writer.nvfp4_weight_scalar(group_amax(m)).reshape(1).expand(n)
                                        for m, (n, _) in zip(members, shapes)]).to(dev)
                    jobs.append({"rows": sum(n for n, _ in shapes), "k": k, "h": h, "scalar": scalar,
                                 "members": [(m, n) for m, (n, _) in zip(members, shapes)]})
                del hooks
                results = _solve(jobs, lambda m: source.read(m + ".weight").to(dev, torch.float32),
                                 order, damp, act_order, block, scales, dev)
                del jobs
                t = run.add("solve", t)
                rel_of = {disk: rel for rel, disk in targets.items()}
                stored = {}
                for m, (packed, bs, deq) in results.items():
                    scalar = writer.nvfp4_weight_scalar(group_amax(m))
                    stored[m] = (packed, bs, scalar)
                    mod = layer.module.get_submodule(rel_of[m])
                    with torch.no_grad():
                        mod.weight.copy_(deq.to(mod.weight.device, mod.weight.dtype))
                    run.gptq += [] if m in run.fallback else [m]
                name = write_layer(work, i, stored)
                modules.update({m: name for m in stored})
                del results, stored
                t = run.add("write", t)
            if i < wanted[-1]:
                model.run_layer(layer, hidden, kwargs, carried)
                t = run.add("propagate", t)
            del layer
            gc.collect()
            release_freed_memory()
            bar.update(1)
        bar.close()
    finally:
        source.close()
    meta = {"source": str(Path(src).resolve()), "format": fmt, "recipe": recipe, "tp": tp, "engine": engine,
            "damp": damp, "act_order": act_order, "block": block, "scales": scales,
            "min_tokens": min_tokens if min_tokens is not None else "max(16, K/8)",
            "layers": wanted, "dtype": str(dtype).replace("torch.", ""), "device": device,
            "calibration": {k: v for k, v in calib.meta.items() if k != "row_ids"},
            "seconds": {k: round(v, 3) for k, v in run.seconds.items()}}
    write_results(work, order, modules, run.fallback, meta)
    return run


def gptq_layer(src: str | Path, layer_index: int, *, dataset: str = "random", samples: int = 128,
               seq_len: int = 512, work: str | Path | None = None, **kwargs) -> dict:
    """GPTQ one decoder layer of ``src`` (the layers before it run unquantized) and return
    its timing: ``{"layer", "modules", "fallback", "seconds": {stage: s}, "work"}``. For
    measuring a full-width layer; ``kwargs`` go to :func:`run_gptq` (device, dtype, recipe,
    act_order...). The work folder is a temporary one unless ``work`` is given."""
    import tempfile

    calib = gptq_calib_set(src, dataset=dataset, samples=samples, seq_len=seq_len)
    tmp = None if work is not None else tempfile.mkdtemp(prefix="spark-quant-gptq-")
    try:
        run = run_gptq(src, calib, work or tmp, layers=[layer_index], **kwargs)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"layer": layer_index, "modules": len(run.gptq), "fallback": len(run.fallback),
            "tokens": calib.tokens, "seconds": {k: round(v, 2) for k, v in run.seconds.items()},
            "work": str(work) if work is not None else None}


def convert_gptq(src: str | Path, out: str | Path, *, dataset: str | None = None,
                 calibration: str | Path | None = None, samples: int = 128, seq_len: int = 512,
                 seed: int = 0, damp: float = DEFAULT_DAMP, act_order: bool = False,
                 block: int = DEFAULT_BLOCK, gptq_dtype: torch.dtype = torch.float32,
                 keep_work: bool = False, progress: bool = True, **convert_options):
    """``quantize nvfp4 --method gptq``: GPTQ pass into ``work_folder(out)``, then the
    streaming conversion taking its results (module docstring).

    Args:
        dataset / calibration: the calibration tokens (:func:`gptq_calib_set`); a given
            ``calibration`` is also passed to the conversion (W4A4 input scales, KV scales).
        damp, act_order, block: GPTQ settings (:func:`run_gptq`); the block-scale method is
            ``convert_options["scales"]`` (default ``auto``: ``mse`` on CUDA, ``rtn`` on CPU,
            :func:`quantize.kernels.resolve_scales`).
        gptq_dtype: compute dtype of the streamed layers.
        keep_work: keep the work folder after the build (default: removed once the build
            has its manifest).
        convert_options: :class:`quantize.convert.pipeline.ConvertOptions` fields (fmt,
            recipe, tp, engine, device, scheme, kv_cache, ...).

    Returns:
        the conversion's ``Summary``.
    """
    from quantize.convert.pipeline import convert

    opts = dict(convert_options)
    fmt = opts.get("fmt", "compressed-tensors")
    device = opts.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    scales = resolve_scales(opts.pop("scales", "auto"), torch.device(device).type)
    work = work_folder(out)
    calib = gptq_calib_set(src, dataset=dataset, calibration=calibration, samples=samples,
                           seq_len=seq_len, seed=seed)
    from formats.gptq_results import GPTQ_FILE, GPTQResults
    from quantize.inspect.preflight import preflight
    from quantize.plan.recipe import load_recipe

    # the build's own pre-flight first: a bad --out or source fails before the GPTQ pass
    pre = preflight(src, out, recipe=load_recipe(opts.get("recipe", "weight-only")), resume=bool(opts.get("resume")),
                    fmt=fmt, tp=opts.get("tp", 1), engine=opts.get("engine", "vllm"),
                    scheme=opts.get("scheme", "w4a16"))
    pre.raise_if_errors(Path(src).name)
    pre.source.close()
    t0 = time.perf_counter()
    if opts.get("resume") and (work / GPTQ_FILE).is_file():
        print(f"gptq: reusing the finished GPTQ pass in {work} (--resume)")
    else:
        if work.exists():
            shutil.rmtree(work)
        run_gptq(src, calib, work, fmt=fmt, recipe=opts.get("recipe", "weight-only"), tp=opts.get("tp", 1),
                 engine=opts.get("engine", "vllm"), damp=damp, act_order=act_order, block=block,
                 scales=scales, dtype=gptq_dtype, device=device, progress=progress)
    # tensors the GPTQ pass did not write (lm_head, MTP, ...) have no activation statistics
    # here: they take the unweighted search for mse-act unless a stats folder is given
    rest = "mse" if scales == "mse-act" and calibration is None else scales
    seconds = time.perf_counter() - t0
    res = GPTQResults(work)
    summary = convert(src, out, gptq=work, calibration=calibration, scales=rest, progress=progress, **opts)
    summary.notes.append(f"GPTQ: {len(res.modules) - len(res.fallback)} Linear(s) of {len(res.meta.get('layers', []))} "
                         f"decoder layer(s) in {seconds:.1f} s; {len(res.fallback)} routed-expert Linear(s) "
                         f"with fewer than {res.meta.get('min_tokens')} routed tokens took {scales} without "
                         "a Hessian (listed in the manifest options)")
    if rest != scales:
        summary.notes.append("tensors outside the GPTQ pass (lm_head, MTP) have no activation statistics "
                             "without --calibration: they took --scales mse")
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return summary
