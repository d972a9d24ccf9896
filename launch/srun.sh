#!/usr/bin/env bash
# Inside a SLURM allocation: one task per GPU on every node of the allocation.
#   salloc -N 2 --gpus-per-node=8 --ntasks-per-node=8 launch/srun.sh configs/mnist_dir0.1_fedcp.yaml
# Ranks come from SLURM_PROCID; the master is the first node, the port derives from the job id.
set -euo pipefail
config=${1:?usage: launch/srun.sh CONFIG [key=value ...]}
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec srun --kill-on-bad-exit=1 python -m fedcp_dist.run --config "$config" "$@"
