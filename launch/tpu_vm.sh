#!/usr/bin/env bash
# Create, set up, train on, watch, resume and delete a Cloud TPU VM or pod slice.
#
#   export PROJECT=my-project ZONE=europe-west4-a TPU_NAME=rspc BUCKET=my-bucket
#   ACCELERATOR=v3-32 launch/tpu_vm.sh create        # SPOT=1: spot capacity; QUEUED=1: queued resource
#   ACCELERATOR=v5litepod-256 launch/tpu_vm.sh create --config=configs/rvt_b.py
#                                                    # compiles the config for the slice first, here
#                                                    # (python -m rspc_jax.plan --preflight; PREFLIGHT=0 skips)
#   launch/tpu_vm.sh setup                           # copy this checkout to every worker, install jax[tpu]
#   launch/tpu_vm.sh train --config=configs/rvt_b.py # all workers, in the background, logs to ~/rspc_train.log
#   launch/tpu_vm.sh logs                            # stream worker 0's log (Ctrl-C stops watching only)
#   launch/tpu_vm.sh status                          # READY / PREEMPTED / ...
#   ACCELERATOR=v3-32 launch/tpu_vm.sh resume --config=configs/rvt_b.py   # after a preemption
#   launch/tpu_vm.sh delete
#
# `--dry-run` before the sub-command prints the commands instead of running them.
# Runs write to gs://$BUCKET/rspc_runs/$RUN (RUN defaults to TPU_NAME) and read tfds data
# from $TFDS_DATA_DIR (default gs://$BUCKET/tfds); a rerun of `train` with the same RUN
# resumes from the last checkpoint there. RUNTIME overrides the TPU software version.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
COMMAND="${1:-}"
shift || true

die() { echo "launch/tpu_vm.sh: $*" >&2; exit 2; }
need() { [[ -n "${!1:-}" ]] || die "set $1 ($2)"; }
run() { if [[ $DRY_RUN == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }

case "$COMMAND" in
  create|setup|train|logs|status|resume|delete) ;;
  *) die "usage: [--dry-run] {create|setup|train|logs|status|resume|delete} (see the header of this script)" ;;
esac
need PROJECT "the Google Cloud project, e.g. PROJECT=my-project"
need ZONE "a zone with TPU capacity, e.g. ZONE=europe-west4-a"
need TPU_NAME "the TPU VM name, e.g. TPU_NAME=rspc"

WHERE=(--zone="$ZONE" --project="$PROJECT")
TPU=(gcloud compute tpus tpu-vm)
REMOTE_DIR=rspc_jax
VENV='~/rspc_venv'
LOG='~/rspc_train.log'

runtime_for() {  # the TPU VM software version each generation boots with
  case "$1" in
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

preflight() {  # the config's steps compiled for the slice by the TPU compiler, on this host
  local config=() arg
  for arg in "$@"; do [[ "$arg" == --config* ]] && config+=("$arg"); done
  if [[ ${#config[@]} == 0 || "${PREFLIGHT:-1}" == 0 ]]; then return 0; fi
  local slice="${ACCELERATOR/v5litepod-/v5e-}"
  case "$slice" in
    v4-*|v5e-*|v5p-*|v6e-*) ;;
    *) echo "launch/tpu_vm.sh: no pre-flight for $ACCELERATOR (the TPU compiler here knows v4, v5e, v5p, v6e)" >&2; return 0 ;;
  esac
  run python -m rspc_jax.plan "${config[@]}" --preflight="$slice" \
    || die "the pre-flight says ${config[*]} does not fit $ACCELERATOR (above); fix the config, or PREFLIGHT=0 to create it anyway"
}

create() {
  need ACCELERATOR "the accelerator type, e.g. ACCELERATOR=v3-8, or v3-32 for a pod slice"
  preflight "$@"
  local runtime="${RUNTIME:-$(runtime_for "$ACCELERATOR")}"
  local capacity=()
  [[ "${SPOT:-0}" == 1 ]] && capacity+=(--spot)
  if [[ "${QUEUED:-0}" == 1 ]]; then
    run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" \
      "${WHERE[@]}" --accelerator-type="$ACCELERATOR" --runtime-version="$runtime" "${capacity[@]}"
  else
    run "${TPU[@]}" create "$TPU_NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR" \
      --version="$runtime" "${capacity[@]}"
  fi
}

setup() {
  run "${TPU[@]}" scp --recurse "$(git rev-parse --show-toplevel)" "$TPU_NAME:~/$REMOTE_DIR" \
    "${WHERE[@]}" --worker=all
  run "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command \
    "python3 -m venv $VENV && . $VENV/bin/activate && pip install -q -r $REMOTE_DIR/requirements.txt -r $REMOTE_DIR/requirements-tpu.txt"
}

train() {
  need BUCKET "the GCS bucket for checkpoints and data, e.g. BUCKET=my-bucket (no gs://)"
  [[ " $* " == *" --config="* ]] || die "train needs --config=configs/<file>.py (and any --config.<key>=... overrides)"
  [[ " $* " != *" --workdir="* ]] || die "the workdir is gs://\$BUCKET/rspc_runs/\$RUN; set RUN instead of --workdir"
  local workdir="gs://$BUCKET/rspc_runs/${RUN:-$TPU_NAME}"
  local data="${TFDS_DATA_DIR:-gs://$BUCKET/tfds}"
  local args
  args=$(printf '%q ' "$@")
  # nohup: training survives the ssh session; every worker runs the same command and
  # jax.distributed finds its peers from the TPU metadata.
  run "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command \
    "cd $REMOTE_DIR && . $VENV/bin/activate && TFDS_DATA_DIR=$data nohup python -m rspc_jax.main ${args}--workdir=$workdir --config.distributed=yes > $LOG 2>&1 &"
  echo "training in $workdir; watch it with: launch/tpu_vm.sh logs" >&2
}

case "$COMMAND" in
  create) create "$@" ;;
  setup) setup ;;
  train) train "$@" ;;
  logs) run "${TPU[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=0 --command "tail -n 100 -F $LOG" ;;
  status) run "${TPU[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(state)' ;;
  resume)
    # A preempted (spot) slice must be deleted and recreated; the run resumes from its
    # last checkpoint in gs://$BUCKET/rspc_runs/$RUN.
    if [[ $DRY_RUN == 0 ]]; then
      state=$("${TPU[@]}" describe "$TPU_NAME" "${WHERE[@]}" --format='value(state)' 2>/dev/null || echo MISSING)
      [[ "$state" != READY ]] || die "$TPU_NAME is READY, not preempted: rerun 'train' to resume on it"
    fi
    run "${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
    create
    setup
    train "$@"
    ;;
  delete)
    if [[ "${QUEUED:-0}" == 1 ]]; then
      run gcloud compute tpus queued-resources delete "$TPU_NAME" "${WHERE[@]}" --force --quiet
    else
      run "${TPU[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
    fi
    ;;
esac
