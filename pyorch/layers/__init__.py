"""Shared model layers: norms, linears, rotary embedding, attention, activations, sampler."""
