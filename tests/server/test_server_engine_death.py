"""A daemon whose engine dies drains and exits non-zero, so systemd restarts it."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from pydaemon.engine.inproc_client import InprocEngineClient  # noqa: E402
from pydaemon.entrypoints.daemon.app import ServerOptions, serve  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb  # noqa: E402
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_failure_makes_serve_exit_1():
    port = _free_port()
    engine = FakeEngine(num_gpu_blocks=64, max_model_len=64, fail_on_step=1)
    options = ServerOptions(port=port, grace_period_s=1.0)

    async def main() -> tuple[int, list]:
        serving = asyncio.create_task(
            serve(lambda: InprocEngineClient.load(lambda: engine), options)
        )
        frames = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            stub = pb_grpc.GenerationStub(channel)
            start = pb.StartRequest(request_id="a", text="hello world")
            start.sampling.max_tokens = 4
            call = stub.Generate(iter([pb.GenerateRequest(start=start)]))
            try:
                async for frame in call:
                    frames.append(frame)
            except grpc.aio.AioRpcError:
                pass
        return await asyncio.wait_for(serving, 30), frames

    code, frames = asyncio.run(main())
    assert code == 1
    # The request in flight was told, in band, that the engine failed.
    assert any(
        f.HasField("error") and f.error.code == grpc.StatusCode.INTERNAL.value[0] for f in frames
    )
