"""A tied weight (the embedding that is also the output projection) is saved once, under its
owner's name, whatever the layout.

In one module the two names are one parameter; a pipeline splits them into an owner on the
first stage and a copy on the last, kept equal bit for bit (`parallelisms.tied_weights`).
Saved as is, a checkpoint held the matrix twice, and under pipelining its optimizer moments
twice too: for Llama 3.2 1B in float32, about 1 GiB of weights and 2 GiB of moments more. Here a
copy's entries are dropped where the rank holds the owner too, and stored under the owner's
name where it does not (DCP then writes the identical shards once). Loading fills a copy
from its owner's entry, so a checkpoint of any layout loads into any other, and older
checkpoints, which also hold the copy's name, still load.

Keys are a state dict's: parameter names (`prefix` ""), or flattened optimizer state
(`prefix` "state.", then the name and the state's field).
"""

from torch import nn


def tied_names(parts: list[nn.Module]) -> list[tuple[str, str]]:
    """(owner name, copy name) of the weights the model of these parts ties."""
    ties = []
    for part in parts:
        for pair in getattr(part, "tied_parameters", list)():
            if pair not in ties:
                ties.append(pair)
    return ties


def _renamed(key: str, prefix: str, old: str, new: str) -> str | None:
    """`key` with the parameter name `old` replaced by `new`, or None if it is not old's."""
    head = prefix + old
    if key == head or key.startswith(head + "."):
        return prefix + new + key[len(head) :]
    return None


def saved_form(sd: dict, ties: list[tuple[str, str]], prefix: str = "") -> dict:
    """`sd` as it is saved: each copy's entries dropped, or renamed to the owner's when this
    rank does not hold the owner."""
    out = dict(sd)
    for owner, copy in ties:
        for key in list(out):
            owner_key = _renamed(key, prefix, copy, owner)
            if owner_key is None:
                continue
            value = out.pop(key)
            if owner_key not in sd:
                out[owner_key] = value
    return out


def saved_key(key: str, ties: list[tuple[str, str]], prefix: str = "") -> str:
    """The key a live entry is saved under: the owner's for a copy's entry."""
    for owner, copy in ties:
        owner_key = _renamed(key, prefix, copy, owner)
        if owner_key is not None:
            return owner_key
    return key
