"""A persistent LSTM: naive NumPy, padded PyTorch and Triton stages side by side.

* :mod:`.naive_numpy`: one layer, one direction, the cell written out (float64).
* :mod:`.padded_torch`: stacked, bidirectional, a loop over time on a padded batch.
* :mod:`.triton_kernels`: one persistent launch per layer runs the whole recurrence.
* :class:`PersistentLSTM` (:mod:`.api`): the public wrapper of an ``nn.LSTM``, which
  adapts its input (:mod:`.inputs`: padded, unbatched, ``Packed`` or ``PackedSequence``,
  as the rows the kernels read) and reads the wrapped module where it keeps its
  attributes and parameters (:mod:`.module_view`).
"""
from .api import PersistentLSTM

__all__ = ["PersistentLSTM"]
