"""Beam search through LLM.generate (sequences forked and freed on shared blocks) against
transformers' generate(num_beams=...) on the same random model."""

from __future__ import annotations

import pytest
import torch

from pydaemon import LLM, SamplingParams
from pydaemon._core import Device
from pydaemon.generate_request import GenerateRequest

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 9, 33, 71, 12, 88, 23, 54, 61]  # crosses a block of 8


def _model(seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharp distributions: beams diverge, EOS can win
        ids = list(PROMPT)
        for _ in range(2):
            top = model(torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
            ids.append(top[0])
    # The runner-up of step 2 ends some beams early.
    model.config.eos_token_id = model.generation_config.eos_token_id = top[1]
    return model


def _hf(model, width, num_return, length_penalty, early_stopping, max_new_tokens):
    out = model.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        num_beams=width,
        num_return_sequences=num_return,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [seq[len(PROMPT) :][:n] for seq, n in zip(out.sequences.tolist(), lengths, strict=True)]


@pytest.mark.parametrize(
    "seed,width,num_return,length_penalty,early_stopping,max_new_tokens",
    [(0, 4, 2, 1.0, False, 10), (1, 3, 3, 0.5, True, 8), (2, 4, 4, 1.0, False, 6)],
)
def test_beam_search_matches_transformers(
    tmp_path, seed, width, num_return, length_penalty, early_stopping, max_new_tokens
):
    model = _model(seed)
    model.save_pretrained(tmp_path, safe_serialization=True)
    expected = _hf(model, width, num_return, length_penalty, early_stopping, max_new_tokens)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    params = SamplingParams(
        beam_width=width,
        n=num_return,
        temperature=0.0,
        max_tokens=max_new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params)[0]
    assert [c.token_ids for c in out.outputs] == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks(Device.GPU) == bm.num_total_blocks(Device.GPU)


def test_beams_share_blocks(tmp_path):
    model = _model(0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request(
        GenerateRequest(
            "b",
            PROMPT,
            SamplingParams(beam_width=4, temperature=0.0, max_tokens=8, ignore_eos=True),
        )
    )
    engine.step()
    engine.step()
    request = engine.requests["b"]
    assert len(request.seqs) == 4
    first_blocks = {engine.block_manager.block_table(s.seq_id)[0] for s in request.seqs}
    assert len(first_blocks) == 1  # the prompt's full block is stored once for all beams
    assert engine.block_manager.num_shared_blocks() >= 1
