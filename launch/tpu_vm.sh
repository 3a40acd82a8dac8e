#!/usr/bin/env bash
# Create, set up, train on and delete a Cloud TPU VM (single host or pod slice).
#
#   TPU_NAME=rspc ZONE=europe-west4-a ACCELERATOR=v3-8 launch/tpu_vm.sh create
#   TPU_NAME=rspc ZONE=europe-west4-a launch/tpu_vm.sh setup
#   TPU_NAME=rspc ZONE=europe-west4-a TFDS_DATA_DIR=gs://BUCKET/tfds \
#     launch/tpu_vm.sh train --config=configs/deit_s.py --workdir=gs://BUCKET/runs/deit_s
#   TPU_NAME=rspc ZONE=europe-west4-a launch/tpu_vm.sh delete
#
# `--dry-run` before the sub-command prints the gcloud commands instead of running them.
# Optional: PROJECT (else gcloud's default), SPOT=1 (preemptible capacity). `train` runs
# on every worker; rerunning it after a preemption resumes from the last checkpoint.
set -euo pipefail

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
COMMAND="${1:-}"
shift || true

die() { echo "launch/tpu_vm.sh: $*" >&2; exit 2; }
need() { [[ -n "${!1:-}" ]] || die "set $1 ($2)"; }
run() { if [[ $DRY_RUN == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }

need TPU_NAME "the TPU VM name, e.g. TPU_NAME=rspc"
need ZONE "a zone with TPU capacity, e.g. ZONE=europe-west4-a"
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE")
[[ -n "${PROJECT:-}" ]] && WHERE+=(--project="$PROJECT")
REMOTE_DIR=rspc_jax
VENV='~/rspc_venv'

case "$COMMAND" in
  create)
    need ACCELERATOR "the accelerator type, e.g. ACCELERATOR=v3-8 or v3-32"
    EXTRA=()
    [[ "${SPOT:-0}" == 1 ]] && EXTRA+=(--spot)
    run "${GCLOUD[@]}" create "$TPU_NAME" "${WHERE[@]}" --accelerator-type="$ACCELERATOR" \
      --version=tpu-ubuntu2204-base "${EXTRA[@]}"
    ;;
  setup)
    run "${GCLOUD[@]}" scp --recurse "$(git rev-parse --show-toplevel)" "$TPU_NAME:~/$REMOTE_DIR" \
      "${WHERE[@]}" --worker=all
    run "${GCLOUD[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command \
      "python3 -m venv $VENV && . $VENV/bin/activate && pip install -q -r $REMOTE_DIR/requirements.txt && pip install -q 'jax[tpu]==0.10.2'"
    ;;
  train)
    need TFDS_DATA_DIR "where the prepared tfds datasets live, e.g. gs://BUCKET/tfds"
    [[ $# -gt 0 ]] || die "train needs the arguments of rspc_jax.main, e.g. --config=... --workdir=gs://..."
    ARGS=$(printf '%q ' "$@")
    run "${GCLOUD[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command \
      "cd $REMOTE_DIR && . $VENV/bin/activate && TFDS_DATA_DIR=$TFDS_DATA_DIR python -m rspc_jax.main $ARGS--config.distributed=yes"
    ;;
  delete)
    run "${GCLOUD[@]}" delete "$TPU_NAME" "${WHERE[@]}" --quiet
    ;;
  *)
    die "usage: [--dry-run] {create|setup|train|delete} (see the header of this script)"
    ;;
esac
