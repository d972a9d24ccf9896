#!/usr/bin/env bash
# One node, NPROC ranks (one per GPU, or CPU ranks with gloo):
#   launch/torchrun.sh 8 configs/mnist_dir0.1_fedcp.yaml [key=value ...]
set -euo pipefail
nproc=${1:?usage: launch/torchrun.sh NPROC CONFIG [key=value ...]}
config=${2:?usage: launch/torchrun.sh NPROC CONFIG [key=value ...]}
shift 2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc_per_node="$nproc" -m fedcp_dist.run --config "$config" "$@"
