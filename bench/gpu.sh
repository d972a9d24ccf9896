#!/usr/bin/env bash
# The GPU check: one script for the GPU figures of docs/performance.md, a few minutes on one large GPU.
#
#     bash bench/gpu.sh                                   # figures under bench/gpu_out/ (JSON and text)
#     SHARD=data/x.h5 OUT=/tmp/gpu bash bench/gpu.sh
#
# 1. the MNIST round (20 clients, Dir(0.1), FedCP in the paper's setting, evaluation every round):
#    sequential and fused in one run (bench/round.py --compare), then fused with bf16 autocast;
#    seconds per round and max allocated memory per variant;
# 2. FedCP's cost per model (bench/models.py): the MNIST CNN and the Tiny-ImageNet-shaped ResNet-18;
# 3. the fused step's kernels on the GPU (bench/kernels.py --device cuda --compile): torch.compile of
#    the grouped Linear layer, and all of a step's kernels replayed as one CUDA graph.
#
# SHARD: the MNIST partition (default data/bench_mnist_dir0.1_n20.h5, which bench/round.py makes from
# the raw MNIST files under MNIST_ROOT when it is missing). DEVICE=cpu runs the same steps on the CPU
# (with CONFIG, SLOTS and SAMPLES small, a quick check of the script itself).
#
# This script measures; the GPU path's correctness is checked by tests/test_cuda.py (NCCL on 2 ranks
# against 1 rank, bf16 autocast, a SIGKILLed rank on NCCL, fused groups sized on the GPU against the
# sequential path), a few minutes on the digits shard and skipped where no CUDA device is visible
# (the NCCL tests need 2 GPUs):
#
#     python -m pytest tests/test_cuda.py -q -rs        # on a GPU node; -rs lists what was skipped and why
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench/gpu_out}
SHARD=${SHARD:-data/bench_mnist_dir0.1_n20.h5}
CONFIG=${CONFIG:-configs/mnist_dir0.1_fedcp.yaml}
MNIST_ROOT=${MNIST_ROOT:-../shared/data/mnist}
DEVICE=${DEVICE:-cuda}
SLOTS=${SLOTS:-64}
SAMPLES=${SAMPLES:-2000}
mkdir -p "$OUT"
if [ ! -f "$SHARD" ] && ! ls "$MNIST_ROOT"/*-ubyte.gz >/dev/null 2>&1; then
    echo "bench/gpu.sh: no shard $SHARD and no MNIST files (*-ubyte.gz) in $MNIST_ROOT; set SHARD=FILE (a partition made by fedcp-partition) or MNIST_ROOT=DIR (the gzipped IDX files)" >&2
    exit 2
fi

if [ "$DEVICE" = cuda ]; then
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device is visible')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt" || true
fi

step() {  # step NAME COMMAND...: the command's output goes to the screen and to OUT/NAME.txt
    local name=$1
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.txt"
}

round=("$PY" bench/round.py --shard "$SHARD" --mnist-root "$MNIST_ROOT" --config "$CONFIG" --warmup 1)
step round_compare "${round[@]}" --compare --json "$OUT/round_compare.json" "device=$DEVICE" rounds=2
step round_fused_bf16 "${round[@]}" --fused --json "$OUT/round_fused_bf16.json" "device=$DEVICE" rounds=2 amp=bf16
step models "$PY" bench/models.py --device "$DEVICE" --threads 0 --samples "$SAMPLES" \
    --settings mnist_cnn,tinyimagenet_resnet18 --json "$OUT/models.json"
step kernels "$PY" bench/kernels.py --device "$DEVICE" --slots "$SLOTS" --compile --json "$OUT/kernels.json"
echo "bench/gpu.sh: done; figures in $OUT/"
