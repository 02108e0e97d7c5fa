"""What the loaded model adds to a StartRequest before validation: chat messages rendered by its
chat template into token ids, and its generation_config.json sampling defaults in the fields
the request left unset."""

from __future__ import annotations

import grpc

from pydaemon.config.generation import GenerationDefaults
from pydaemon.entrypoints.common.validation import RequestInvalid
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.tokenizer.chat_encoding import encode_chat
from pydaemon.tokenizer.loader import AnyTokenizer


def apply_model_prompt(
    start: pb.StartRequest,
    tokenizer: AnyTokenizer | None,
    defaults: GenerationDefaults,
    *,
    parse_special_tokens_in_chat: bool = False,
) -> pb.StartRequest:
    """-> ``start`` itself when nothing changes, else a changed copy. Special-token text in
    message content stays plain text unless ``parse_special_tokens_in_chat``."""
    has_chat = start.WhichOneof("prompt") == "messages"
    unset = {
        name: value
        for name, value in defaults.as_dict().items()
        if not start.sampling.HasField(name)
    }
    if start.sampling.beam_width > 1:
        unset = {}  # beam search is deterministic: no sampling defaults
    if not has_chat and not unset:
        return start
    start = pb.StartRequest.FromString(start.SerializeToString())
    for name, value in unset.items():
        setattr(start.sampling, name, value)
    if has_chat:
        messages = [{"role": m.role, "content": m.content} for m in start.messages.messages]
        if not messages:
            raise RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, "prompt messages is empty")
        try:
            _, ids = encode_chat(
                tokenizer,
                messages,
                parse_special_tokens_in_content=parse_special_tokens_in_chat,
            )
        except ValueError as e:
            raise RequestInvalid(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        start.token_ids.ids[:] = ids  # sets the oneof: messages is cleared
    return start
