#!/usr/bin/env bash
# Builds the wheel folder a lent accelerator machine needs beside its own Python and JAX:
#   benchmarks/build_device_wheels.sh [DIR]          # default device_wheels/ (git-ignored)
#
# The lent machine (Python 3.12, jax/jaxlib 0.11.2 with the CUDA 13 plugins, flax, optax, orbax-checkpoint,
# tensorboard, numpy, protobuf, PyYAML, sympy, etils, transformers, torch) has no network and lacks the
# packages below. They are downloaded here for CPython 3.12 on manylinux x86_64, binaries only, without
# dependencies: each package's own Requires-Dist is listed beside it, and a dependency is named here only
# when the machine lacks it. benchmarks/device_check.sh installs the folder with `pip install --no-index`.
# The folder must stay under 64 MiB: that is all a run may carry, the tree included.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-device_wheels}"
limit_mib=64

wheels=(
  ml-collections==1.1.0            # absl-py, PyYAML (both there)
  grain==0.2.18                    # array-record, cloudpickle, etils, numpy, portpicker, protobuf
  array-record==0.8.6              # absl-py, etils[epath]
  cloudpickle==3.1.3               # (none)
  portpicker==1.6.0                # psutil (there, with torch)
  tensorboardX==2.6.5              # numpy, packaging, protobuf
  math-verify==0.9.0               # latex2sympy2_extended==1.11.0
  latex2sympy2-extended==1.11.0    # sympy, antlr4-python3-runtime>=4.9.3,<=4.13.2
  antlr4-python3-runtime==4.13.2   # (none)
  pyzmq==27.3.0                    # (none on CPython)
)

rm -rf "$dir"
mkdir -p "$dir"
pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$dir" "${wheels[@]}"

count=$(find "$dir" -name '*.whl' | wc -l)
if [[ $count != "${#wheels[@]}" ]]; then
  echo "build_device_wheels.sh: expected ${#wheels[@]} wheels in $dir, found $count" >&2
  exit 1
fi
size=$(du -sm "$dir" | cut -f1)
tree=$(( ($(git ls-files -z | xargs -0 cat | wc -c) + 1048575) / 1048576 ))
echo "$dir: $count wheels, ${size} MiB (the tracked tree: ~${tree} MiB; a run carries at most ${limit_mib} MiB)"
if (( size + tree > limit_mib )); then
  echo "build_device_wheels.sh: $dir (${size} MiB) and the tree (${tree} MiB) exceed ${limit_mib} MiB" >&2
  exit 1
fi
