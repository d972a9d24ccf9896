#!/usr/bin/env bash
# The GPU check: everything a GPU sitting must decide, in one script, in under 8 minutes on one GPU.
#
#     bash bench/gpu.sh                                   # logs and JSON under bench/gpu_out/
#     SHARD=data/x.h5 OUT=/tmp/gpu bash bench/gpu.sh
#
# 1. the GPU, its driver, torch, CUDA and NCCL versions and its bf16 units;
# 2. tests/test_cuda.py: in float64 the fused step equals the sequential one; a client's float32
#    bits whatever the number of slots beside it (what fused_join=auto rests on); 2 ranks sharing
#    one GPU (gloo) bit-identical to 1 rank; a run repeated bit for bit; bf16 autocast learns;
#    fused vs sequential float32 runs; with 2 or more GPUs NCCL on 2 ranks and a dead rank;
# 3. the MNIST round (20 clients, Dir(0.1), FedCP in the paper's setting, evaluation every round):
#    sequential vs fused in one run, then fused float32 vs fused amp=bf16 in one run; seconds per
#    round, the FLOP floors at the float32 and bf16 peaks, peak memory (max allocated) per variant;
# 4. one summary table (also OUT/summary.txt).
#
# SHARD: the MNIST partition (default data/bench_mnist_dir0.1_n20.h5, which bench/round.py makes from
# the gzipped MNIST files under MNIST_ROOT when it is missing). Each step has a time limit (LIMIT_*
# seconds) and the script goes on after a failed step; its exit status is 1 if any step failed.
# DEVICE=cpu runs the rounds on the CPU instead (a check of the script itself; the CUDA tests skip).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-bench/gpu_out}
SHARD=${SHARD:-data/bench_mnist_dir0.1_n20.h5}
CONFIG=${CONFIG:-configs/mnist_dir0.1_fedcp.yaml}
MNIST_ROOT=${MNIST_ROOT:-../shared/data/mnist}
DEVICE=${DEVICE:-cuda}
ROUNDS=${ROUNDS:-1}
LIMIT_TESTS=${LIMIT_TESTS:-240}
LIMIT_COMPARE=${LIMIT_COMPARE:-150}
LIMIT_AMP=${LIMIT_AMP:-80}
mkdir -p "$OUT"
if [ ! -f "$SHARD" ] && ! ls "$MNIST_ROOT"/*-ubyte.gz >/dev/null 2>&1; then
    echo "bench/gpu.sh: no shard $SHARD and no MNIST files (*-ubyte.gz) in $MNIST_ROOT; set SHARD=FILE (a partition made by fedcp-partition) or MNIST_ROOT=DIR (the gzipped IDX files)" >&2
    exit 2
fi
if [ "$DEVICE" = cuda ]; then
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device is visible (DEVICE=cpu checks the script on the CPU)')" || exit 2
fi
T0=$(date +%s)
failed=()
step() {  # step NAME LIMIT COMMAND...: output to the screen and to OUT/NAME.txt, within LIMIT seconds
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(( $(date +%s) - T0 )) s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { failed+=("$name (exit $rc$([ "$rc" = 124 ] && echo ", over its ${limit} s"))"); echo "== $name failed: exit $rc"; }
}

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/gpu.txt"
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
          f"{torch.cuda.device_count()} visible, NCCL {nccl}")
PYEOF
[ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt" || true; }

step cuda_tests "$LIMIT_TESTS" "$PY" -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider
round=("$PY" bench/round.py --shard "$SHARD" --mnist-root "$MNIST_ROOT" --config "$CONFIG" --warmup 1)
step round_compare "$LIMIT_COMPARE" "${round[@]}" --compare --json "$OUT/round_compare.json" "device=$DEVICE" "rounds=$ROUNDS"
step round_amp "$LIMIT_AMP" "${round[@]}" --compare-amp --json "$OUT/round_amp.json" "device=$DEVICE" "rounds=$ROUNDS"

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
tests = (out / "cuda_tests.txt").read_text() if (out / "cuda_tests.txt").exists() else ""
m = re.findall(r"(\d+) (passed|failed|skipped|error)", tests)
rows.append(("CUDA tests", ", ".join(f"{n} {w}" for n, w in m) or "did not finish"))
for name in re.findall(r"^FAILED (\S+)", tests, re.M):
    rows.append(("  failed", name))
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
cmp_, amp = load("round_compare.json"), load("round_amp.json")
for label, res in ((("sequential", cmp_ and cmp_["sequential"]), ("fused", cmp_ and cmp_["fused"]),
                    ("fused, amp=bf16", amp and amp["bf16"]))):
    if res:
        rows.append((f"MNIST round, {label}", f"{res['seconds_per_round']:.2f} s (training {res['train_seconds']:.2f} s), "
                     f"{res['round_over_floor']:.0f}x the float32 floor, {res['round_over_floor_bf16']:.0f}x the bf16 floor, "
                     f"peak {max(res['peak_memory_mib_per_rank']):.0f} MiB"))
    else:
        rows.append((f"MNIST round, {label}", "did not finish"))
if cmp_:
    rows.append(("fused / sequential", f"{cmp_['comparison']['round_speedup']:.2f}x a round"))
if amp:
    rows.append(("amp=bf16 / float32", f"{amp['comparison']['round_speedup']:.2f}x a round ({amp['bf16']['bf16_units']}; "
                 f"bf16 peak {amp['comparison']['bf16_peak_over_float32_peak'][0]:.2f}x float32)"))
w = max(len(k) for k, _ in rows)
print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
PYEOF
echo "bench/gpu.sh: $(( $(date +%s) - T0 )) s; figures in $OUT/"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'bench/gpu.sh: failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
