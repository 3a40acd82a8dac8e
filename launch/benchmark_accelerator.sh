#!/usr/bin/env bash
# The accelerator table on one GPU or TPU chip: plain and RSPC train steps of DeiT-S, RVT-S*,
# FAN-S-Hybrid and XCiT-S12 in bfloat16 (DeiT-S also with the explicit attention, and in
# float32), each a `python -m benchmarks.train_step` run.
#
#   launch/benchmark_accelerator.sh [LOG]      # LOG default: benchmark_accelerator.log
#
# Compiles dominate a short chip lease, so the script first compiles every row's steps at once
# (`--compile_only`, one process per row and step kind, into JAX's persistent compilation
# cache), then times the rows one at a time, each loading its compiled steps from the cache.
# The compile times of the first phase were taken side by side with the other compiles.
# On GPUs, DeiT-S and XCiT-S12 are timed beside timm's step (`--compare_timm`, bfloat16
# autocast on the same GPU); with OFFICIAL=benchmarks/official_step.py (and RSPC_OFFICIAL_REPO,
# a checkout of guoyongcs/RSPC), RVT-S* beside the official code's float32 step
# (--compare_command). Rows go in order of priority: a run that outlives its time limit costs
# only the rows after it.
#
# BATCH (default 256) is DeiT-S's batch, BATCH_CONV (default 128) the other models';
# STEPS (default 10) the timed steps per step kind; COMPILE_TIMEOUT (default 900 s) bounds the
# compile phase and RUN_TIMEOUT (default 600 s) each timed row (the convolutional models
# compile for minutes beside the other compiles); PROFILE_DIR, if set, also
# traces each row's steps there (--profile_dir) and prints their top ops; EXTRA_ROWS, more rows
# in the ROWS format below (one per line), e.g. A/B choices, timed right after the first row;
# COMPILE_JOBS, the compiles at a time (default: all on GPUs, 1 on TPUs); ONLY, the names of
# the rows to run, in that order (default: every row), for a short lease.
set -uo pipefail
LOG="${1:-benchmark_accelerator.log}"
BATCH="${BATCH:-256}"
BATCH_CONV="${BATCH_CONV:-128}"
STEPS="${STEPS:-10}"
PYTHON="${PYTHON:-python3}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-/tmp/rspc_jax_compilation_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
# Several compiling processes, and the PyTorch reference steps, share the chip's memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

BF16=--config.compute_dtype=bfloat16
TIMM="--compare_timm --rounds=2"
OFFICIAL_ROWS=""
if [[ -n "${OFFICIAL:-}" ]]; then
  OFFICIAL_ROWS="--rounds=2 --compare_command=plain='$PYTHON $OFFICIAL plain {steps} --model rvt_small_plus --batch $BATCH_CONV --device cuda --autocast bfloat16'"
  OFFICIAL_ROWS+=" --compare_command=rspc='$PYTHON $OFFICIAL rspc {steps} --model rvt_small_plus --batch $BATCH_CONV --device cuda --autocast bfloat16'"
fi
# name | implementation choices of both step kinds (@CHOICE=VALUE..., rspc_jax.models.ops) |
# the config and its overrides | what the timed run adds
ROWS=(
  "deit_s_bf16||--config=configs/deit_s.py --batch=$BATCH $BF16|$TIMM"
)
while IFS= read -r row; do
  [[ -n "$row" ]] && ROWS+=("$row")
done <<<"${EXTRA_ROWS:-}"
ROWS+=(
  "deit_s_bf16_explicit_attention|@attention=explicit|--config=configs/deit_s.py --batch=$BATCH $BF16|"
  "rvt_s_bf16||--config=configs/rvt_s.py --batch=$BATCH_CONV $BF16 --config.patch_aug=off|$OFFICIAL_ROWS"
  "fan_s_hybrid_bf16||--config=configs/fan_s_hybrid.py --batch=$BATCH_CONV $BF16|"
  "xcit_s12_bf16||--config=configs/xcit_s12.py --batch=$BATCH_CONV $BF16|$TIMM"
  "deit_s_f32||--config=configs/deit_s.py --batch=$BATCH|"
  "rvt_s_f32||--config=configs/rvt_s.py --batch=$BATCH_CONV --config.patch_aug=off|"
  "fan_s_hybrid_f32||--config=configs/fan_s_hybrid.py --batch=$BATCH_CONV|"
)

if [[ -n "${ONLY:-}" ]]; then
  chosen=()
  for name in $ONLY; do
    for row in "${ROWS[@]}"; do
      [[ "${row%%|*}" == "$name" ]] && chosen+=("$row")
    done
  done
  ((${#chosen[@]})) || { echo "ONLY=$ONLY names none of the rows" >&2; exit 2; }
  ROWS=("${chosen[@]}")
fi

quiet() { grep -v "^[WI][0-9]\{4\} "; }  # absl's and XLA's log lines

# The versions and devices for the log; a TPU admits one process at a time, so there the
# compiles run one after another.
info="$("$PYTHON" -c "import jax; print('jax', jax.__version__, jax.devices()); print('backend', jax.default_backend())" 2>&1)"
backend="$(sed -n 's/^backend //p' <<<"$info")"
grep -v "^backend " <<<"$info" | tee -a "$LOG"
COMPILE_JOBS="${COMPILE_JOBS:-$([[ "$backend" == tpu ]] && echo 1 || echo 0)}"  # 0: all at once

echo "== compile phase: every row's steps, $( ((COMPILE_JOBS)) && echo "$COMPILE_JOBS" || echo all) at a time" | tee -a "$LOG"
COMPILE_LOGS="$(mktemp -d)"
for row in "${ROWS[@]}"; do
  IFS='|' read -r name choices args _ <<<"$row"
  for variant in plain rspc; do
    # shellcheck disable=SC2086  # the fields are word lists
    timeout -k 10 "${COMPILE_TIMEOUT:-900}" "$PYTHON" -m benchmarks.train_step \
      --compile_only --variants=$variant$choices $args >"$COMPILE_LOGS/$name.$variant" 2>&1 &
    while ((COMPILE_JOBS > 0 && $(jobs -rp | wc -l) >= COMPILE_JOBS)); do wait -n; done
  done
done
wait
for row in "${ROWS[@]}"; do
  IFS='|' read -r name _ <<<"$row"
  for variant in plain rspc; do
    echo "-- $name $variant" | tee -a "$LOG"
    quiet <"$COMPILE_LOGS/$name.$variant" | tail -n 3 | tee -a "$LOG"
  done
done

rm -rf "$COMPILE_LOGS"

echo "== timed phase: one row at a time" | tee -a "$LOG"
for row in "${ROWS[@]}"; do
  IFS='|' read -r name choices args timed <<<"$row"
  profile=""
  [[ -n "${PROFILE_DIR:-}" ]] && profile="--profile_dir=$PROFILE_DIR/$name"
  echo "== $name: $choices $args $timed" | tee -a "$LOG"
  # eval: the reference commands are quoted inside $timed.
  eval "timeout -k 10 ${RUN_TIMEOUT:-600} $PYTHON -m benchmarks.train_step \
    --steps=$STEPS --variants=plain$choices,rspc$choices $args $timed $profile" 2>&1 |
    quiet | tee -a "$LOG"
done
