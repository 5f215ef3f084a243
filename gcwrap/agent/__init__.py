"""gcwrap, the agent on the execute machine: runs the job, spools its output
durably and streams it to the shadow."""
