#!/bin/bash
# A Slurm batch job wrapped in gcwrap: its stdout and stderr stream home while it runs.
# Nothing is installed on the nodes: the job ships gcwrap as one file,
# gcwrap.pyz (`gcwrap bundle -o gcwrap.pyz` at home, beside this script), and
# the node's python3 (3.11 or newer) runs it. With gcwrap installed on the
# nodes, `exec gcwrap` with the same options does the same.
#
#   sbatch slurm-job.sh
#
# At home: gcshadow --host 0.0.0.0 --port 50000 --root ~/results --token-file ~/.gcshadow-token
# (~/.gcshadow-token is the shared secret, copied here too: see Quick start).
# The output lands in ~/results/sim/JOBID.out and sim/JOBID.err; the job is
# slurm-JOBID in `gcshadow jobs`. If Slurm requeues the job, the new attempt
# starts both files afresh; write 'sim/%j.%n.out' to keep each attempt's
# output in a file of its own (%n is $SLURM_RESTART_COUNT).
#SBATCH --job-name=sim
#SBATCH --time=02:00:00
#SBATCH --requeue
#SBATCH --output=gcwrap-%j.log

# sbcast copies the bundle to the local disk of the job's nodes.
sbcast --force gcwrap.pyz "/tmp/gcwrap-$SLURM_JOB_ID.pyz" || exit 1
# exec: gcwrap is the job step itself, so the job's exit status is Slurm's
# and Slurm counts the job as running until its output is home.
exec python3 "/tmp/gcwrap-$SLURM_JOB_ID.pyz" --shadow home.example.org:50000 --token-file ~/.gcshadow-token \
    --stdout 'sim/%j.out' --stderr 'sim/%j.err' \
    -- ./sim --steps 1000
