"""Planning a run before it starts: per-rank memory, activations, layout search; CLI
`python -m titan.planner`."""
