"""Issue 55 item 18: `pagedd serve`'s configuration errors name the flags the user gave
(`--swap-space`), not EngineConfig's fields (`EngineConfig.swap_space`); the offline LLM(...)
keeps the field names its caller wrote."""

from __future__ import annotations

import pytest

from pydaemon.config.engine import EngineConfig
from pydaemon.entrypoints.cli import main
from pydaemon.entrypoints.daemon.flag_names import with_flag_names


@pytest.mark.parametrize(
    "message, expected",
    [
        ("EngineConfig.swap_space must be >= 0 (GiB) (got -1.0)",
         "--swap-space must be >= 0 (GiB) (got -1.0)"),
        ("max_num_batched_tokens (4) must be >= max_num_seqs (8)",
         "--max-num-batched-tokens (4) must be >= --max-num-seqs (8)"),
        ("kv_offloading_size (--kv-offloading-size) 0.001 GiB holds no KV block",
         "--kv-offloading-size 0.001 GiB holds no KV block"),
        ("EngineConfig.device must be one of auto, cpu, cuda (got 'tpu')",
         "--device must be one of auto, cpu, cuda (got 'tpu')"),
        ("EngineConfig.kv_offloading_disk_size must be a number of GiB > 0 and <= 1048576 "
         "(--kv-offloading-disk-size) (got nan)",
         "--kv-offloading-disk-size must be a number of GiB > 0 and <= 1048576 (got nan)"),
        ("EngineConfig.kv_offloading_size must be a number of GiB >= 0 (--kv-offloading-size; "
         "0 or None: no CPU tier)",
         "--kv-offloading-size must be a number of GiB >= 0 (0 or None: no CPU tier)"),
        # one-word fields are words elsewhere; a flag already given stays as it is
        ("the model has no tokenizer", "the model has no tokenizer"),
        ("--max-model-len 99999 is more than the model's", "--max-model-len 99999 is more than the model's"),
    ],
)  # fmt: skip
def test_messages_name_the_flags(message, expected):
    assert with_flag_names(message) == expected


def test_serve_prints_the_flag_and_exits_2(capsys):
    assert main(["serve", "--model", "demo", "--swap-space", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "pagedd serve: --swap-space must be >= 0 (GiB) (got -1.0)"
    with pytest.raises(ValueError, match=r"^EngineConfig\.swap_space must be >= 0"):
        EngineConfig(swap_space=-1)  # offline: the field, as the caller wrote it
