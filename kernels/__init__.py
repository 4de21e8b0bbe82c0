"""Device code only: Pallas kernel bodies with their ``pallas_call`` wrappers (``pallas/``) and raw
Triton kernels for ``jax_triton.triton_call`` (``triton/``). No autodiff lives here; the
differentiable ops in :mod:`jaxfuse.ops` choose residuals and call these kernels.

Installed as ``jaxfuse.kernels``.
"""
