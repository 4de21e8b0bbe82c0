"""Measurements: residual bytes, FLOPs, bytes moved, timing and device memory."""

from jaxfuse.metrics import traffic, triton_traffic
from jaxfuse.metrics.collectives import (Collective, collective_bytes, collective_counts,
                                         collectives)
from jaxfuse.metrics.cost import KernelCost, bytes_moved, kernel_costs, xla_cost
from jaxfuse.metrics.flops import flops
from jaxfuse.metrics.memory import compiled_memory, peak_bytes
from jaxfuse.metrics.residuals import (Residual, offloaded_bytes, per_device_residual_bytes,
                                       residual_bytes, residuals)
from jaxfuse.metrics.timing import Timing, interleaved, time_fn
from jaxfuse.metrics.torch_residuals import torch_residual_bytes, torch_saved_tensors
from jaxfuse.metrics.traffic import (KernelTraffic, OperandTraffic, cpu_kernel_traffic,
                                     kernel_traffic)

__all__ = [
    "Collective",
    "KernelCost",
    "KernelTraffic",
    "OperandTraffic",
    "Residual",
    "Timing",
    "bytes_moved",
    "collective_bytes",
    "collective_counts",
    "collectives",
    "compiled_memory",
    "cpu_kernel_traffic",
    "flops",
    "interleaved",
    "kernel_costs",
    "kernel_traffic",
    "offloaded_bytes",
    "per_device_residual_bytes",
    "peak_bytes",
    "residual_bytes",
    "residuals",
    "time_fn",
    "torch_residual_bytes",
    "torch_saved_tensors",
    "traffic",
    "triton_traffic",
    "xla_cost",
]
