"""Metrics, FLOPs/MFU, measured memory and profiler traces."""
