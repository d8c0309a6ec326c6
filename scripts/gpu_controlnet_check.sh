#!/usr/bin/env bash
# GPU check for the frozen-models case (issue 17), for when a GPU machine is lent: about 5 minutes on one H200.
#   1. the CUDA tests: a float16 frozen model beside a float32 trainable one under torch.amp.GradScaler("cuda")
#      (never "Attempting to unscale FP16 gradients"), plus the CPU suite of layerfreeze.compute.frozen and the demo at CI size;
#   2. the ControlNet demo with the trainer on cuda:0 and the frozen models on cuda:1 (cuda:0 when there is one GPU),
#      full size (stage 1 trained on the GPU), every placement; the table goes to $OUT (or runs/) with the report.
# Usage: bash scripts/gpu_controlnet_check.sh            (from the repository root, after scripts/setup.sh)
CHECK="gpu check"
source "$(dirname "$0")/gpu_prelude.sh"
FROZEN=cuda:$(( NGPU > 1 ? 1 : 0 ))
echo "gpu check: $NGPU GPU(s); trainer on cuda:0, frozen models on $FROZEN"
$PY -m pytest -q -rs tests/test_frozen.py tests/test_controlnet.py
$PY -m benchmarks.controlnet --device cuda:0 --frozen-device "$FROZEN" --cache-dir "$OUT/controlnet-stage1-gpu" \
  --out "$OUT/controlnet-gpu" 2>&1 | tee "$OUT/controlnet-gpu.log"
