#!/usr/bin/env bash
# NP ranks under MPI (mpi4py gives rank and size; rank 0 picks the rendezvous port):
#   launch/mpirun.sh 4 configs/mnist_dir0.1_fedcp.yaml [key=value ...]
# Extra mpirun flags go in MPIRUN_FLAGS, e.g. MPIRUN_FLAGS="--hostfile hosts".
# As root (containers), Open MPI needs --allow-run-as-root; on a laptop, --oversubscribe.
set -euo pipefail
np=${1:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
config=${2:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
shift 2
flags=${MPIRUN_FLAGS:-}
if [ "$(id -u)" = 0 ]; then flags="--allow-run-as-root $flags"; fi
exec mpirun $flags -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" -n "$np" python -m fedcp_dist.run --config "$config" "$@"
