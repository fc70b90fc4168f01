"""CTC loss over packed sequences, in three stages side by side.

* :mod:`.naive_numpy`: the forward-backward algorithm in float64, one utterance at a time;
* :mod:`.padded_torch`: the alpha recursion vectorised over a padded batch, with autograd;
* :mod:`.triton_kernels` and :mod:`.packed_loss`: the packed Triton kernels and the public
  :func:`packed_ctc_loss`.
"""
from .api import packed_ctc_loss

__all__ = ["packed_ctc_loss"]
