#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/timeslice-task-prolog.sh): runs as the
# job's user before each task, and Slurm adds the `export NAME=value` lines it prints to the
# task's environment: TIMESLICE_TARGET and TIMESLICE_AGENT_SOCKET from /etc/timeslice/jobs.env,
# TIMESLICE_NODE_NAME=$SLURMD_NODENAME, and TIMESLICE_GROUP (the job's own if it set one,
# else its node's group). The job id needs nothing: the client reads SLURM_JOB_ID.
# A failure here never stops the task: it says why in the job's output instead.
TIMESLICE_BIN="${TIMESLICE_BIN:-/opt/timeslice/bin/timeslice}"
[ -x "$TIMESLICE_BIN" ] || TIMESLICE_BIN=timeslice
"$TIMESLICE_BIN" slurm task-env 2>/dev/null \
    || echo "print timeslice task prolog: \`$TIMESLICE_BIN slurm task-env\` failed; TIMESLICE_* not set"
exit 0
