#!/usr/bin/env bash
# A TPU VM slice: create it, copy this checkout to every worker, run launch/run.py on all of them (one
# controller per host; JAX finds the coordinator, process count and id itself on Cloud TPU), tear down.
#
#   TPU_NAME=rl-v5p ZONE=us-east5-a ACCELERATOR=v5p-128 \
#     launch/tpu_pod.sh configs/math_8b.py --config.workdir=gs://BUCKET/runs/math_8b \
#       --config.model.checkpoint=gs://BUCKET/models/Qwen3-8B --config.data.path=gs://BUCKET/data/math.jsonl
#   launch/tpu_pod.sh --dry-run configs/math_8b.py ...      # print every command, run none
#
# Variables (defaults in brackets):
#   TPU_NAME      name of the TPU VM slice [jaxrl-async]
#   ZONE          GCP zone [us-east5-a]
#   PROJECT       GCP project [gcloud's default]
#   ACCELERATOR   slice type, e.g. v5p-128, v5litepod-16 [v5p-128: 64 chips, 16 hosts of 4]
#   RUNTIME       TPU VM software version [v2-alpha-tpuv5]
#   SPOT          1 = a Spot (preemptible) slice [0]
#   KEEP          1 = leave the slice running after the job [0]
#   CREATE        0 = use an existing slice of that name [1]
#   REMOTE_DIR    where the committed tree is unpacked on every worker [~/jaxrl_async]
#   REMOTE_PYTHON the workers' interpreter for the run's virtual environment (>= 3.11; installed with
#                 apt when missing) [python3.11]
#   PYTHON        this machine's interpreter for the layout check [python3]
# Before anything is created (and in --dry-run) the config is checked against the slice
# (jaxrl_async/cli/check_layout.py): hosts x chips per host from ACCELERATOR (v5p-N counts TensorCores,
# two per chip, 4 chips a host; v5litepod-N and v6e-N count chips), the roles derived from config.mesh
# (trainer first, then the sampler replicas; or config.mesh.sampler_processes / trainer_processes), every
# mesh on whole hosts. A mismatch names ACCELERATOR and the config field, and nothing is created.
# Launcher flags for the config take the --config.x=value form (so the check sees them).
# Storage (docs/distributed.md, "Pod storage"): a new slice's workers start empty and share no disk, so
# with CREATE=1 config.workdir, config.model.checkpoint, config.tokenizer and config.data.path/eval_path
# must be gs:// URLs (the workers read the model and the data from the bucket; checkpoints, TensorBoard
# events, trained_uids.jsonl and summary.json are written there). A local path is refused, naming the
# field, in --dry-run and before anything is created. CREATE=0 (a slice you prepared) allows local paths
# that exist on every worker.
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
ACCELERATOR="${ACCELERATOR:-v5p-128}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
SPOT="${SPOT:-0}"
KEEP="${KEEP:-0}"
CREATE="${CREATE:-1}"
REMOTE_DIR="${REMOTE_DIR:-~/jaxrl_async}"
REMOTE_PYTHON="${REMOTE_PYTHON:-python3.11}"
PYTHON="${PYTHON:-python3}"
project=()
if [[ -n "${PROJECT:-}" ]]; then project=(--project="$PROJECT"); fi

run() {  # print the command; run it unless --dry-run
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $dry -eq 0 ]]; then "$@"; fi
}

# The layout check: the config against the slice, before anything is created (or paid for).
check_flags=()
for arg in "$@"; do
  case "$arg" in --config.*) check_flags+=("$arg") ;; esac
done
status=0
new_hosts=()
if [[ "$CREATE" == 1 ]]; then new_hosts=(--new-hosts); fi
hosts="$(cd "$here" && PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m jaxrl_async.cli.check_layout \
  --accelerator="$ACCELERATOR" --source="ACCELERATOR=$ACCELERATOR" --config="$config" "${new_hosts[@]}" \
  "${check_flags[@]}")" || status=$?
if [[ $status -eq 2 ]]; then
  echo "launch/tpu_pod.sh: the config does not fit ACCELERATOR=$ACCELERATOR; nothing was created" >&2
  exit 2
elif [[ $status -eq 3 ]]; then
  echo "launch/tpu_pod.sh: the config is not ready to run (the field named above), whatever the slice;" \
    "nothing was created" >&2
  exit 2
elif [[ $status -ne 0 ]]; then
  echo "launch/tpu_pod.sh: the layout check did not run with PYTHON=$PYTHON (it needs this project" \
    "installed: pip install -e .); nothing was created" >&2
  exit 2
fi

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
# The run's own virtual environment on the project's Python (the VM image's system Python may be older).
remote+=" && { command -v $REMOTE_PYTHON >/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q $REMOTE_PYTHON-venv; }; }"
remote+=" && { [ -x .venv/bin/python ] || $REMOTE_PYTHON -m venv .venv; } && .venv/bin/python -m pip install -q -e '.[tpu]'"
# --num_processes: the host count checked above (JAX finds the coordinator and each process id itself).
remote+=" && .venv/bin/python launch/run.py --config=$config --num_processes=$hosts$flags"
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
