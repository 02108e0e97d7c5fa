"""The Triton SGMV kernels (pydaemon/layers/lora/punica_triton.py) on CPU tensors under
Triton's interpreter, case by case, against a float64 per-token loop and ``add_lora_torch``.

Run by tests/test_lora_triton.py as ``TRITON_INTERPRET=1 python tests/lora_triton_interp.py``
in a subprocess (the variable must be set before the kernels are decorated, and must not leak
into the pytest process, where other tests may compile Triton kernels for the GPU); prints one
JSON line: {"interpreted": bool, "cases": {name: {"ok": bool, "msg": str}}}. ``CASES`` (the
names) is importable without triton.
"""

from __future__ import annotations

import itertools
import json

import torch
from lora_utils import reference_add_lora_loop as reference

NUM_SLOTS = 6  # adapter slots; the weights hold one more (the zero slot, for -1)
PARTS = {"qkv": (64, 16, 16), "gate_up": (32, 32), "o": (64,), "wide": (200, 72, 40)}
# token slots: 4 adapters and no adapter, unsorted, slots 4 and 5 without a token; one token
# (with and without an adapter); every token in one slot; no token with an adapter.
SLOT_CASES = {
    "mixed": [3, -1, 0, 3, 1, -1, 0, 0, 2, 3, 1, -1, 3, 2, 0, 1, 1, -1, 3, 0, 2, 2, 1],
    "one": [2],
    "one_none": [-1],
    "one_slot": [5] * 19,
    "none": [-1] * 9,
}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# (rtol, atol): the kernels round xa to the dtype (expand's dot) and y + delta once.
TOL = {"f32": (1e-4, 1e-5), "f16": (4e-3, 4e-3), "bf16": (3e-2, 3e-2)}


def _cases() -> dict[str, dict]:
    cases = {}
    for d, t, p in itertools.product(DTYPES, (1, 17, 65, 130), PARTS):
        cases[f"{d}-T{t}-{p}"] = {"dtype": d, "tokens": t, "parts": p}
    for d, s in itertools.product(DTYPES, SLOT_CASES):
        cases[f"{d}-{s}-qkv"] = {"dtype": d, "slots": s, "parts": "qkv"}
    for d, split in itertools.product(("f32", "bf16"), (1, 3)):  # in = 2.5 K-blocks
        cases[f"{d}-in320-split{split}"] = {"dtype": d, "tokens": 65, "parts": "qkv",
                                            "in": 320, "split_k": split}  # fmt: skip
    cases["bf16-rank8"] = {"dtype": "bf16", "tokens": 65, "parts": "qkv", "rank": 8}
    cases["f32-40slots"] = {"dtype": "f32", "tokens": 130, "parts": "wide", "slots_n": 40}
    return cases


CASES = _cases()


def _run(case: dict, seed: int) -> tuple[bool, str]:
    from pydaemon.layers.lora.punica_torch import add_lora_torch
    from pydaemon.layers.lora.punica_triton import add_lora_triton

    dtype, sizes = DTYPES[case["dtype"]], PARTS[case["parts"]]
    rank, in_features = case.get("rank", 16), case.get("in", 64)
    num_slots = case.get("slots_n", NUM_SLOTS)
    g = torch.Generator().manual_seed(seed)
    n, starts = len(sizes), (0, *itertools.accumulate(sizes))
    lora_a = torch.randn(num_slots + 1, n * rank, in_features, generator=g) * in_features**-0.5
    lora_b = torch.randn(num_slots + 1, rank, starts[-1], generator=g) * 0.2
    lora_a[num_slots] = 0
    lora_b[num_slots] = 0
    for j in range(n):  # slot 0: an adapter of rank 8 zero-padded to ``rank``
        lora_a[0, j * rank + 8 : (j + 1) * rank] = 0
    lora_b[0, 8:] = 0
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    if "slots" in case:
        token_slots = torch.tensor(SLOT_CASES[case["slots"]])
    else:  # unsorted: no adapter and slots 0..3 (0..all for many slots); others get no token
        high = num_slots if num_slots > NUM_SLOTS else 4
        token_slots = torch.randint(-1, high, (case["tokens"],), generator=g)
    x = torch.randn(token_slots.shape[0], in_features, generator=g).to(dtype)
    y0 = torch.randn(token_slots.shape[0], starts[-1], generator=g).to(dtype)
    y = y0.clone()
    add_lora_triton(y, x, token_slots, lora_a, lora_b, starts, split_k=case.get("split_k"))
    rtol, atol = TOL[case["dtype"]]
    try:
        want = reference(y0, x, token_slots, lora_a, lora_b, starts)
        torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)
        dense = y0.clone()
        add_lora_torch(dense, x, token_slots, lora_a, lora_b, starts)
        torch.testing.assert_close(y, dense, rtol=rtol, atol=atol)
        skipped = token_slots < 0
        assert torch.equal(y[skipped], y0[skipped]), "a row without an adapter changed"
    except AssertionError as e:
        return False, str(e)
    return True, ""


def main() -> None:
    from pydaemon.layers.lora import punica_triton_kernels

    results = {}
    for i, (name, case) in enumerate(CASES.items()):
        ok, msg = _run(case, seed=i)
        results[name] = {"ok": ok, "msg": msg}
    print(json.dumps({"interpreted": punica_triton_kernels.INTERPRETED, "cases": results}))


if __name__ == "__main__":
    main()
