"""vLLM's runtime LoRA endpoints, behind the same API key as every ``/v1/*`` route.

- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: registers the PEFT
  adapter at ``lora_path`` (a directory on the server) under ``lora_name``; 200 with a
  sentence, 400 when the name is taken or the adapter cannot be served.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: unloads it (new requests get 404 at
  once; requests running with it finish, then the engine frees its memory); 404 when no
  adapter has that name.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from pydaemon.entrypoints.common.lora_adapters import AdapterNotFound
from pydaemon.entrypoints.openai.errors import ApiError, bad_request
from pydaemon.entrypoints.openai.serving import OpenAIServing


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def add_lora_routes(app: web.Application, serving: OpenAIServing) -> None:
    async def load(request: web.Request) -> web.Response:
        body = LoadLoRAAdapterRequest.model_validate_json(await request.read())
        try:
            await serving.adapters.load(body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: web.Request) -> web.Response:
        body = UnloadLoRAAdapterRequest.model_validate_json(await request.read())
        try:
            await serving.adapters.unload(body.lora_name)
        except AdapterNotFound as e:
            raise ApiError(404, str(e), param="lora_name", code="lora_adapter_not_found") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    # A malformed body is a 400 through error_middleware (pydantic's ValidationError).
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
