"""Measurements: residual bytes, bytes moved, timing and device memory."""

from jaxfuse.metrics.cost import KernelCost, bytes_moved, kernel_costs, xla_cost
from jaxfuse.metrics.memory import compiled_memory, peak_bytes
from jaxfuse.metrics.residuals import Residual, residual_bytes, residuals
from jaxfuse.metrics.timing import Timing, interleaved, time_fn
from jaxfuse.metrics.torch_residuals import torch_residual_bytes, torch_saved_tensors

__all__ = [
    "KernelCost",
    "Residual",
    "Timing",
    "bytes_moved",
    "compiled_memory",
    "interleaved",
    "kernel_costs",
    "peak_bytes",
    "residual_bytes",
    "residuals",
    "time_fn",
    "torch_residual_bytes",
    "torch_saved_tensors",
    "xla_cost",
]
