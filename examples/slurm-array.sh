#!/bin/bash
# A Slurm array job: 100 tasks, each streaming home under its own name.
#
#   sbatch slurm-array.sh
#
# Task 7 of array job 4242 writes sweep/4242/7.out and sweep/4242/7.err under
# the shadow's root (%j is the array's job id, %a the task); it is
# slurm-4242_7 in `gcshadow jobs`.
#SBATCH --job-name=sweep
#SBATCH --array=0-99
#SBATCH --time=00:30:00
#SBATCH --output=gcwrap-%A_%a.log

exec gcwrap --shadow home.example.org:50000 --token-file ~/.gcshadow-token \
    --stdout 'sweep/%j/%a.out' --stderr 'sweep/%j/%a.err' \
    -- python3 sweep.py --point "$SLURM_ARRAY_TASK_ID"
