"""The engine: the EngineClient interface a server talks to and its implementations (MPEngineClient:
the core in its own process; InprocEngineClient: in a thread), LLMEngine (in-process, for ``LLM``),
EngineCore and its process, the one start-up path shared by every front end (startup.py), output
processing, incremental detokenization and prompt input."""
