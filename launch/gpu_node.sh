#!/usr/bin/env bash
# One multi-GPU host (e.g. 8 x H100): every GPU is a device of the one controller process.
#   launch/gpu_node.sh configs/math_8b.py:h100 --config.model.checkpoint=/ckpt/Qwen3-8B \
#       --config.data.path=/data/math.jsonl --config.workdir=/runs/math_8b
# Check first that the layout fits:  jaxrl-plan-check --config configs/math_8b.py:h100 \
#       --preset qwen3-8b --hardware h100
set -euo pipefail
cd "$(dirname "$0")/.."
config="$1"
shift
# Let XLA take most of each GPU (weights, optimizer state and the KV cache are sized by the config).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# Keep the reward workers and data pipeline off the accelerator.
export TOKENIZERS_PARALLELISM=false
exec python launch/run.py --config="$config" "$@"
