"""Helpers shared by the quantization methods (no configs are registered here)."""
