"""How users reach the engine: the ``pagedd`` CLI (cli.py), the offline ``LLM`` (llm.py), the
daemon that serves both protocols on one engine (daemon/), the gRPC service (grpc/), the OpenAI HTTP
API (openai/) and what both servers share (common/)."""
