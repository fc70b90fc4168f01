"""CTC loss over packed sequences, in three stages side by side.

* :mod:`.naive_numpy`: the forward-backward algorithm in float64, one utterance at a time;
* :mod:`.padded_torch`: the alpha recursion vectorised over a padded batch, with autograd;
* :mod:`.triton_kernels`: the packed Triton kernels and their launchers;

and :mod:`.api`, the public :func:`packed_ctc_loss` (argument checks and its operators).
"""
from .api import packed_ctc_loss

__all__ = ["packed_ctc_loss"]
