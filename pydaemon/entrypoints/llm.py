"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from pydaemon.config.engine import EngineConfig
from pydaemon.engine.llm_engine import LLMEngine
from pydaemon.entrypoints.common.tool_choice import (
    encode_chat_with_tools,
    messages_for_template,
    tool_choice_constraint,
    tools_must_render,
)
from pydaemon.generate_request import GenerateRequest
from pydaemon.lora_request import LoRARequest
from pydaemon.model_loader.default_model import DEFAULT_MODEL
from pydaemon.outputs import CompletionOutput, RequestOutput
from pydaemon.sampling_params import SamplingParams


class LLM:
    """Generate from many prompts at once through the paged engine.

    ``sampling_params=None`` takes the model's generation_config.json defaults.

    ``LLM(model="SmolLM2-135M-Instruct" (the default) | "demo" | "/path/to/hf-dir" |
    "/path/to/file.gguf", device="auto"|"cpu"|"cuda", dtype="auto",
    block_size=16, num_kv_blocks=None, max_num_seqs=256, max_num_batched_tokens=None,
    load_format="auto"|"dummy", seed=0, ...)``: every EngineConfig field is accepted.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults."""
        return self.engine.generation_defaults.sampling_params()

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice: Any = "auto",
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool | None = None,
        parse_special_tokens_in_content: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to
        several; each is rendered by the model's chat template. ``prompt`` of each output is
        the rendered text. ``tools`` (OpenAI's format) are rendered by templates that take
        them; ``tool_choice`` "required" or ``{"type": "function", "function": {"name": ...}}``
        constrains the output to the call(s): a JSON list of ``{"name", "parameters"}``, or the
        named function's arguments object (pydaemon.entrypoints.common.tool_choice);
        ``parallel_tool_calls=False``: one call at most; "auto" with a template that leaves the
        tools out is a ValueError (ToolsNotRendered). Special-token text inside messages is
        plain text unless ``parse_special_tokens_in_content`` (the template's own markers are
        always tokens)."""
        if not messages:
            raise ValueError("messages is empty: give a conversation or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        constraint = None
        if tools:
            constraint = tool_choice_constraint(tools, tool_choice, parallel_tool_calls)
        if constraint is not None:
            params = sampling_params or self.get_default_sampling_params()
            sampling_params = [
                dataclasses.replace(p, structured_outputs=constraint)
                for p in _per_prompt(params, len(conversations), "sampling_params")
            ]
        if tool_choice == "none":
            tools = None
        texts, token_ids = [], []
        for conversation in conversations:
            text, ids = encode_chat_with_tools(
                self.tokenizer,
                messages_for_template(list(conversation)),
                add_generation_prompt,
                tools,
                must_render_tools=tools_must_render(tools, tool_choice),
                chat_template_kwargs=chat_template_kwargs,
                parse_special_tokens_in_content=parse_special_tokens_in_content,
            )
            texts.append(text)
            token_ids.append(ids)
        outputs = self.generate(
            sampling_params=sampling_params, prompt_token_ids=token_ids, use_tqdm=use_tqdm
        )
        for output, text in zip(outputs, texts, strict=True):
            output.prompt = text
        return outputs

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs ``enable_lora``."""
        if prompts is not None and prompt_token_ids is not None:
            raise ValueError("pass prompts or prompt_token_ids, not both")
        items: list[str | list[int]]
        if prompt_token_ids is not None:
            items = [list(p) for p in prompt_token_ids]
        elif isinstance(prompts, str):
            items = [prompts]
        elif prompts is None:
            raise ValueError("no prompts given")
        else:
            items = [p if isinstance(p, str) else list(p) for p in prompts]
        params_list = _per_prompt(
            sampling_params or self.get_default_sampling_params(), len(items), "sampling_params"
        )
        priorities = _per_prompt(priority if priority is not None else 0, len(items), "priority")
        salts = _per_prompt(cache_salt, len(items), "cache_salt")
        loras = _per_prompt(lora_request, len(items), "lora_request")
        ids = []
        for item, params, prio, salt, lora in zip(
            items, params_list, priorities, salts, loras, strict=True
        ):
            request_id = str(self._counter)
            self._counter += 1
            self.engine.add_request(
                GenerateRequest(request_id, item, params, prio, salt, lora_request=lora)
            )
            ids.append(request_id)
        results = self._run(ids, use_tqdm if use_tqdm is not None else len(ids) >= 32)
        return [results[i] for i in ids]

    def _run(self, ids: list[str], show_progress: bool) -> dict[str, RequestOutput]:
        pending = set(ids)
        merged: dict[str, RequestOutput] = {}
        start = time.monotonic()
        done = 0
        while pending:
            for delta in self.engine.step():
                if delta.request_id not in pending:
                    continue
                merged[delta.request_id] = _merge(merged.get(delta.request_id), delta)
                if delta.error is not None:
                    raise RuntimeError(f"request {delta.request_id}: {delta.error}")
                if delta.finished:
                    pending.discard(delta.request_id)
                    done += 1
                    if show_progress:
                        _progress(done, len(ids), start)
        if show_progress:
            sys.stderr.write("\n")
        return merged


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _merge(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the whole output."""
    if acc is None:
        acc = RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
            finished=False,
            metrics=delta.metrics,
        )
    by_index = {o.index: o for o in acc.outputs}
    for part in delta.outputs:
        whole = by_index.get(part.index)
        if whole is None:
            whole = by_index[part.index] = CompletionOutput(index=part.index, logprobs=None)
        whole.token_ids.extend(part.token_ids)
        whole.text += part.text
        whole.finish_reason = part.finish_reason
        whole.stop_reason = part.stop_reason
        whole.cumulative_logprob = part.cumulative_logprob
        if part.logprobs is not None:
            whole.logprobs = (whole.logprobs or []) + part.logprobs
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    if delta.prompt_logprobs:
        acc.prompt_logprobs = (acc.prompt_logprobs or []) + delta.prompt_logprobs
    acc.finished = delta.finished
    acc.error = delta.error
    return acc


def _progress(done: int, total: int, start: float) -> None:
    elapsed = time.monotonic() - start
    width = 30
    filled = width * done // total
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {elapsed:.1f}s"
    )
    sys.stderr.flush()
