"""The Generation service's LoRA calls: LoadAdapter, UnloadAdapter, ListAdapters.

They change or read the daemon's ``LoRAAdapters`` (shared with the OpenAI front end), behind
the same API key as every call. A servicer mixes this in and sets ``adapters``.
"""

from __future__ import annotations

import grpc

from pydaemon.entrypoints.common.lora_adapters import AdapterNotFound, LoRAAdapters
from pydaemon.entrypoints.grpc.validation import RequestInvalid
from pydaemon.lora_request import LoRAAdapterInfo, LoRARequest
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb


class AdapterCalls:
    # The LoRA adapters requests may name: none until the daemon sets its own (LoRA on).
    adapters: LoRAAdapters = LoRAAdapters("", engine=None, is_enabled=False)

    def lora_request_for(self, adapter: str) -> LoRARequest | None:
        """StartRequest.adapter -> its LoRARequest (None: the base model); an unknown name is
        a NOT_FOUND RequestInvalid."""
        if not adapter:
            return None
        try:
            return self.adapters.get(adapter)
        except AdapterNotFound as e:
            raise RequestInvalid(grpc.StatusCode.NOT_FOUND, str(e)) from None

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.AdapterInfo:
        if not self.adapters.is_enabled:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "LoRA adapters are not enabled: start the daemon with --enable-lora",
            )
        try:
            info = await self.adapters.load(request.name, request.path)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self._info(info)

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context
    ) -> pb.UnloadAdapterResponse:
        try:
            await self.adapters.unload(request.name)
        except AdapterNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.UnloadAdapterResponse()

    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[self._info(a) for a in self.adapters.list()])

    @staticmethod
    def adapter_loads(stats) -> list[pb.AdapterLoad]:
        """GetServerStatus.adapters from an EngineStats."""
        return [
            pb.AdapterLoad(name=name, num_running=running, num_waiting=waiting)
            for name, (running, waiting) in sorted(stats.lora_requests.items())
        ]

    def _info(self, info: LoRAAdapterInfo) -> pb.AdapterInfo:
        return pb.AdapterInfo(
            name=info.lora_name,
            path=info.lora_path,
            rank=info.rank,
            target_modules=list(info.target_modules),
            base_model=self.adapters.base_model_name,
        )
