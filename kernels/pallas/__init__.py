"""Pallas kernels. Every wrapper takes ``interpret`` (CPU tests) and sets a ``pl.CostEstimate``
whose ``bytes_accessed`` is the HBM traffic implied by its block specs."""
