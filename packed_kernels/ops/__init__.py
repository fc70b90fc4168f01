"""The four algorithms, one subpackage each, every one with the same shape.

* ``naive_numpy.py``: the float64 reference, written for reading;
* ``padded_torch.py``: vectorised PyTorch over a padded batch, differentiated by autograd;
* ``triton_kernels.py``: the production Triton kernels and their launchers;
* ``api.py``: argument checks, dispatch (:mod:`packed_kernels.dispatch`) and the public
  functions (for the LSTM, the module class).

Stage functions end in ``_numpy``, ``_padded`` and ``_triton``.
"""
