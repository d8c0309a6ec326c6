# Sourced by the GPU check scripts (scripts/gpu_*_check.sh): from the repository root, the project's Python ($PY,
# default .venv/bin/python) with src/ on its path, $OUT for results (default runs/), the GPUs listed and counted in
# $NGPU; exits 2 when no CUDA device is visible. $CHECK names the calling check in that message.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "${CHECK:-gpu check}: no CUDA device visible" >&2; exit 2; }
