#!/usr/bin/env bash
# The speed table of docs/speed.md on one GPU or TPU chip: plain and RSPC train steps of
# RVT-Ti* at the CPU table's batch (8) and at a batch that fills the chip, then DeiT-S,
# RVT-S* and FAN-S-Hybrid, in float32 and bfloat16, each `python -m rspc_jax.benchmark`;
# DeiT-S in bfloat16 once more with RSPC_JAX_ATTENTION=explicit (fused attention's A/B).
#
#   launch/benchmark_accelerator.sh [LOG]      # LOG default: benchmark_accelerator.log
#
# BATCH (default 128) is the large batch; STEPS (default 10) the timed steps per step kind;
# RUN_TIMEOUT (default 150 s) bounds each run so one slow compile cannot eat the rest.
set -uo pipefail
LOG="${1:-benchmark_accelerator.log}"
BATCH="${BATCH:-128}"
STEPS="${STEPS:-10}"
PYTHON="${PYTHON:-python3}"

bench() {
  echo "== $*" | tee -a "$LOG"
  timeout "${RUN_TIMEOUT:-150}" "$PYTHON" -m rspc_jax.benchmark --steps="$STEPS" "$@" 2>&1 \
    | grep -v "^[WI][0-9]\{4\} " | tee -a "$LOG"
}

"$PYTHON" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
bench --config=configs/rvt_ti.py --batch=8
bench --config=configs/rvt_ti.py --batch="$BATCH"
bench --config=configs/rvt_ti.py --batch="$BATCH" --config.compute_dtype=bfloat16
for config in deit_s rvt_s fan_s_hybrid; do
  bench --config=configs/$config.py --batch="$BATCH" --config.compute_dtype=bfloat16
done
# The same DeiT-S row with the explicit softmax attention, against the fused default on GPU.
RSPC_JAX_ATTENTION=explicit bench --config=configs/deit_s.py --batch="$BATCH" --config.compute_dtype=bfloat16
for config in deit_s rvt_s fan_s_hybrid; do
  bench --config=configs/$config.py --batch="$BATCH"
done
