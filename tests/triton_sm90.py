"""Test helper: a Triton kernel compiled ahead of time for sm_90 (Hopper) without a GPU, as the
JIT would compile it on an H200 (Triton's compiler and its bundled ptxas need no device)."""

from __future__ import annotations

import pytest

HOPPER_SHARED_MEMORY = 227 * 1024  # bytes a block may use on sm_90


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    """fn compiled for sm_90 (pointers, sizes and strides that are multiples of 16 marked so,
    as the JIT specializes them). Skips before Triton 3.4 (another compile API) and in a
    process where TRITON_INTERPRET is set."""
    import triton

    if not hasattr(triton, "knobs"):
        pytest.skip("Triton's compile API differs before 3.4")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set for this process")
    div16 = [n for n in signature if n.endswith("_ptr") or n in ("N", "K") or "stride" in n]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(
        fn=fn,
        signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
        constexprs=constexprs,
        attrs=attrs,
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
