"""Device code only: Pallas kernel bodies with their ``pallas_call`` wrappers (``pallas/``) and raw
Triton kernels for ``jax_triton.triton_call`` (``triton/``). No autodiff lives here; the
differentiable ops in :mod:`jaxfuse.ops` choose residuals and call these kernels.

Installed as ``jaxfuse.kernels``.
"""

if __name__ == "kernels":
  # Run from the repository's root (`python -m pytest`, `python -m benchmarks`), this directory is
  # also found as a top-level `kernels`, the import name of Hugging Face's kernels package (which
  # transformers >= 5.25 requires and imports). Where that package is installed, hand the name to
  # it rather than shadowing it; elsewhere this module stays, empty.
  import importlib.machinery as _machinery
  import importlib.util as _util
  import os as _os
  import sys as _sys

  _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
  _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
  _spec = _machinery.PathFinder.find_spec("kernels", _path)
  if _spec is not None and _spec.loader is not None:
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
