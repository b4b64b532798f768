"""sidecar-gateway: an inference gateway that runs as a sidecar next to model servers."""

__version__ = "0.1.0"
