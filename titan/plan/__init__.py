"""The resolved plan of a run (titan.plan.run_plan): the model, the layout, the batch and every
check that needs them, made once before launch and again by every rank. Below the launcher,
the planner, the tools and the trainer, which all import it."""
