#!/usr/bin/env bash
# GPU check of the memory ledger (issue 31), for when a GPU machine is lent: about 15 minutes on one H200.
#   1. the ledger's tests, the CUDA one included: bytes per device (the model on cuda:0, a frozen side model on cuda:1,
#      or cuda:0 with one GPU) against bytes computed by hand, beside the allocator's allocated / reserved / peaks;
#   2. the memory table (python -m benchmarks.memory_table) on cuda:0: none, static and smartfrz on the suite's
#      MobileNetV2 / Fashion-MNIST and on the default job, each bucket's peak, the tensor peak, and
#      torch.cuda.max_memory_allocated per device beside them; results in $OUT/memory-gpu (memory.md, results.json);
#   3. the ledger's cost on the GPU (python -m benchmarks.ledger_overhead --device is not needed: the task's device is
#      run.device=auto, cuda when there is one);
#   4. with two or more GPUs, the ControlNet demo (python -m benchmarks.controlnet, issue 31 item 5) with the trainer
#      on cuda:0 and the frozen VAE, text encoder and UNet on cuda:1, 50 steps per placement (stage 1 trained on the
#      GPU and cached in $OUT/controlnet-stage1-gpu): the memory ledger per placement and device (the ControlNet's
#      parameters, gradients, optimizer state, saved activations, the frozen models' bytes, the precomputed store)
#      beside torch.cuda.max_memory_allocated of each device; results in $OUT/controlnet-ledger-gpu (table.md,
#      results.json). With one GPU it is skipped with a message (scripts/gpu_controlnet_check.sh runs the demo there).
# Usage: bash scripts/gpu_ledger_check.sh            (from the repository root, after scripts/setup.sh)
CHECK="gpu ledger check"
source "$(dirname "$0")/gpu_prelude.sh"
mkdir -p "$OUT"
$PY -m pytest -q -rs tests/test_ledger.py
$PY -m benchmarks.memory_table --tasks fmnist,default-job --device cuda:0 --out "$OUT/memory-gpu" 2>&1 \
  | tee "$OUT/memory-gpu.log"
$PY -m benchmarks.ledger_overhead --out "$OUT/ledger-overhead-gpu" 2>&1 | tee "$OUT/ledger-overhead-gpu.log"
if [ "$NGPU" -ge 2 ]; then
  $PY -m benchmarks.controlnet --device cuda:0 --frozen-device cuda:1 --steps 50 \
    --cache-dir "$OUT/controlnet-stage1-gpu" --out "$OUT/controlnet-ledger-gpu" 2>&1 | tee "$OUT/controlnet-ledger-gpu.log"
else
  echo "gpu ledger check: SKIPPED the ControlNet demo with the frozen models on a second device: $NGPU CUDA device" \
    "visible, it needs 2 (trainer on cuda:0, frozen models on cuda:1)" | tee "$OUT/controlnet-ledger-gpu.skipped"
fi
