"""The front end: what runs in the caller's (or the API server's) process.

`LLMEngine` (offline, with an in-process `EngineCore`) and `AsyncLLM` (serving, with the core in
its own process behind `EngineCoreClient`), plus tokenization and validation (`input_processor`),
detokenization and stop strings (`output_processor`, `detokenizer`, `logprobs`) and the engine
arguments. Apart from `llm_engine`, nothing here imports `pyorch.core`, the model runner, the
layers or the ops: the serving front end talks to the core only through `pyorch.wire`.
"""
