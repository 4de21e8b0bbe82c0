"""PyTorch reference twins of jaxfuse's ops and modules, written from their specifications."""
