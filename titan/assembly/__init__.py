"""A run assembled from its config and plan, below the trainer that loops over it: the model
parts and every component built (build), a microbatch's forward and backward under the layout
(microbatch), per-token scores on any layout (scoring), a step replayed (replay). The memory
planner and the tools build the same pieces from here without the trainer."""
