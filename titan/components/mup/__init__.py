"""muP, the maximal update parametrization: hyper-parameters tuned at a base width transfer to
wider models (docs/mup.md)."""
