"""tokenizer.json tokenizers against transformers' AutoTokenizer: ids, text, streaming text,
special tokens, EOS/BOS resolution, and which tokenizer a model directory loads."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import tokenizers
from tokenizer_utils import STYLES, TEXTS, build_hf_tokenizer

from pydaemon.engine.detokenizer import IncrementalDetokenizer
from pydaemon.model_loader.demo_model import demo_model_dir
from pydaemon.tokenizer.hf import HFTokenizer
from pydaemon.tokenizer.loader import load_tokenizer
from pydaemon.tokenizer.sentencepiece import SentencePieceTokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=STYLES)
def pair(request, tmp_path_factory):
    """(our tokenizer, transformers' AutoTokenizer) on the same files."""
    model_dir = build_hf_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return HFTokenizer.from_dir(model_dir), ref


def test_encode_equals_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        for add_bos in (True, False):
            assert ours.encode(text, add_bos=add_bos) == ref.encode(
                text, add_special_tokens=add_bos
            ), (text, add_bos)


def test_decode_equals_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(ref)
    with pytest.raises(ValueError, match="out of range"):
        ours.decode([ours.vocab_size])


def test_special_tokens_match_transformers(pair):
    ours, ref = pair
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids == {ref.eos_token_id}
    assert ours.special_tokens_map == ref.special_tokens_map


def _stream(tok, prompt, output, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add([t]) for t in output]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_text_equals_transformers_decode(pair, skip):
    """Any split of prompt/output: the deltas add up to the decode of all minus the prompt's."""
    ours, ref = pair
    for text in TEXTS:
        ids = ref.encode(text)
        for split in range(1, len(ids)):
            prompt, output = ids[:split], ids[split:]
            prompt_text = ref.decode(prompt, skip_special_tokens=skip)
            if prompt_text.endswith("\ufffd"):
                continue  # a prompt ending inside a character has no well-defined text
            detok, deltas = _stream(ours, prompt, output, skip)
            full = ref.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == detok.text == full[len(prompt_text) :], (text, split)
            assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_across_tokens(pair):
    ours, ref = pair
    prompt = ours.encode("Hi")
    rocket = ours.encode("Hi 🦾", add_bos=False)[len(prompt) - (ours.bos_token_id is not None) :]
    assert len(rocket) >= 2  # an unseen 4-byte emoji is never one token here
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.add([t]) for t in rocket] + [detok.flush()]
    assert "".join(deltas) == detok.text == ref.decode(prompt + rocket)[len(ref.decode(prompt)) :]
    assert detok.text.endswith("🦾") and "".join(deltas).endswith("🦾")
    assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_run_decoded_as_a_whole(pair):
    """tokenizers' ByteFallback decodes a run of <0xNN> pieces all or nothing: 'AB' then a
    stray 0xE5 makes the whole run U+FFFDs, so the stream waits for the run's end."""
    ours, ref = pair
    if not ours.byte_run_token_ids:
        pytest.skip("no byte-fallback pieces in a byte-level BPE")
    vocab = ref.get_vocab()
    run = [vocab["<0x41>"], vocab["<0x42>"], vocab["<0xE5>"]]
    after = ours.encode(" think", add_bos=False)
    prompt = ours.encode("Hi")
    detok = IncrementalDetokenizer(ours, prompt)
    deltas = [detok.add([t]) for t in run + after] + [detok.flush()]
    want = ref.decode(prompt + run + after, skip_special_tokens=True)
    assert want.count("\ufffd") == 3
    assert "".join(deltas) == want[len(ref.decode(prompt, skip_special_tokens=True)) :]


def test_generated_special_tokens_in_stream(pair):
    ours, ref = pair
    prompt = ours.encode("Hello")
    output = [*ours.encode(" world", add_bos=False), ours.eos_token_id]
    _, kept = _stream(ours, prompt, output, skip=False)
    _, skipped = _stream(ours, prompt, output, skip=True)
    eos_text = ref.convert_ids_to_tokens(ours.eos_token_id)
    assert "".join(kept).endswith(eos_text)
    assert eos_text not in "".join(skipped) and "".join(skipped).endswith("world")


def test_from_tokenizer_object_equals_from_dir(tmp_path):
    model_dir = build_hf_tokenizer(tmp_path, "llama3")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    mem = HFTokenizer.from_tokenizer_object(tok, {**config, "name_or_path": "gguf-llama"}, template)
    disk = HFTokenizer.from_dir(model_dir)
    for text in TEXTS:
        assert mem.encode(text) == disk.encode(text)
        assert mem.decode(disk.encode(text), False) == disk.decode(disk.encode(text), False)
    msgs = [{"role": "user", "content": "hi"}]
    assert mem.apply_chat_template(msgs) == disk.apply_chat_template(msgs)
    assert (mem.bos_token_id, mem.eos_token_ids) == (disk.bos_token_id, disk.eos_token_ids)
    bare = HFTokenizer.from_tokenizer_object(tok, {"bos_token_id": 0, "eos_token_id": [1, 4]})
    assert bare.bos_token_id == 0 and bare.eos_token_ids == {1, 4} and bare.eos_token_id == 1
    with pytest.raises(ValueError, match="'model' has no chat template"):
        bare.apply_chat_template(msgs)


@pytest.mark.parametrize("add_bos", [False, True])
def test_bos_rules(tmp_path, add_bos):
    """The tokenizer.json post-processor wins over add_bos_token (as in transformers 5);
    without one, add_bos_token decides (as transformers 4 did; 5 then adds nothing)."""
    model_dir = build_hf_tokenizer(tmp_path, "mistral")  # the post-processor adds <s>
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["add_bos_token"] = add_bos
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    for has_post_processor in (True, False):
        if not has_post_processor:
            data = json.loads((model_dir / "tokenizer.json").read_text())
            data["post_processor"] = None
            (model_dir / "tokenizer.json").write_text(json.dumps(data))
        ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
        ours = HFTokenizer.from_dir(model_dir)
        body = ref.encode("Hello there", add_special_tokens=False)
        assert ours.encode("Hello there", add_bos=False) == body
        if has_post_processor:
            assert ours.encode("Hello there") == ref.encode("Hello there")
        has_bos = ours.encode("Hello there")[0] == ours.bos_token_id
        assert has_bos == (has_post_processor or add_bos)


def test_eos_ids_from_every_config(tmp_path):
    model_dir = build_hf_tokenizer(tmp_path, "llama3")  # eos_token <|eot_id|> = 4
    tok = HFTokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == {4} and tok.eos_token_id == 4
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = HFTokenizer.from_dir(model_dir)
    assert tok.eos_token_ids == {1, 3, 4} and tok.eos_token_id == 1


def test_load_tokenizer_prefers_tokenizer_json(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert load_tokenizer(tmp_path) is None
    assert "has no tokenizer" in caplog.text and "tokenizer.json" in caplog.text
    shutil.copy(demo_model_dir(tmp_path / "cache") / "tokenizer.model", tmp_path)
    assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)
    build_hf_tokenizer(tmp_path, "qwen2")
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)


def test_bad_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load .*tokenizer.json"):
        load_tokenizer(tmp_path)
    build_hf_tokenizer(tmp_path, "llama3")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with pytest.raises(ValueError, match="bos_token '<nope>' is not in the vocabulary"):
        load_tokenizer(tmp_path)
