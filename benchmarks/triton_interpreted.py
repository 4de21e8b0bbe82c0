"""The ``jaxfuse-triton`` rows of the suites on a machine without a GPU: the op itself, with
``implementation="triton"``, run end to end with its kernels in Triton's interpreter.

jax-triton launches the ``@triton.jit`` kernels only on a GPU. Here the op is traced as for a
GPU and its ``jax_triton.triton_call`` goes to the stand-in of
:mod:`jaxfuse.testing.triton_interpreter` (the one the CPU tests use), which runs each kernel,
with the launch parameters jax-triton would use, in Triton's interpreter
(``TRITON_INTERPRET=1``, torch CPU tensors) through ``jax.pure_callback``. So a row's errors
come from the op's own forward + backward step (its ``custom_vjp``, wrappers and kernels), and
its ``bytes_moved`` from the loads and stores of the kernels that step launched, counted while
they run (:mod:`jaxfuse.metrics.triton_traffic`).

The interpreter runs each program in numpy: a suite runs it at the case's shape where that takes
seconds and otherwise at a smaller one, and says which in each figure's source.

Example::

    from benchmarks import triton_interpreted
    if triton_interpreted.available():
      (outputs, grads), traffic = triton_interpreted.run_step(
          lambda x, s: ops.rms_norm(x, s, implementation="triton"), (x, s), g)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence

import jax

from benchmarks import harness
from jaxfuse.ops import dispatch

ERRORS_SOURCE = ("the op with implementation='triton', its kernels run in Triton's interpreter "
                 "(jaxfuse/testing/triton_interpreter.py's jax_triton), at {where}, against "
                 "{reference}")
BYTES_SOURCE = ("kernel loads/stores counted under Triton's interpreter "
                "(jaxfuse.metrics.triton_traffic) while the op's forward + backward step ran, "
                "at {where}")
NOTE = "CPU: no time (needs a GPU); errors and bytes_moved from Triton's interpreter at {where}"
RESIDUAL_SUFFIX = " (traced for a GPU, through a stand-in jax_triton: nothing runs)"
# The implementation (``dispatch.KINDS``) whose kernels this module runs.
IMPLEMENTATION = "triton"


def _interpret_unless_gpu() -> None:
  """Sets ``TRITON_INTERPRET=1`` (unless the environment sets it) on a machine without a GPU.

  Triton reads it when it defines a ``@triton.jit`` function, its own ``triton.language``
  functions included: so before anything (torch.compile among others) imports triton. The
  suites that have Triton rows import this module when they are loaded.
  """
  if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
    return
  if not dispatch.on_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_unless_gpu()


@functools.cache
def available() -> bool:
  """Whether the Triton kernels run in the interpreter here: no GPU, triton and torch (the
  stand-in's tensors, ``jaxfuse[test]``) installed, and triton loaded under
  ``TRITON_INTERPRET=1``."""
  if dispatch.on_gpu() or importlib.util.find_spec("triton") is None:
    return False
  if importlib.util.find_spec("torch") is None:
    return False
  if os.environ.get("TRITON_INTERPRET") != "1":
    return False
  import triton.language as tl
  from triton.runtime.interpreter import InterpretedFunction

  # Loaded before TRITON_INTERPRET was set, triton's own functions are compiled-only.
  return isinstance(tl.sum, InterpretedFunction)


def has_row(implementation: str) -> bool:
  """Whether a suite lists ``implementation``'s row where it does not compile, for what Triton's
  interpreter gives: the Triton kernels, where the triton package is installed (each figure
  says why it is null where the interpreter does not run: see :func:`available`)."""
  return implementation == IMPLEMENTATION and importlib.util.find_spec("triton") is not None


def run_step(f: Callable, args: Sequence, cts=None, **step_options):
  """One ``harness.jax_step(f)`` with ``f``'s Triton kernels in the interpreter.

  Args:
    f: a function of JAX arrays calling an op with ``implementation="triton"``.
    args, cts: the step's arguments and output cotangents (None: a scalar loss).
    step_options: passed to :func:`benchmarks.harness.jax_step` (``n_diff``, ...).

  Returns:
    ``((outputs, gradients), traffic)``: the step's results and the
    :class:`jaxfuse.metrics.triton_traffic.TritonTraffic` of the kernels it launched.
  """
  from jaxfuse.metrics import triton_traffic
  from jaxfuse.testing import triton_interpreter

  if not available():
    raise RuntimeError("Triton's interpreter is not available here (a GPU, no triton, or "
                       "TRITON_INTERPRET is not 1)")
  with triton_interpreter.triton_ops(), triton_traffic.counting() as traffic:
    result = jax.block_until_ready(harness.jax_step(f, **step_options)(args, cts))
  return result, traffic


def residual_bytes(f: Callable, args: Sequence, **options) -> int:
  """:func:`benchmarks.harness.residual_bytes` of ``f`` traced as on a GPU, its jax-triton
  launches recorded, not run (the residuals do not depend on the kernels' values)."""
  from jaxfuse.testing import triton_interpreter

  with triton_interpreter.triton_ops(run=False):
    return harness.residual_bytes(f, args, **options)
