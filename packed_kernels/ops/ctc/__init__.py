"""CTC loss over packed sequences, in three stages side by side.

* :mod:`.naive_numpy`: the forward-backward algorithm in float64, one utterance at a time;
* :mod:`.padded_torch`: the alpha recursion vectorised over a padded batch, with autograd;
* :mod:`.triton_kernels`: the packed Triton kernels and their launchers;

and :mod:`.api`, the public :func:`packed_ctc_loss` (argument checks and its operators);
:mod:`.logits`, the same loss from logits (:func:`packed_ctc_loss_from_logits`) and from
the input of the linear layer that makes them (:func:`linear_packed_ctc_loss`); :mod:`.align`,
forced alignment (the Viterbi path through the same trellis): :func:`packed_ctc_align`,
:func:`packed_ctc_align_from_logits` and their :class:`CTCAlignment`.
"""
from .align import CTCAlignment, packed_ctc_align, packed_ctc_align_from_logits
from .api import packed_ctc_loss
from .logits import linear_packed_ctc_loss, packed_ctc_loss_from_logits

__all__ = ["CTCAlignment", "linear_packed_ctc_loss", "packed_ctc_align", "packed_ctc_align_from_logits",
           "packed_ctc_loss", "packed_ctc_loss_from_logits"]
