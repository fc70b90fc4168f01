"""One benchmark harness for every chapter.

Run on a CUDA GPU::

    python -m packed_kernels.bench all          # every chapter
    python -m packed_kernels.bench ctc sinkhorn # some chapters

Each chapter module here (``ctc``, ``sinkhorn``, ``segment_ops``, ``lstm``) lists its
cases; :mod:`packed_kernels.bench.harness` times every provider of every case with
``triton.testing.do_bench`` (median and quartiles), records peak memory, and writes
long-format rows with the GPU name, versions and date to ``book/results/`` where the
notebooks read them (:mod:`packed_kernels.bench.report`).
"""
