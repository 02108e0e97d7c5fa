"""`pagedd generate`: a small streaming client of a running daemon."""

from __future__ import annotations

import argparse
import os
import sys
import uuid

import grpc

from pydaemon.entrypoints.grpc.auth import API_KEY_ENV
from pydaemon.proto.pagedd.v1 import generation_pb2 as pb
from pydaemon.proto.pagedd.v1 import generation_pb2_grpc as pb_grpc

# (flag, SamplingParams field, type, help)
SAMPLING_FLAGS = (
    ("--max-tokens", "max_tokens", int, "most tokens to generate per sequence"),
    ("--temperature", "temperature", float, "0 is greedy"),
    ("--top-p", "top_p", float, "nucleus sampling mass"),
    ("--top-k", "top_k", int, "keep the k most likely tokens"),
    ("--min-p", "min_p", float, "drop tokens below min_p * the most likely one"),
    ("--seed", "seed", int, "sampling seed"),
    ("--presence-penalty", "presence_penalty", float, ""),
    ("--frequency-penalty", "frequency_penalty", float, ""),
    ("--repetition-penalty", "repetition_penalty", float, ""),
    ("--min-tokens", "min_tokens", int, "tokens before EOS/stop may end a sequence"),
    (
        "--logprobs",
        "logprobs",
        int,
        "print each token's log-probability and the N most likely tokens at its place (at "
        "the end, on stderr)",
    ),
)


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message, rendered by the model's chat template",
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument(
        "--token-ids", default=None, help="prompt as comma-separated token ids, e.g. 1,2,3"
    )
    add_connection_flags(parser)
    parser.add_argument("-n", type=int, default=None, help="number of output sequences")
    for flag, _, type_, help_text in SAMPLING_FLAGS:
        parser.add_argument(flag, type=type_, default=None, help=help_text or None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--time-limit", type=float, default=0.0, help="request time limit (s)")
    parser.add_argument("--timeout", type=float, default=None, help="gRPC deadline (s)")
    parser.add_argument(
        "--adapter",
        default=None,
        metavar="NAME",
        help="a LoRA adapter the daemon serves (pagedd serve --lora-modules NAME=PATH, or one "
        "loaded since): its output instead of the base model's",
    )
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", default=None, metavar="FILE", help="constrain the output to this schema"
    )
    constraint.add_argument("--regex", default=None, help="constrain the output to this regex")
    constraint.add_argument(
        "--choice", action="append", default=None, help="the output is one of these (repeatable)"
    )
    constraint.add_argument("--grammar", default=None, metavar="FILE", help="an EBNF grammar")
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the daemon")
    parser.add_argument(
        "--api-key", default=None, help=f"bearer token (better: ${API_KEY_ENV}, not in `ps`)"
    )
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: connect with TLS")


def _start_request(args: argparse.Namespace) -> pb.StartRequest:
    sampling = pb.SamplingParams(stop=args.stop)
    for _, field, _, _ in SAMPLING_FLAGS:
        value = getattr(args, field)
        if value is not None:
            setattr(sampling, field, value)
    if args.n is not None:
        sampling.n = args.n
    if args.ignore_eos:
        sampling.ignore_eos = True
    start = pb.StartRequest(
        request_id=uuid.uuid4().hex[:12],
        sampling=sampling,
        time_limit_ms=int(args.time_limit * 1000),
        adapter=args.adapter or "",
    )
    _set_structured_output(start.structured_output, args)
    if args.token_ids is not None:
        if args.prompt is not None or args.chat:
            raise ValueError("--token-ids replaces the prompt text: give one or the other")
        start.token_ids.ids[:] = _parse_token_ids(args.token_ids)
    elif args.prompt is None:
        raise ValueError("give a prompt, or --token-ids")
    elif args.chat:
        if args.system is not None:
            start.messages.messages.add(role="system", content=args.system)
        start.messages.messages.add(role="user", content=args.prompt)
    else:
        if args.system is not None:
            raise ValueError("--system needs --chat")
        start.text = args.prompt
    return start


def _set_structured_output(msg: pb.StructuredOutput, args: argparse.Namespace) -> None:
    """--json-schema FILE, --regex, --choice, --grammar FILE, --json-object (one at most)."""
    if args.json_schema is not None:
        msg.json_schema = _read(args.json_schema, "--json-schema")
    elif args.regex is not None:
        msg.regex = args.regex
    elif args.choice:
        msg.choice.choices[:] = args.choice
    elif args.grammar is not None:
        msg.grammar = _read(args.grammar, "--grammar")
    elif args.json_object:
        msg.json_object = True


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None


def _parse_token_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--token-ids must be comma-separated integers, got {value!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"--token-ids must be non-negative integers, got {value!r}")
    return ids


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to ``args.server``, with TLS when ``args.tls_ca`` names a CA bundle."""
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            return grpc.secure_channel(args.server, grpc.ssl_channel_credentials(f.read()))
    return grpc.insecure_channel(args.server)


def auth_metadata(args: argparse.Namespace) -> tuple | None:
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def run_generate(args: argparse.Namespace, out=sys.stdout, err=sys.stderr) -> int:
    try:
        start = _start_request(args)
    except ValueError as e:
        print(f"pagedd generate: {e}", file=err)
        return 2
    metadata = auth_metadata(args)
    n = start.sampling.n if start.sampling.HasField("n") else 1
    texts: dict[int, list[str]] = {}
    logprobs: list[str] = []
    with open_channel(args) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(
            iter([pb.GenerateRequest(start=start)]), timeout=args.timeout, metadata=metadata
        )
        try:
            for frame in call:
                event = frame.WhichOneof("event")
                if event == "delta":
                    texts.setdefault(frame.delta.index, []).append(frame.delta.text)
                    if n == 1:
                        _write_delta(frame.delta, out, err)
                    logprobs += [
                        _logprob_line(frame.delta.index, n, lp) for lp in frame.delta.logprobs
                    ]
                elif event == "error":
                    code = grpc.StatusCode(_code_tuple(frame.error.code))
                    print(f"error: {code.name}: {frame.error.message}", file=err)
                    return 1
                elif event == "finished":
                    _print_finished(frame.finished, texts, n, logprobs, out, err)
                    return 0
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=err)
            return 1
        except KeyboardInterrupt:
            call.cancel()
            print("\ncancelled", file=err)
            return 130
    print("\nerror: the stream ended without a Finished frame", file=err)
    return 1


def _write_delta(delta: pb.TokenDelta, out, err) -> None:
    """The new text; a reasoning model's thinking (the daemon's --reasoning-parser) goes to
    stderr, its answer to stdout."""
    if delta.HasField("content"):
        if delta.reasoning:
            err.write(delta.reasoning)
            err.flush()
        out.write(delta.content)
    else:
        out.write(delta.text)
    out.flush()


def _logprob_line(index: int, n: int, lp: pb.TokenLogprobs) -> str:
    """One generated token: its text and log-probability, then the alternatives'."""
    seq = f"[{index}] " if n > 1 else ""
    top = ", ".join(f"{t.text!r} {t.logprob:.3f}" for t in lp.top_logprobs)
    return f"  {seq}{lp.text!r:<14} {lp.logprob:8.3f}" + (f"   | {top}" if top else "")


def _code_tuple(value: int):
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code.value
    return grpc.StatusCode.UNKNOWN.value


def _print_finished(finished, texts, n, logprobs, out, err) -> None:
    if n > 1:
        for i in range(n):
            out.write(
                f"--- sequence {i} ({pb.FinishReason.Name(finished.sequence_finish_reasons[i]).removeprefix('FINISH_REASON_').lower() if i < len(finished.sequence_finish_reasons) else '?'}) ---\n"
            )
            answers = {r.index: r.content for r in finished.reasoning}  # a reasoning model's
            out.write(answers.get(i, "".join(texts.get(i, []))) + "\n")
    else:
        out.write("\n")
    out.flush()
    if logprobs:
        print("logprobs (token, its log-probability, then the most likely tokens):", file=err)
        print("\n".join(logprobs), file=err)
    reason = pb.FinishReason.Name(finished.finish_reason).removeprefix("FINISH_REASON_").lower()
    u, t = finished.usage, finished.timings
    print(
        f"[finish: {reason}"
        + (f" ({finished.stop_reason!r})" if finished.stop_reason else "")
        + f" | tokens: prompt {u.prompt_tokens}, completion {u.completion_tokens}, cached {u.cached_tokens}"
        + f" | ms: queue {t.queue_ms:.1f}, first token {t.time_to_first_token_ms:.1f}, total {t.total_ms:.1f}]",
        file=err,
    )
