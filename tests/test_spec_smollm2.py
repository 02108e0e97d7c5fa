"""n-gram speculation on the default model, SmolLM2-135M-Instruct (CPU, float32): chat
requests that copy a quoted passage (where drafts are accepted) and one that does not, batched;
greedy tokens equal decoding without speculation, drafts were accepted and rejected, and every
KV block comes back."""

from __future__ import annotations

import pytest
from engine_utils import all_blocks_free

from pydaemon.entrypoints.llm import LLM
from pydaemon.model_loader.default_model import default_model_path
from pydaemon.sampling_params import SamplingParams

try:
    MODEL_PATH = default_model_path()
except ValueError as e:  # pragma: no cover - the setup script installs it
    pytest.skip(str(e), allow_module_level=True)

PASSAGE = (
    "To install the package, download the archive, unpack it into a folder of your choice, "
    "and run the setup script from that folder."
)
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat the following text exactly.\n\nText: {PASSAGE}"}],
    [{"role": "user", "content": f"Rewrite the text below without changing a word.\n\n{PASSAGE}"}],
    [{"role": "user", "content": "Name three colours."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _chat(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.chat(CONVERSATIONS, GREEDY)]


def test_ngram_on_smollm2_matches_plain_decoding():
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    plain = _chat(LLM(str(MODEL_PATH), **kwargs))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "auto_disable": False}
    llm = LLM(str(MODEL_PATH), speculative_config=spec, **kwargs)
    assert _chat(llm) == plain
    stats = llm.engine.core.get_stats().spec_decode
    assert stats.num_accepted_tokens > 8  # the copies were drafted and kept
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some drafts rejected
    assert all_blocks_free(llm)
