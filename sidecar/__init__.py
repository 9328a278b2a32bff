"""Health-monitoring and self-healing sidecar for distributed PyTorch training nodes."""

__version__ = "0.1.0"
