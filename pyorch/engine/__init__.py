"""The engine: scheduler, engine core, clients and request processing."""
