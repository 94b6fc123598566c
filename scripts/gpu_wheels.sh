#!/usr/bin/env bash
# Download, here (a machine with a package registry), every wheel the lent GPU machine lacks
# for titan, its float8 path and the torchtitan peer of benchmarks/gpu_suite.py. That machine
# has Python 3.12 (x86_64) with torch 2.11 + CUDA, triton, tokenizers, safetensors, tensorboard,
# huggingface-hub, numpy, pyarrow, pandas, fsspec, requests, einops, pillow and pytest, and no
# network. The wheels land in .whl/ (git-ignored), which the device tool carries; each command
# there starts with the install line this script prints. titan itself needs no install: the
# carried repo goes on PYTHONPATH.
#   bash scripts/gpu_wheels.sh      # refresh .whl/ (wheels of other versions are removed)
#   TORCHTITAN_VERSION=0.3.0 EXTRA="name==version ..." bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# pinned: the datasets/torchdata/torchao versions titan is developed and tested with here;
# torchao 0.17+ is ABI-stable from torch 2.11 on, so 0.18 loads on the GPU machine's 2.11
TITAN=(
    datasets==5.2.0        # needs huggingface-hub>=1.31 (1.33 there), pyarrow>=24 (there; its
                           # version is unrecorded: gpu_suite.py checks the import first), and:
    dill==0.4.1
    multiprocess==0.70.19
    torchdata==0.11.0
    torchao==0.18.0        # model.converters = ["float8"]
)
# the torchtitan peer and what it imports that the machine lacks. 0.2.2 by default: 0.3.0
# needs a torch newer than 2.13 (it imports torch.distributed.fsdp.DataParallelMeshDims, not in
# 2.11, and calls torch.distributed.set_timeout, in neither 2.11 nor 2.13), so it cannot run on
# the GPU machine's 2.11. TORCHTITAN_VERSION=0.3.0 for a machine with a newer torch.
# Their datasets pins are not enforced (installs are --no-deps; both load the suite's corpus
# with datasets 5.2); wandb is imported only with metrics.enable_wandb, which stays off.
TORCHTITAN_VERSION=${TORCHTITAN_VERSION:-0.2.2}
TORCHTITAN=(torchtitan=="$TORCHTITAN_VERSION" tyro==1.0.17 docstring-parser==0.18.0
            typeguard==4.6.0)
if [[ "$TORCHTITAN_VERSION" == 0.3.* ]]; then
    TORCHTITAN+=(torch_checkpointing==0.1.1 spmd_types==0.2.3)
fi
# anything else, space-separated pins, e.g. EXTRA="pyarrow==26.0.1" (52 MiB: too big to carry
# with the rest) if the machine's pyarrow is older than datasets 5.2 needs (>= 24)
read -r -a EXTRA_PINS <<< "${EXTRA:-}"
LIMIT_MIB=56  # the device tool carries 64 MiB in all; the repo itself is ~5 MiB

PIP_PLATFORM=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
              --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
for pin in "${TITAN[@]}" "${TORCHTITAN[@]}" "${EXTRA_PINS[@]}"; do
    python3 -m pip download -q "${PIP_PLATFORM[@]}" -d "$fresh" "$pin"
done
# one version of each package: a second copy would stop the whole install there
mkdir -p .whl
rm -f .whl/*.whl
mv "$fresh"/*.whl .whl/

total_kib=$(du -ck .whl/*.whl | tail -1 | cut -f1)
ls -s --block-size=K -1 .whl/*.whl | sed 's/^/  /'
echo "total $(( total_kib / 1024 )) MiB in $(ls .whl/*.whl | wc -l) wheels (limit ${LIMIT_MIB} MiB)"
if (( total_kib > LIMIT_MIB * 1024 )); then
    echo "gpu_wheels: .whl/ exceeds ${LIMIT_MIB} MiB; the device tool could not carry it" >&2
    exit 1
fi
cat <<'EOF'

On the GPU machine (device tool: carry [".whl"]), start each command with:
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
then, e.g.:  python3 benchmarks/gpu_suite.py --out $OUT/gpu_suite.json
EOF
