"""Checkpoints: DCP folders, saving and loading, integrity, model identity, HF files."""
