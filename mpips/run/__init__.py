"""The run wing: ``train`` (start-up, the mode's loop), the run's result, hooks, summaries,
the timeline, and evaluation and plots of a finished run."""
