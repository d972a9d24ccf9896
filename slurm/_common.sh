# shellcheck shell=bash
# Sourced by train.sbatch and sweep.sbatch inside a SLURM batch job: one job step with one task
# per rank, then the requeue-on-75 rule.
#
#   fedcp_launch ARGS...   srun the run (python -m fedcp_dist.run ARGS...) over the allocation:
#                          one task per GPU on every node when the job has GPUs, else the job's
#                          tasks (1 by default). Each rank reads SLURM_PROCID etc. itself. A
#                          requeued attempt resumes from the checkpoint whatever the config file
#                          says: ARGS' overwrite=... and resume=... are dropped (a key given twice
#                          is refused) and overwrite=false resume=auto appended (the command line
#                          wins over the file; overwrite: true there cleared the checkpoint on
#                          every attempt, and resume: never failed the job).
#   fedcp_finish STATUS    75 ("preempted, checkpointed, please requeue"): `scontrol requeue` this
#                          job (or array task) and exit 0; anything else: exit STATUS. Not after
#                          two attempts in a row that were stopped before they trained a round
#                          (the warning signal comes before start-up ends: a requeue would only
#                          repeat it), nor after a scancel or the job's time limit (SIGTERM to
#                          this shell).
#
# The batch shell itself takes the preempt signal (SIGUSR2) and SIGTERM: `scancel --full
# --signal=USR2`, `--signal=B:USR2@120` and scancel signal it too, which ended it (the job FAILED,
# not requeued, its status file left behind). It passes SIGUSR2 on to the job step (srun forwards it
# to every rank) and waits for the step; a SIGTERM is passed on the same way and ends the job
# without a requeue once the ranks have stopped. An attempt whose out_dir holds the finished run
# (an array submitted again to resume its cancelled points) exits 0 (FEDCP_FINISHED_OK=1).
#
# FEDCP_RUN_CMD replaces `python -m fedcp_dist.run` (word-split), e.g. to wrap the run with a
# profiler: FEDCP_RUN_CMD="nsys profile -o prof-%q{SLURM_PROCID} python -m fedcp_dist.run".
# FEDCP_SRUN_FLAGS adds flags to the srun line (word-split).

fedcp_launch() {
    local -a run srun_flags
    read -r -a run <<<"${FEDCP_RUN_CMD:-python -m fedcp_dist.run}"
    read -r -a srun_flags <<<"${FEDCP_SRUN_FLAGS:-}"
    local nodes=${SLURM_JOB_NUM_NODES:-1} gpus=${SLURM_GPUS_ON_NODE:-0}
    if [ "$gpus" -gt 0 ] 2>/dev/null; then
        srun_flags=(--nodes="$nodes" --ntasks-per-node="$gpus" --ntasks=$(( nodes * gpus )) "${srun_flags[@]}")
    fi
    # srun of Slurm 22.05 does not inherit --cpus-per-task from the job
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
    # overwrite=true clears out_dir, checkpoints included, and resume=never refuses a checkpointed
    # run: a requeued attempt must resume instead, whether they come from ARGS or the config file
    local a
    if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
        local -a kept=()
        for a in "$@"; do
            case $a in overwrite=*|resume=*) ;; *) kept+=("$a") ;; esac
        done
        set -- "${kept[@]}" overwrite=false resume=auto
    fi
    local shown
    printf -v shown ' %q' "${run[@]}" "$@"
    echo "fedcp: job ${SLURM_JOB_ID:-?} attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on ${SLURM_JOB_NODELIST:-?}" \
         "(${nodes} node(s), ${gpus} GPU(s) per node):$shown"
    # srun returns the highest exit status of its tasks: 75 when every rank checkpointed and stopped.
    # But --kill-on-bad-exit counts 75 as bad too: the first rank out after the checkpoint gets the
    # others killed while they are still closing (srun then returns 143). Rank 0 writes `preempted`
    # to FEDCP_STATUS_FILE only once the checkpoint is complete, so that file says 75 whatever srun says.
    # A rank that refuses the run (exit 2: its config, its shard) appends its rank to STATUS.refused:
    # the others, stopped by --kill-on-bad-exit, may exit 75 (srun then returns 75), and a requeue
    # would only repeat the refusal, attempt after attempt.
    local status_file="${SLURM_SUBMIT_DIR:-.}/.fedcp-status-${SLURM_JOB_ID:-0}-${SLURM_RESTART_COUNT:-0}"
    # earlier attempts' files (a requeue or scancel ends the batch shell before it removes them)
    rm -f "${SLURM_SUBMIT_DIR:-.}/.fedcp-status-${SLURM_JOB_ID:-0}-"*
    # shellcheck disable=SC2064  # expanded now: status_file is this function's
    trap "rm -f $(printf '%q %q' "$status_file" "$status_file.refused")" EXIT
    local rc=0 pid
    FEDCP_TERMINATED=0
    if [ "${FEDCP_USR2:-0}" = 1 ]; then  # the preempt signal came before the step started (the script's first moments)
        echo "fedcp: SIGUSR2 before the job step started: nothing ran in this attempt"
        echo stopped-at-start >"$status_file"
        rc=75
    else
        # in the background, so that this shell takes its signals while the step runs (a trap waits for
        # a foreground command to end); each is passed on to srun, which forwards it to the ranks
        FEDCP_STATUS_FILE=$status_file FEDCP_FINISHED_OK=1 srun --kill-on-bad-exit=1 "${srun_flags[@]}" "${run[@]}" "$@" &
        pid=$!
        # shellcheck disable=SC2064  # expanded now: pid is this function's
        trap "FEDCP_TRAPPED=1; FEDCP_USR2=1; kill -USR2 $pid 2>/dev/null || true" USR2
        # shellcheck disable=SC2064
        trap "FEDCP_TRAPPED=1; FEDCP_TERMINATED=1; kill -TERM $pid 2>/dev/null || true" TERM
        while :; do
            FEDCP_TRAPPED=0
            rc=0
            wait "$pid" || rc=$?
            # a trapped signal ends the wait, not the step: wait again (for the step's own status, if it
            # ended meanwhile)
            [ "$FEDCP_TRAPPED" = 1 ] || break
        done
        trap 'FEDCP_USR2=1' USR2
        trap - TERM
    fi
    local said refused
    said=$(cat "$status_file" 2>/dev/null || true)
    refused=$( { tr '\n' ' ' <"$status_file.refused"; } 2>/dev/null || true)
    if [ -n "$refused" ] && [ "$said" != finished ]; then
        echo "fedcp: srun ended with status $rc after rank(s) ${refused% } refused the run (exit 2, their lines are above): not requeued"
        rc=2
    elif [ "$rc" != 0 ] && [ "$rc" != 75 ] && { [ "$said" = preempted ] || [ "$said" = stopped-at-start ]; }; then
        # --kill-on-bad-exit counts 75 as bad: the ranks still closing (or still starting) are killed
        echo "fedcp: srun ended with status $rc after rank 0 stopped for a requeue ($said): treated as 75"
        rc=75
    elif [ "$rc" != 0 ] && [ "$said" = finished ]; then
        # a signal between the final files and the ranks' exit: a requeue would find a finished run
        echo "fedcp: srun ended with status $rc after rank 0 wrote the run's final files: treated as 0"
        rc=0
    elif [ -z "$said" ] && [ "${FEDCP_USR2:-0}" = 1 ] && [ "$rc" != 0 ]; then
        # the preempt signal reached the ranks before they listened (their first tenth of a second), or
        # rank 0 before it could say so: nothing was trained in this attempt
        echo "fedcp: srun ended with status $rc after a SIGUSR2 that came as the ranks started: nothing ran; treated as 75"
        said=stopped-at-start
        rc=75
    elif [ "$rc" = 75 ] && [ -z "$said" ]; then
        # rank 0 says when it stops for a requeue; a 75 without its word is the other ranks' answer to
        # srun's SIGTERM after a rank failed (exit 1 at start-up, say): a requeue would fail the same way
        echo "fedcp: srun ended with status 75, but rank 0 did not stop for a requeue (a rank failed; its lines are above): not requeued"
        rc=1
    fi
    rm -f "$status_file" "$status_file.refused"
    # attempts in a row stopped before they trained a round: counted beside the status files
    local nothing="${SLURM_SUBMIT_DIR:-.}/.fedcp-untrained-${SLURM_JOB_ID:-0}"
    if [ "$rc" = 75 ] && [ "$said" = stopped-at-start ]; then
        echo $(( $(cat "$nothing" 2>/dev/null || echo 0) + 1 )) >"$nothing"
    else
        rm -f "$nothing"
    fi
    if [ "$FEDCP_TERMINATED" = 1 ] && [ "$rc" = 75 ]; then
        echo "fedcp: SIGTERM to the job (scancel, its time limit, or a requeue by SLURM itself) while the ranks ran: they stopped (exit 75); this script does not requeue it"
        rm -f "$nothing"
        rc=143
    fi
    return "$rc"
}

fedcp_finish() {
    local status=$1 id state
    if [ "$status" != 75 ]; then
        exit "$status"
    fi
    if [ -n "${SLURM_ARRAY_JOB_ID:-}" ] && [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
        id=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
    else
        id=${SLURM_JOB_ID:?not inside a SLURM job}
    fi
    # a run stopped by scancel also checkpoints and exits 75: leave a cancelled job cancelled
    state=$(scontrol show job -o "$id" 2>/dev/null | sed -n 's/.* JobState=\([A-Z_]*\).*/\1/p' || true)
    if [ "$state" = CANCELLED ]; then
        echo "fedcp: checkpointed (exit 75); the job was cancelled, so it is not requeued"
        exit 75
    fi
    local nothing="${SLURM_SUBMIT_DIR:-.}/.fedcp-untrained-${SLURM_JOB_ID:-0}" times
    times=$(cat "$nothing" 2>/dev/null || echo 0)
    if [ "$times" -ge 2 ]; then
        rm -f "$nothing"
        echo "fedcp: stopped before it trained a round on $times attempts in a row (each time the signal came during" \
             "start-up): not requeued, as the next attempt would likely repeat it. If the signal is the time" \
             "limit's warning, give the job more time than its start-up takes beyond it (--time, --signal=USR2@N);" \
             "if it is a preemption, resubmit later. Either way it resumes from its last checkpoint"
        exit 75
    fi
    if [ "$times" -ge 1 ]; then
        echo "fedcp: stopped before it trained a round (nothing new to checkpoint); requeueing job $id"
    else
        echo "fedcp: checkpointed (exit 75); requeueing job $id"
    fi
    if scontrol requeue "$id"; then
        exit 0  # slurmctld usually ends this attempt before we get here
    fi
    echo "fedcp: scontrol requeue $id failed; resubmit to resume from the checkpoint" >&2
    exit 75
}
