"""Pallas kernels. Every wrapper takes ``interpret`` (CPU tests) and gives its ``pallas_call`` a
``pl.CostEstimate`` as a scheduling hint for XLA (:func:`common.cost`); the bytes a kernel moves
are counted from its body by :mod:`jaxfuse.metrics.traffic`, not from that hint."""
