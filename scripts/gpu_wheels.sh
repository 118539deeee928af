#!/usr/bin/env bash
# Downloads the pure-Python wheels the GPU tier needs beyond what the GPU machines carry.
#
# The GPU machines have torch 2.11, torchvision, accelerate, lightning, pytest, pyyaml,
# matplotlib and transformers, but no torchao, no jsonargparse and no package registry.
# Run this on a machine that reaches PyPI, from the checkout:
#
#     scripts/gpu_wheels.sh            # -> .gpu-wheels/*.whl (gitignored)
#
# then bring the checkout *with* .gpu-wheels/ to the GPU machine (rsync/scp the directory,
# or the device runner's `carry: [".gpu-wheels"]`) and run scripts/gpu_tier.sh there.
#
# Versions are the ones this project tests with torch 2.11 (torchao 0.18.0 supports
# 2.11). The wheels are for CPython $PY_VERSION (default 3.12) on x86_64 Linux; override
# with PY_VERSION=3.11 etc. Only wheels, never sdists, and no dependency resolution:
# the list below is complete for a machine that already has the packages named above
# (jsonargparse needs PyYAML, typeshed-client needs typing-extensions: both come with
# torch / lightning there).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
PY="${PYTHON:-python3}"
PY_VERSION="${PY_VERSION:-3.12}"
ABI="cp${PY_VERSION/./}"

PACKAGES=(
    "torchao==0.18.0"            # Float8 training (tests, bench --float8)
    "jsonargparse==4.53.0"       # LightningCLI configs (aotdist imports it where used)
    "docstring-parser==0.18.0"   # jsonargparse[signatures]
    "typeshed-client==2.14.0"    # jsonargparse[signatures]
    "pytest-timeout==2.4.0"      # pyproject's `timeout = 600` for every test
)

mkdir -p "$DEST"
"$PY" -m pip download --no-deps --only-binary=:all: \
    --implementation cp --python-version "$PY_VERSION" --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    --dest "$DEST" "${PACKAGES[@]}"

echo "wheels in $DEST:"
ls -1 "$DEST"
