#!/usr/bin/env bash
# NP ranks under MPI (mpi4py gives rank and size; rank 0 picks the rendezvous port):
#   launch/mpirun.sh 4 configs/mnist_dir0.1_fedcp.yaml [key=value ...]
# Extra mpirun flags go in MPIRUN_FLAGS, e.g. MPIRUN_FLAGS="--hostfile hosts".
# As root (containers), Open MPI needs --allow-run-as-root; on a laptop, --oversubscribe.
#
# A SIGTERM, SIGHUP or SIGUSR2 to this script is passed to mpirun as SIGUSR2, which Open MPI forwards
# to the ranks: they finish their round, checkpoint and exit 75, the status this script then exits
# with. A SIGINT is passed on as such (mpirun ends the ranks, as on a Ctrl-C).
# A SIGTERM to mpirun itself kills the ranks within a second (no checkpoint, exit 1).
set -euo pipefail
np=${1:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
config=${2:?usage: launch/mpirun.sh NP CONFIG [key=value ...]}
shift 2
flags=${MPIRUN_FLAGS:-}
if [ "$(id -u)" = 0 ]; then flags="--allow-run-as-root $flags"; fi
# mpirun runs in the background so that this shell can take the signals; an asynchronous command
# of a script starts with SIGINT and SIGQUIT ignored, which mpirun is given back. A SIGUSR2 or a
# SIGINT to this script reaches mpirun as it did when the script exec'd it (a checkpoint and 75;
# the ranks ended), not the shell's default action that left mpirun and its ranks running on.
( trap - INT QUIT; exec mpirun $flags -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" -n "$np" python -m fedcp_dist.run \
    --config "$config" "$@" ) &
pid=$!
trap 'kill -USR2 "$pid" 2>/dev/null || true' TERM HUP USR2
trap 'kill -INT "$pid" 2>/dev/null || true' INT
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
