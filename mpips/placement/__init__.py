"""The placement wing: ranks to roles (layout), variables to PS tasks (the table), and the
job's strategy that builds both before training starts (plan)."""
