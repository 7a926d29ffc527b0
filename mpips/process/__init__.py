"""The process wing: how one rank lives and dies. Failure (an error anywhere ends the job,
naming the rank), preemption and signals, the one way to wait, task-named logging, memory
limits, durable file writes and the environment (every ``MPIPS_*`` variable)."""
