#!/usr/bin/env bash
# A TPU VM slice: create it, copy this checkout to every worker, run launch/run.py on all of them (one
# controller per host; JAX finds the coordinator, process count and id itself on Cloud TPU), tear down.
#
#   TPU_NAME=rl-v5p ZONE=us-east5-a ACCELERATOR=v5p-64 \
#     launch/tpu_pod.sh configs/math_8b.py --config.workdir=gs://BUCKET/runs/math_8b \
#       --config.model.checkpoint=/data/Qwen3-8B --config.data.path=/data/math.jsonl
#   launch/tpu_pod.sh --dry-run configs/math_8b.py ...      # print every command, run none
#
# Variables (defaults in brackets):
#   TPU_NAME      name of the TPU VM slice [jaxrl-async]
#   ZONE          GCP zone [us-east5-a]
#   PROJECT       GCP project [gcloud's default]
#   ACCELERATOR   slice type, e.g. v5p-64, v5litepod-16 [v5p-64]
#   RUNTIME       TPU VM software version [v2-alpha-tpuv5]
#   SPOT          1 = a Spot (preemptible) slice [0]
#   KEEP          1 = leave the slice running after the job [0]
#   CREATE        0 = use an existing slice of that name [1]
#   REMOTE_DIR    where the committed tree is unpacked on every worker [~/jaxrl_async]
# The config decides which hosts sample and which train (config.mesh.sampler_processes /
# trainer_processes; the learner lead, process 0, must be a trainer). The workdir must be storage every
# worker sees (a gs:// bucket or a shared filesystem): checkpoints are written from every trainer host.
set -euo pipefail
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
if [[ $# -lt 1 ]]; then
  echo "usage: launch/tpu_pod.sh [--dry-run] CONFIG [launch/run.py flags...]" >&2
  exit 2
fi
config="$1"; shift
here="$(cd "$(dirname "$0")/.." && pwd)"
TPU_NAME="${TPU_NAME:-jaxrl-async}"
ZONE="${ZONE:-us-east5-a}"
ACCELERATOR="${ACCELERATOR:-v5p-64}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
SPOT="${SPOT:-0}"
KEEP="${KEEP:-0}"
CREATE="${CREATE:-1}"
REMOTE_DIR="${REMOTE_DIR:-~/jaxrl_async}"
project=()
if [[ -n "${PROJECT:-}" ]]; then project=(--project="$PROJECT"); fi

run() {  # print the command; run it unless --dry-run
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $dry -eq 0 ]]; then "$@"; fi
}

tpu=(gcloud compute tpus tpu-vm)
if [[ "$CREATE" == 1 ]]; then
  create=("${tpu[@]}" create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCELERATOR" --version="$RUNTIME" "${project[@]}")
  if [[ "$SPOT" == 1 ]]; then create+=(--spot); fi
  run "${create[@]}"
fi
if [[ "$KEEP" != 1 ]]; then
  teardown() { run "${tpu[@]}" delete "$TPU_NAME" --zone="$ZONE" --quiet "${project[@]}"; }
  trap teardown EXIT
fi
# The committed tree (git archive HEAD: no virtual environment, runs or caches) goes to every worker.
bundle="${TMPDIR:-/tmp}/jaxrl_async-$TPU_NAME.tar.gz"
run git -C "$here" archive --format=tar.gz -o "$bundle" HEAD
run "${tpu[@]}" scp "$bundle" "$TPU_NAME:jaxrl_async.tar.gz" --worker=all --zone="$ZONE" "${project[@]}"
flags="$(printf ' %q' "$@")"
remote="mkdir -p $REMOTE_DIR && tar xzf jaxrl_async.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR"
remote+=" && pip install -q -e '.[tpu]' && python launch/run.py --config=$config$flags"
# ----- the run's secret: it signs every message between the processes (jaxrl_async/runtime/secret.py) -----
# A fresh one per run, written to a file only its owner can read, copied to every worker and removed here;
# the processes find it through JAXRL_SECRET_FILE. It is never on a command line or in the output.
secret_file="${TMPDIR:-/tmp}/jaxrl_async-$TPU_NAME.secret"
if [[ $dry -eq 0 ]]; then
  rm -f "$secret_file"
  (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' > "$secret_file")
fi
run "${tpu[@]}" scp "$secret_file" "$TPU_NAME:.jaxrl_async.secret" --worker=all --zone="$ZONE" "${project[@]}"
if [[ $dry -eq 0 ]]; then rm -f "$secret_file"; fi
remote="chmod 600 ~/.jaxrl_async.secret && export JAXRL_SECRET_FILE=~/.jaxrl_async.secret && $remote"
# ----- end of the secret -----
run "${tpu[@]}" ssh "$TPU_NAME" --worker=all --zone="$ZONE" "${project[@]}" --command="$remote"
