"""The round and its start-up: the round loop (simulator), a run's start-up in order (run_start,
startup), a rank's local training of the cohort (training), personalized evaluation
(evaluation), the probes' rows in the round's all-reduce (probes), and what a round and a run
report (round_record).
"""
