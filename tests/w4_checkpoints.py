"""Test helpers: tiny 4-bit checkpoints written by hand from a float checkpoint, following
each format's specification (not pagedd's code), and the float64 reference of what each
quantized weight stands for, unpacked from the written tensors by plain loops.

Formats (``fmt``): "awq" (AutoAWQ GEMM: qweight [K, N/8] packed along N in the order 0 2 4 6
1 3 5 7, qzeros likewise, fp16 scales [K/G, N]); "gptq" (qweight [K/8, N] packed along K,
qzeros [K/G, N/8] stored minus one, fp16 scales, g_idx [K]; ``desc_act``: groups over a
random column order; ``v2``: zeros stored as they are); "ct" (compressed-tensors
pack-quantized: weight_packed [N, K/8] of signed values + 8, weight_scale [N, K/G], packed
weight_zero_point [ceil(N/8), K/G] when asymmetric, weight_shape, weight_g_idx with actorder
"group"); "mxfp4" (gpt-oss experts: <experts>.gate_up_proj_blocks [E, 2I, H/32, 16] with
gate/up rows interleaved, _scales, and down_proj_*; only the experts are quantized).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_quantized_linear(name: str) -> bool:
    parts = name.split(".")
    return name.endswith(".weight") and parts[-2] in LINEARS and "lm_head" not in name


def rtn(w: torch.Tensor, columns: list[list[int]], sym: bool):
    """Round-to-nearest of w [N, K] per group (``columns[g]``: its input columns) -> (q [N, K]
    int64 0..15, scales [N, G'] float16, zeros [N, G'] int64), computed as the formats'
    quantizers do: symmetric scale amax / 7.5 with zero 8; asymmetric (max - min) / 15."""
    n, k = w.shape
    q = torch.zeros(n, k, dtype=torch.int64)
    scales = torch.zeros(n, len(columns), dtype=torch.float16)
    zeros = torch.zeros(n, len(columns), dtype=torch.int64)
    for g, cols in enumerate(columns):
        block = w[:, cols].double()
        if sym:
            s = (block.abs().amax(dim=1) / 7.5).clamp(min=1e-8)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = block.amin(dim=1).clamp(max=0), block.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = torch.round(-lo / s).long().clamp(0, 15)
        s = s.half()
        scales[:, g] = s
        zeros[:, g] = z
        q[:, cols] = torch.round(block / s.double()[:, None] + z[:, None]).long().clamp(0, 15)
    return q, scales, zeros


def pack_words(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """values 0..15, packed 8 to an int32 along ``dim``: nibble i of word c holds element
    8c + order[i]."""
    v = values.movedim(dim, -1).long()
    out = torch.zeros(*v.shape[:-1], v.shape[-1] // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        out |= v[..., j::8] << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.movedim(-1, dim).contiguous()


def _copy_extras(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True)
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    return config


def write_int4_checkpoint(
    src: Path,
    dst: Path,
    fmt: str,
    group: int | None = 32,
    sym: bool = False,
    desc_act: bool = False,
    v2: bool = False,
    unquantized: tuple[str, ...] = (),
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Rewrites ``src`` (float) as a 4-bit ``fmt`` checkpoint in ``dst``; linear modules named
    in ``unquantized`` stay as they are (and config.json names them as the format does). ->
    linear weight name -> the float64 weight the written tensors stand for."""
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, reference = {}, {}
    orders: dict[tuple[str, str], list[int]] = {}  # act-order: one per input (q/k/v share it)
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if not is_quantized_linear(name) or prefix in unquantized:
            out[name] = t  # as it is (the dequantized twin keeps it too)
            continue
        n, k = t.shape
        g = group or k
        if desc_act:
            parent, _, part = prefix.rpartition(".")
            shares = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}
            key = (parent, shares.get(part, part))
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen).tolist()
            order = orders[key]
            columns = [order[i : i + g] for i in range(0, k, g)]
            g_idx = torch.empty(k, dtype=torch.int32)
            for gi, cols in enumerate(columns):
                g_idx[cols] = gi
        else:
            columns = [list(range(i, i + g)) for i in range(0, k, g)]
            g_idx = (torch.arange(k) // g).to(torch.int32)
        q, scales, zeros = rtn(t, columns, sym)
        reference[name] = (q - zeros[:, g_idx.long()]).double() * scales.double()[:, g_idx.long()]
        if fmt == "awq":
            out[f"{prefix}.qweight"] = pack_words(q.t(), 1, AWQ_ORDER)  # [K, N / 8]
            out[f"{prefix}.qzeros"] = pack_words(zeros.t(), 1, AWQ_ORDER)  # [K / G, N / 8]
            out[f"{prefix}.scales"] = scales.t().contiguous()  # [K / G, N]
        elif fmt == "gptq":
            out[f"{prefix}.qweight"] = pack_words(q.t(), 0)  # [K / 8, N]
            stored = zeros if v2 else (zeros - 1) & 0xF
            out[f"{prefix}.qzeros"] = pack_words(stored.t(), 1)  # [K / G, N / 8]
            out[f"{prefix}.scales"] = scales.t().contiguous()
            out[f"{prefix}.g_idx"] = g_idx
        elif fmt == "ct":
            signed = q - 8  # the compressor quantizes to -8..7, then stores value + 8
            out[f"{prefix}.weight_packed"] = pack_words(signed + 8, 1)  # [N, K / 8]
            out[f"{prefix}.weight_scale"] = scales.to(torch.bfloat16).float().to(torch.bfloat16)
            reference[name] = (q - zeros[:, g_idx.long()]).double() * out[
                f"{prefix}.weight_scale"
            ].double()[:, g_idx.long()]
            if not sym:
                stored = (zeros - 8) + 8  # the signed zero point, stored + 8 like the values
                pad = -n % 8
                zp = torch.cat([stored, torch.zeros(pad, stored.shape[1], dtype=stored.dtype)])
                out[f"{prefix}.weight_zero_point"] = pack_words(zp, 0)  # [ceil(N / 8), K / G]
            out[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if desc_act:
                out[f"{prefix}.weight_g_idx"] = g_idx
        else:
            raise ValueError(fmt)
    config = _copy_extras(src, dst)
    config["torch_dtype"] = "bfloat16" if fmt == "ct" else "float16"
    config["quantization_config"] = int4_quantization_config(fmt, group, sym, desc_act, v2,
                                                             unquantized)  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    return reference


def int4_quantization_config(fmt, group, sym, desc_act, v2, unquantized) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group or -1, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": list(unquantized) or None}  # fmt: skip
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": "gptq_v2" if v2 else "gptq"}  # fmt: skip
        if unquantized:
            qc["dynamic"] = {f"-:{name}$".replace(".", r"\."): {} for name in unquantized}
        return qc
    weights = {"num_bits": 4, "type": "int", "symmetric": sym,
               "strategy": "group" if group else "channel", "group_size": group,
               "actorder": "group" if desc_act else None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },  # fmt: skip
        "ignore": ["lm_head", "re:.*mlp.gate$", *unquantized],
    }


def e2m1_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] 0..15, e8m0 scales [N, K / 32]), block scale 2^ceil(log2(
    amax / 6)), nearest e2m1 magnitude by a plain search."""
    n, k = w.shape
    blocks = w.double().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=2).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = blocks / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1, dtype=torch.float64)
    mag = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)
    codes = mag + 8 * (scaled < 0).long()
    return codes.reshape(n, k), (exponent + 127).to(torch.uint8)


def e2m1_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., K], e8m0 [..., K / 32] -> float64 weights."""
    values = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)[codes.long()]
    return values * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=-1)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Rewrites a float MoE checkpoint (Qwen-style experts.{e}.gate_proj / up_proj /
    down_proj) with gpt-oss's MXFP4 expert tensors. -> "<experts prefix>.w13" / ".w2" -> the
    float64 [E, N, K] weights they stand for (w13: gate rows then up rows)."""
    tensors = load_file(str(src / "model.safetensors"))
    out, reference, experts = {}, {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            i = parts.index("experts")
            prefix, e = ".".join(parts[: i + 1]), int(parts[i + 1])
            experts.setdefault(prefix, {}).setdefault(e, {})[parts[-2]] = t
        else:
            out[name] = t
    for prefix, by_expert in experts.items():
        num = len(by_expert)
        gate_up_codes, gate_up_scales, down_codes, down_scales = [], [], [], []
        for e in range(num):
            gc, gs = e2m1_quantize(by_expert[e]["gate_proj"])
            uc, us = e2m1_quantize(by_expert[e]["up_proj"])
            # interleave rows: gate j -> 2j, up j -> 2j + 1
            gate_up_codes.append(torch.stack([gc, uc], dim=1).reshape(-1, gc.shape[1]))
            gate_up_scales.append(torch.stack([gs, us], dim=1).reshape(-1, gs.shape[1]))
            dc, ds = e2m1_quantize(by_expert[e]["down_proj"])
            down_codes.append(dc)
            down_scales.append(ds)
        for proj, codes, scales in (("gate_up_proj", gate_up_codes, gate_up_scales),
                                    ("down_proj", down_codes, down_scales)):  # fmt: skip
            c = torch.stack(codes)  # [E, N, K]
            s = torch.stack(scales)
            low, high = c[..., 0::2], c[..., 1::2]
            packed = (low | (high << 4)).to(torch.uint8)  # [E, N, K / 2]
            e_, n_, half = packed.shape
            out[f"{prefix}.{proj}_blocks"] = packed.reshape(e_, n_, half // 16, 16)
            out[f"{prefix}.{proj}_scales"] = s
            ref = e2m1_reference(c, s)
            if proj == "gate_up_proj":
                ref = torch.cat([ref[:, 0::2], ref[:, 1::2]], dim=1)
            reference[f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}"] = ref
    config = _copy_extras(src, dst)
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.gate",
            "model.embed_tokens",
            "lm_head",
        ],  # fmt: skip
    }
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    return reference


def write_dequantized_checkpoint(src: Path, dst: Path, reference: dict[str, torch.Tensor]) -> None:
    """``src`` (float) with each quantized weight replaced by its reference (float32)."""
    tensors = load_file(str(src / "model.safetensors"))
    experts = {}
    for key, w in reference.items():
        if key.endswith((".w13", ".w2")):
            experts[key] = w
        else:
            tensors[key] = w.float()
    for key, w in experts.items():
        prefix, proj = key.rsplit(".", 1)
        for e in range(w.shape[0]):
            if proj == "w13":
                half = w.shape[1] // 2
                tensors[f"{prefix}.{e}.gate_proj.weight"] = w[e, :half].float()
                tensors[f"{prefix}.{e}.up_proj.weight"] = w[e, half:].float()
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = w[e].float()
    config = _copy_extras(src, dst)
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))


def logit_error(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(root-mean-square, max) of |got - ref| over the logits, relative to ref's standard
    deviation."""
    diff, std = (got.double() - ref.double()), ref.double().std()
    return float(diff.pow(2).mean().sqrt() / std), float(diff.abs().max() / std)
