"""The OpenAI-compatible HTTP API, served next to gRPC by the same daemon on the same engine.

Stack: aiohttp's web server for HTTP and server-sent events, pydantic (v2) models for the
wire format. Why aiohttp rather than FastAPI/Starlette on uvicorn:
- it runs as an ``AppRunner`` on the daemon's own asyncio loop, beside grpc.aio, with no
  second server loop, thread or signal handler to reconcile with the gRPC drain;
- ``handler_cancellation=True`` cancels a request's handler the moment its client
  disconnects, streaming or not, which aborts the engine request and frees its KV blocks at
  once (uvicorn never cancels the app; Starlette notices a disconnect only inside a
  StreamingResponse, so a non-streaming request of a departed client would run to its end);
- it is already on the GPU machine image and is one well-kept dependency, where FastAPI
  would add fastapi, starlette and uvicorn (pydantic is needed either way for the models).

Layout: ``protocol`` (request models), ``responses`` (response and chunk models), ``errors``
(OpenAI's error shape), ``auth``, ``sse``, ``engine_stream`` (the engine client's
``generate`` for one or many prompts), ``accumulator``, ``logprobs``, ``runner`` (one request
from admission to its last byte), ``completions``, ``chat``, ``serving`` (shared state and
admission), ``app`` (routes and the server).
"""

from pydaemon.entrypoints.openai.app import HttpServer, build_app
from pydaemon.entrypoints.openai.serving import HttpOptions, OpenAIServing, ServedModel

__all__ = ["HttpOptions", "HttpServer", "OpenAIServing", "ServedModel", "build_app"]
