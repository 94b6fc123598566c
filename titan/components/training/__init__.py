"""The loss, the validation loop and the GC schedule of the training loop."""
