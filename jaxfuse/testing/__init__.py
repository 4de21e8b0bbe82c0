"""Test support shared by the tests and the benchmarks: not part of jaxfuse's API.

- :mod:`jaxfuse.testing.torch_ref`: the PyTorch reference twins of the ops and modules, the
  computations the tests check jaxfuse against and the benchmarks' ``torch-eager`` rows run.
- :mod:`jaxfuse.testing.triton_interpreter`: the ``@triton.jit`` kernels run on a CPU in
  Triton's interpreter, through a stand-in ``jax_triton`` (the Triton tests, and the
  ``jaxfuse-triton`` rows of the benchmarks on a machine without a GPU).

Its modules need the ``test`` extra (``pip install -e '.[test]'``: torch, triton); importing
``jaxfuse`` never imports them.
"""
