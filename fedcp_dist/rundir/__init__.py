"""The run directory: its file names, the rank-0 writer, the out_dir lock and the overwrite and
resume rules (directory); what a checkpoint holds, and resuming from it (checkpoint); the
preemption signals and the status file (preemption); the loggers besides metrics.jsonl.
"""
