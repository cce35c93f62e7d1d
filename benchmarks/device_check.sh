#!/usr/bin/env bash
# The device check: a staged probe of one accelerator, run from this tree on the machine's own Python and
# JAX (nothing is installed into it; no network). Missing packages come as wheels built here by
# benchmarks/build_device_wheels.sh and are unpacked under OUT/site (`pip install --no-index --target`).
#
# Stages, in order of value, each under its own time limit and each writing its own OUT/<stage>.json as
# it goes (OUT/stages.json after every stage), so a stage that times out keeps what it measured:
#   env             versions, devices, imports of everything the project needs        (benchmarks/device_probe.py)
#   decode          8B-shaped paged decode, random bf16 weights, batch 1 x 1k and 64 x 8k (the bars)
#                   first, then 64 x 1k and 1 x 8k: % of the HBM roofline and the host gap between calls;
#                   each point in its own process under its own 70 s limit          (benchmarks/device_probe.py)
#   attention       packed-row attention forward + backward at 32k positions, 8B heads (cuDNN packed
#                   layout vs blocked)                                                  (benchmarks/device_probe.py)
#   train_mfu       train step MFU at 2 x 4k-token rows, 1.5B shape                     (benchmarks/bench_train.py)
#   train_memory    train step memory at one 32k-token row, 1.5B shape: the device compiler's figure and
#                   the real peak against the plan check's                             (benchmarks/device_probe.py)
#   sync_1p5b       in-process weight sync, 1.5B                               (benchmarks/bench_sync_one_process.py)
#   sync_8b         in-process weight sync, 8B                                 (benchmarks/bench_sync_one_process.py)
#   run             a 10-step async run (0.5B shape, synthetic arithmetic, both roles on device 0)
#                                                                                       (launch/run.py)
# Time limits (seconds): 30 + 160 + 70 + 60 + 60 + 25 + 30 + 120 = 555 s, inside one device call (600 s),
# with the rest for installing the wheels and the report. Sized from the first run on an H200 (2026-12-04,
# docs/history/benchmarks.md "First run on an H200"): the decode stage measured three points in 145 s (each batch
# compiles its own decode), the stages after it needed 8-33 s, and the run's version-0 evaluation alone
# ended 40 s in. OUT/device_check.json combines the stages, the bars and the correctness checks
# (attention against the blocked path, no non-finite step). Exits non-zero when a stage failed or timed
# out or a check failed (not for a missed bar).
#
#   benchmarks/build_device_wheels.sh                  # here, once: device_wheels/ (git-ignored)
#   benchmarks/device_check.sh [--hardware h200|h100|...] [--out DIR] [--wheels DIR]
#   benchmarks/device_check.sh --smoke [--out DIR]     # tiny shapes on CPU (the test suite's)
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
out=runs/device_check
hardware=""
wheels=device_wheels
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) smoke=1 ;;
    --out) out="$2"; shift ;;
    --hardware) hardware="$2"; shift ;;
    --wheels) wheels="$2"; shift ;;
    *) echo "device_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
python="${PYTHON:-python3}"
mkdir -p "$out"
rm -rf "$out/run" "$out"/*.json "$out"/*.log
site=""
if compgen -G "$wheels/*.whl" > /dev/null; then  # the packages this machine lacks, unpacked beside the tree
  site="$(cd "$out" && pwd)/site"
  rm -rf "$site"
  "$python" -m pip install --quiet --no-deps --no-index --target "$site" "$wheels"/*.whl \
    > "$out/wheels.log" 2>&1 || { echo "device_check.sh: installing $wheels failed:"; cat "$out/wheels.log"; }
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's package first
probe=("$python" -m benchmarks.device_probe)

memory_env=()  # the train_memory stage's environment: the compile it compares with the plan check's
if [[ $smoke == 1 ]]; then
  export JAX_PLATFORMS=cpu
  # Tiny shapes on a CPU check that every stage runs, not how fast: LLVM's optimisations off, as in the
  # test suite. train_memory compiles as a run does (the user's XLA_FLAGS), so its equality with the
  # plan check, which compiles with them off, still shows that buffer assignment does not depend on them.
  memory_env=(env "XLA_FLAGS=${XLA_FLAGS:-}")
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
  limit=(240 240 240 240 240 240 240 300)  # generous: on a shared, loaded 2-core CPU only load times out
  decode=(--preset tiny --dtype float32 --points 1x16,1x32 --new-tokens 8 --steps-per-call 4 --reps 1
          --stage-limit-s 235)
  attention=(--preset tiny --dtype float32 --seq-len 256 --reps 1)
  train=(--model tiny --rows 2 --budget 64 --steps 1 --matmul-n 256)
  train_memory=(--preset tiny --rows 1 --budget 128)
  sync_small=(--preset tiny --dtype float32 --reps 1)
  sync_big=(--preset tiny --dtype bfloat16 --reps 1)
  run=(--config.total_steps=3 --config.trainer.total_steps=3 --config.trainer.warmup_steps=1
       --config.eval_every=3 --config.eval_prompts=8 --config.prompts_per_step=8
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
  # What launch/gpu_node.sh gives a run: the 8B decode at batch 64 x 8k holds ~95 GB.
  export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
  limit=(30 160 70 60 60 25 30 120)
  # The bars' points first (batch 1 x 1k, batch 64 x 8k), each in a process of its own under its own
  # limit, then the others while the stage's time lasts; a point that the plan says cannot fit the
  # device (64 x 8k needs ~94 GB: not on an 80 GB H100) is skipped, saying so.
  decode=(--preset qwen3-8b --dtype bfloat16 --points 1x1024,64x8192,64x1024,1x8192 --new-tokens 64
          --steps-per-call 16 --reps 3 --hardware "$hardware" --point-limit-s 70 --stage-limit-s 155)
  attention=(--preset qwen3-8b --dtype bfloat16 --seq-len 32768 --reps 3)
  train=(--model qwen2.5-1.5b --dtype bfloat16 --rows 2 --budget 4096 --steps 3 --hardware "$hardware")
  train_memory=(--preset qwen2.5-1.5b --rows 1 --budget 32768)
  sync_small=(--preset qwen2.5-1.5b --dtype bfloat16 --reps 5)
  sync_big=(--preset qwen3-8b --dtype bfloat16 --reps 3)
  run=(--config.model.preset=qwen2.5-0.5b --config.model.n_layers=0 --config.model.dtype=bfloat16
       --config.total_steps=10 --config.trainer.total_steps=10 --config.eval_every=5
       --config.eval_prompts=32 --config.mesh.colocate=True)
fi

names=()
declare -A status
write_stages() {
  {
    echo "{"
    local sep=""
    for n in "${names[@]}"; do
      printf '%s "%s": %s\n' "$sep" "$n" "${status[$n]}"
      sep=","
    done
    echo "}"
  } > "$out/stages.json.tmp" && mv "$out/stages.json.tmp" "$out/stages.json"
}
stage() {  # stage NAME SECONDS COMMAND...: one stage under its time limit; records how it ended
  local name="$1" seconds="$2"
  shift 2
  local t0=$SECONDS rc=0
  echo "== $name (limit ${seconds}s)"
  timeout -k 5 "$seconds" "$@" > "$out/$name.log" 2>&1 || rc=$?
  tail -n 3 "$out/$name.log"
  local timed_out=false
  [[ $rc == 124 || $rc == 137 ]] && timed_out=true
  names+=("$name")
  status[$name]="{\"rc\": $rc, \"timed_out\": $timed_out, \"seconds\": $((SECONDS - t0)), \"limit\": $seconds}"
  write_stages
}

stage env "${limit[0]}" "${probe[@]}" --stage env --json-out "$out/env.json"
stage decode "${limit[1]}" "${probe[@]}" --stage decode "${decode[@]}" --json-out "$out/decode.json"
stage attention "${limit[2]}" "${probe[@]}" --stage attention "${attention[@]}" --json-out "$out/attention.json"
stage train_mfu "${limit[3]}" "$python" -m benchmarks.bench_train "${train[@]}" --tail-seqs 0 \
  --json-out "$out/train_mfu.json"
stage train_memory "${limit[4]}" "${memory_env[@]}" "${probe[@]}" --stage train_memory "${train_memory[@]}" \
  --json-out "$out/train_memory.json"
stage sync_1p5b "${limit[5]}" "$python" -m benchmarks.bench_sync_one_process "${sync_small[@]}" \
  --json-out "$out/sync_1p5b.json"
stage sync_8b "${limit[6]}" "$python" -m benchmarks.bench_sync_one_process "${sync_big[@]}" \
  --json-out "$out/sync_8b.json"
stage run "${limit[7]}" "$python" launch/run.py --config=configs/tiny_arith.py --config.workdir="$out/run" \
  --config.warm_start.enabled=False --config.mesh.sampler="(1,1)" --config.mesh.trainer="(1,1)" "${run[@]}"

"$python" -m benchmarks.device_check_report "$out"
