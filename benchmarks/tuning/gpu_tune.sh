#!/usr/bin/env bash
# One GPU call's tuning pass (after `TUNING=1 bash benchmarks/gpu_run.sh build`: the sweep
# variants and their knobs exist only in a -DJAX_SDPA_TUNING=ON build): time the run-time variants of the
# fp32 flash forward (JAX_SDPA_FLASH_FWD_CFG), backward (JAX_SDPA_FLASH_BWD_VARIANT) and the
# decode kernels side by side, then run the full flash correctness check with the winners
# set, so that a winner is only made the default with its check in hand. Logs/JSON in $OUT.
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/jax_sdpa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
repo=$(pwd)
say() { echo "== $(date -u +%T) $*"; }
rc=0
say "forward configurations"
(cd /tmp && timeout 120 python3 -P $repo/benchmarks/tuning/flash_fwd_sweep.py --out "$OUT" 2>&1 | tee "$OUT/fwd_sweep.log") || rc=1
say "backward variants"
(cd /tmp && timeout 90 python3 -P $repo/benchmarks/tuning/flash_bwd_sweep.py --out "$OUT/bwd" 2>&1 | tee "$OUT/bwd_sweep.log" | grep -v '^{"row"' ) || rc=1
fwd_best=$(grep "^fwd sweep best" "$OUT/fwd_sweep.log" | sed "s/.*: \([^ ]*\) [0-9.]* TFLOP.*/\1/" | grep -v default | paste -sd, -)
bwd_best=$(python3 - "$OUT/bwd_sweep.log" <<'PY'
import json, sys
best = ""
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except Exception:
        continue
    if r.get("sweep") == "bwd" and r.get("row", "").startswith("SD3") and "causal" not in r.get("row", ""):
        best = r.get("best", "")
print("" if best in ("", "base") else best)
PY
)
say "winners: forward '${fwd_best}' backward '${bwd_best}': full check with them"
(cd /tmp && JAX_SDPA_FLASH_FWD_CFG="$fwd_best" JAX_SDPA_FLASH_BWD_VARIANT="$bwd_best" timeout 120 \
   python3 -P $repo/benchmarks/gpu_flash_check.py --only check --out "$OUT/tuned" 2>&1 | grep -v "^ok " | tail -20) || rc=1
echo "$fwd_best" > "$OUT/fwd_best.txt"; echo "$bwd_best" > "$OUT/bwd_best.txt"
say "decode settings"
(cd /tmp && timeout 80 python3 -P $repo/benchmarks/tuning/decode_sweep.py --out "$OUT" 2>&1 | grep -E "best|DIFFERS|error|Error" | tail -20) || rc=1
say "tune done rc=$rc"
exit $rc
