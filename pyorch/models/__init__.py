"""Model implementations, looked up by HF architecture name through `registry`."""

from pyorch.models.registry import get_supported_archs, resolve_model_class

__all__ = ["get_supported_archs", "resolve_model_class"]
