"""A parameter's name as checkpoints, optimizers' groups and seeded initialization know it:
without the wrappers torch.compile (`_orig_mod`), activation checkpointing
(`_checkpoint_wrapped_module`) and FSDP1 (`_fsdp_wrapped_module`) put between a model and
its blocks."""

import re

_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.|$)")


def canonical_name(name: str) -> str:
    return _WRAPPERS.sub("", name).lstrip(".")
