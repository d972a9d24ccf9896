#!/usr/bin/env bash
# NP ranks under MPI (mpi4py gives rank and size; rank 0 picks the rendezvous port):
#   launch/mpirun.sh 4 configs/mnist_dir0.1_fedcp.yaml [key=value ...]
# Extra mpirun flags go in MPIRUN_FLAGS, e.g. MPIRUN_FLAGS="--hostfile hosts".
# As root (containers), Open MPI needs --allow-run-as-root; on a laptop, --oversubscribe.
#
# A SIGTERM or SIGHUP to this script is passed to mpirun as SIGUSR2, which Open MPI forwards to the
# ranks: they finish their round, checkpoint and exit 75, the status this script then exits with.
# A SIGTERM to mpirun itself kills the ranks within a second (no checkpoint, exit 1).
set -euo pipefail
np=${1:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
config=${2:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
shift 2
flags=${MPIRUN_FLAGS:-}
if [ "$(id -u)" = 0 ]; then flags="--allow-run-as-root $flags"; fi
mpirun $flags -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" -n "$np" python -m fedcp_dist.run --config "$config" "$@" &
pid=$!
trap 'kill -USR2 "$pid" 2>/dev/null || true' TERM HUP
set +e
while :; do
    wait "$pid"; rc=$?  # returns early (> 128) when a trapped signal arrives; mpirun goes on
    kill -0 "$pid" 2>/dev/null || break
done
if [ "$rc" -gt 128 ]; then  # mpirun ended during the trap: its own status, which the shell keeps
    wait "$pid"; last=$?
    if [ "$last" != 127 ]; then rc=$last; fi
fi
exit "$rc"
