"""The built-in demo model, ``model="demo"``: a tiny Llama with deterministic random weights
and a real SentencePiece tokenizer trained on a small embedded English corpus.

Nothing is downloaded. It is built once into a cache directory (``$PAGEDD_CACHE/demo-v2``,
default ``~/.cache/pagedd/demo-v2``) through a temporary directory and an atomic rename, so
concurrent first uses are safe. Its output is gibberish: it exists so that the daemon runs
out of the box and so tests have a real tokenizer.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEMO_VERSION = "demo-v2"  # v2: ships a chat template
DEMO_VOCAB_SIZE = 512

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vocab_size": DEMO_VOCAB_SIZE,
}

# A plain "Role: text" chat format the tokenizer can spell (SentencePiece does not parse special
# tokens out of text, so the template writes none; chat prompts are encoded without a BOS).
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_CORPUS = """\
PagedAttention stores the keys and values of every sequence in fixed-size blocks.
A block table maps the logical blocks of a sequence to physical blocks in memory.
Because blocks need not be contiguous, memory is wasted only in the last block.
The scheduler decides every step which sequences run, which wait and which are preempted.
Continuous batching lets new requests join while others are still generating tokens.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind.
Once upon a time there was a little village by the sea, where fishermen told stories.
In the morning the children walked to school along the river, singing old songs.
She opened the window, looked at the mountains and decided to climb the highest one.
The library was quiet except for the sound of pages turning and rain on the roof.
Numbers like 3, 14, 42, 1000 and 2024 appear in text, and so do dates and times.
Prices were listed as 5 dollars, 10 euros, or 1,200 yen in the small shop.
Good software is simple to read, easy to test, and honest about what it cannot do.
Language models predict the next token given all the tokens that came before it.
A tokenizer splits text into pieces; rare characters fall back to single bytes.
Hello world! How are you today? I am fine, thank you, and you?
The weather was cold and windy, but the sun came out in the afternoon.
He wrote a letter to his friend, describing the long journey across the desert.
Questions, answers, lists, and short stories all help a small model learn English.
Every request carries its own sampling parameters: temperature, top-p and a seed.
"""


def demo_model_dir(cache_dir: str | Path | None = None) -> Path:
    """-> the demo model directory, building it on first use."""
    root = Path(cache_dir or os.environ.get("PAGEDD_CACHE") or Path.home() / ".cache" / "pagedd")
    target = root / DEMO_VERSION
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=root))
    try:
        build_demo_model(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent winner: real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_demo_model(out_dir: str | Path) -> None:
    """Writes config.json, generation_config.json, tokenizer.model, chat_template.jinja and
    model.safetensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.model").write_bytes(_train_tokenizer())
    (out_dir / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(DEMO_CHAT_TEMPLATE)
    save_file(_random_weights(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer() -> bytes:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=DEMO_VOCAB_SIZE,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.getvalue()


def _random_weights() -> dict[str, torch.Tensor]:
    cfg = DEMO_CONFIG
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * 0.1
    return weights
