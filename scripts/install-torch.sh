#!/usr/bin/env bash
# Installs torch into the environment of PYTHON unless it already imports one (a CUDA build on
# a GPU host stays). The CPU build comes from a local wheel that pip's --find-links (config or
# PIP_FIND_LINKS) offers, else from PyTorch's CPU index; TORCH_SPEC and TORCH_INDEX_URL
# choose another build (docker/Dockerfile's CUDA variant: TORCH_INDEX_URL=https://pypi.org/simple).
#   bash scripts/install-torch.sh PYTHON
set -euo pipefail
py=${1:?usage: install-torch.sh PYTHON}
spec=${TORCH_SPEC:-torch==2.13.0}
index=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
if "$py" -c "import torch" >/dev/null 2>&1; then
  exit 0
fi
echo "install-torch: $spec"
if [ "$index" = "https://download.pytorch.org/whl/cpu" ] &&
  "$py" -m pip install -q --no-index --no-deps "$spec" >/dev/null 2>&1; then
  # A local wheel: its own dependencies (sympy, networkx, ...) from the usual index.
  "$py" -m pip install -q "$spec"
else
  "$py" -m pip install -q "$spec" --index-url "$index" --extra-index-url https://pypi.org/simple
fi
