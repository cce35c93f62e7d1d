#!/usr/bin/env bash
# Device checks on one accelerator (written for a lent GPU; about 7 minutes, every stage time-limited):
#   1. decode tokens/s of a Qwen2.5-1.5B-shaped random-weight model in bf16, batch 1 and the largest batch
#      that fits, against the HBM roofline               (tools/bench_decode.py)
#   2. train-step MFU against the GPU's bf16 peak (Qwen2.5-1.5B shape, bf16 compute, fp32 masters)
#                                                         (tools/bench_train.py)
#   3. weight-sync GB/s trainer -> sampler, colocated and (with 2+ devices) across two meshes
#                                                         (tools/bench_sync_one_process.py)
#   4. a 30-step async run of a Qwen2.5-0.5B-shaped model on synthetic arithmetic, then a check that the
#      README's TensorBoard tags are present             (launch/run.py)
# Writes OUT/{decode,train,weight_sync,stages}.json, OUT/run/ and OUT/device_check.json (all of it, with
# the peer bars checked: decode >= 70% of HBM bandwidth at batch 1, MFU >= 40%, sync <= 0.5 s colocated).
# Exits non-zero when a stage failed or timed out, or a TensorBoard tag is missing (not for a missed bar).
#
#   tools/device_check.sh [--hardware h100|h200|...] [--out DIR]
#   tools/device_check.sh --smoke [--out DIR]     # tiny shapes on CPU in about a minute (the test suite's)
#
# Nothing is downloaded: every model has random weights, the data are generated.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tools below check this checkout's package

smoke=0
out=runs/device_check
hardware=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) out="$2"; shift ;;
    --hardware) hardware="$2"; shift ;;
    *) echo "device_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
rm -rf "$out/run" "$out"/*.json

if [[ $smoke == 1 ]]; then
  export JAX_PLATFORMS=cpu
  # Two CPU devices, so the weight sync also runs across two meshes.
  export XLA_FLAGS="--xla_force_host_platform_device_count=2"
  limit=(120 120 60 240)  # seconds per stage on a shared 2-core machine
  decode=(--preset tiny --quick --batches 1,max --max-batch 8)
  train=(--model tiny --rows 2 --budget 64 --steps 1 --matmul-n 256)
  sync=(--preset tiny --dtype float32 --reps 2)
  run=(--config.total_steps=3 --config.trainer.total_steps=3 --config.trainer.warmup_steps=1
       --config.eval_every=3 --config.eval_prompts=16 --config.prompts_per_step=8
       --config.sampler.num_slots=16)
else
  if [[ -z $hardware ]] && command -v nvidia-smi > /dev/null; then
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
      *H200*) hardware=h200 ;;
      *H100*) hardware=h100 ;;
      *H800*) hardware=h800 ;;
    esac
  fi
  if [[ -z $hardware ]]; then
    echo "device_check.sh: pass --hardware (a jaxrl_async.perf preset) for the roofline and MFU" >&2
    exit 2
  fi
  limit=(120 90 45 180)
  decode=(--preset qwen2.5-1.5b --dtype bfloat16 --batches 1,max --prompt-len 128 --new-tokens 512
          --hardware "$hardware")
  train=(--model qwen2.5-1.5b --dtype bfloat16 --rows 2 --budget 4096 --steps 3 --hardware "$hardware")
  sync=(--preset qwen2.5-1.5b --dtype bfloat16 --reps 5)
  # The CPU demo's task and sizes with a 0.5B-shaped model in bf16 (fp32 masters), both roles on GPU 0.
  run=(--config.model.preset=qwen2.5-0.5b --config.model.n_layers=0 --config.model.dtype=bfloat16
       --config.total_steps=30 --config.trainer.total_steps=30 --config.eval_every=10
       --config.eval_prompts=128 --config.mesh.colocate=True)
fi

declare -A status
stage() {  # stage NAME SECONDS COMMAND...: runs a stage under a time limit, recording how it ended
  local name="$1" seconds="$2"
  shift 2
  local t0=$SECONDS rc=0
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1 || rc=$?
  tail -n 4 "$out/$name.log"
  local timed_out=false
  [[ $rc == 124 ]] && timed_out=true
  status[$name]="{\"rc\": $rc, \"timed_out\": $timed_out, \"seconds\": $((SECONDS - t0))}"
}

stage decode "${limit[0]}" python tools/bench_decode.py "${decode[@]}" --latency-only --skip-hf \
  --json-out "$out/decode.json"
stage train "${limit[1]}" python tools/bench_train.py "${train[@]}" --tail-seqs 0 --json-out "$out/train.json"
stage weight_sync "${limit[2]}" python tools/bench_sync_one_process.py "${sync[@]}" \
  --json-out "$out/weight_sync.json"
stage run "${limit[3]}" python launch/run.py --config=configs/tiny_arith.py --config.workdir="$out/run" \
  --config.warm_start.enabled=False --config.mesh.sampler="(1,1)" --config.mesh.trainer="(1,1)" "${run[@]}"

{
  echo "{"
  sep=""
  for name in decode train weight_sync run; do
    printf '%s "%s": %s\n' "$sep" "$name" "${status[$name]}"
    sep=","
  done
  echo "}"
} > "$out/stages.json"
python tools/device_check_report.py "$out"
