"""The engine core: the scheduler, the KV-cache manager, request state, and `EngineCore` (one
step = schedule -> execute -> update_from_output) with its process loop (`core_proc`).

It runs in the caller's process under `LLMEngine` and in its own process under `AsyncLLM`, and
never imports the front end (`pyorch.engine`).
"""
