"""User entry points: the offline LLM class (and, later, the OpenAI-compatible server)."""
