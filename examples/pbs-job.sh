#!/bin/bash
# A PBS/Torque array job wrapped in gcwrap: ten tasks, each streaming home
# under its own name. Nothing is installed on the nodes: gcwrap.pyz, the
# one-file gcwrap (`gcwrap bundle -o gcwrap.pyz` at home), lies beside this
# script and the node's python3 (3.11 or newer) runs it. With gcwrap
# installed on the nodes, `exec gcwrap` with the same options does the same.
#
#   qsub pbs-job.sh
#
# Task 3 of job 1234[].server writes sim/1234.3.out and sim/1234.3.err (%j is
# the job number, %a the array index: $PBS_ARRAYID under Torque,
# $PBS_ARRAY_INDEX under PBS Pro, which takes `#PBS -J 0-9` instead of -t).
#PBS -N sim
#PBS -l walltime=02:00:00
#PBS -t 0-9

cd "$PBS_O_WORKDIR" || exit 1
exec python3 gcwrap.pyz --shadow home.example.org:50000 --token-file ~/.gcshadow-token \
    --stdout 'sim/%j.%a.out' --stderr 'sim/%j.%a.err' \
    -- ./sim --point "${PBS_ARRAYID:-${PBS_ARRAY_INDEX:-0}}"
