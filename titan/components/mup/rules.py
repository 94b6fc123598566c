"""muP's width rules for Adam and Muon (Tensor Programs V's Table 3, in the variant with a
1/m logit multiplier): which parameters are hidden (matrix-like: both dims grow with the
width), and each one's init and lr factors at width multiplier m. Pure functions of names,
shapes and the optimizer's settings; titan.components.mup.converter applies them."""

import math
import re

# vector-like matrices: one dim is the vocabulary, which does not grow with the width
_VECTOR_LIKE = ("tok_embeddings.", "output.")


def is_hidden(name: str, ndim: int) -> bool:
    """A matrix both of whose dims grow with the width (attention and FFN projections)."""
    return ndim >= 2 and not name.startswith(_VECTOR_LIKE)


def init_scale(name: str, ndim: int, m: float) -> float:
    """The factor on the family's init std: 1/sqrt(m) on hidden matrices (their fan-in grows
    by m), none on embeddings, output, norms and biases."""
    return m**-0.5 if is_hidden(name, ndim) else 1.0


def lr_scale(name: str, ndim: int, m: float, optimizer: str, muon=None) -> float:
    """The factor on a parameter's lr. Adam's per-entry update is ~lr whatever the width, so a
    hidden matrix's change of its output grows with the fan-in: lr / m. Muon's update of a
    matrix is orthogonal (spectral norm 1) times its lr scale: with adjust_lr = "original",
    sqrt(max(1, rows/cols)), fixed as the width grows, it already moves outputs by O(1): no
    factor; with "match_rms_adamw", 0.2 sqrt(max(rows, cols)), which grows by sqrt(m): lr /
    sqrt(m). Whatever Muon leaves to its AdamW half follows Adam's rule."""
    if not is_hidden(name, ndim):
        return 1.0
    if optimizer == "Muon" and not re.search(muon.adamw_params, name):
        return 1.0 if muon.adjust_lr == "original" else m**-0.5
    return 1.0 / m


def q_scale(head_dim: int, base_head_dim: int) -> float:
    """The factor on the queries that makes the softmax scale sqrt(base_head_dim) / head_dim
    (muP's 1/head_dim, equal to 1/sqrt(head_dim) at the base head width)."""
    return math.sqrt(base_head_dim / head_dim)
