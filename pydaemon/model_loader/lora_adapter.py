"""The weights of a LoRA adapter in PEFT's format (its config and header are checked first
by pydaemon/config/lora.py), read whole and checked tensor by tensor."""

from __future__ import annotations

import torch
from safetensors import safe_open

from pydaemon.config.lora import LORA_KEY, WEIGHTS_FILE, LoRAAdapterConfig, LoRAAdapterError

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def load_lora_weights(
    config: LoRAAdapterConfig, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """-> (layer index, module name) -> (lora_A [r, in], lora_B [out, r] times the module's
    scaling), on the CPU in ``dtype`` (the scaling applied in float32 first).

    Raises LoRAAdapterError when the file cannot be read whole (truncated, replaced, not
    safetensors), a tensor is not floating point or holds a NaN or an infinity, the scaled
    update B @ A could leave ``dtype``'s range, or a shape differs from the one ``config`` was
    checked with."""
    where = f"LoRA adapter {str(config.path)!r}"
    expected = {key: (a, b) for key, a, b in config.shapes}
    pairs: dict[tuple[int, str], list] = {}
    try:
        with safe_open(str(config.path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                match = LORA_KEY.match(key)
                if match is None:
                    raise LoRAAdapterError(f"{where}: unexpected tensor {key!r}")
                pair = pairs.setdefault((int(match[1]), match[2]), [None, None])
                # A copy: the tensor may map the file, which could be replaced under it.
                pair[0 if match[3] == "A" else 1] = f.get_tensor(key).clone()
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own errors for bad files
        raise LoRAAdapterError(
            f"{where}: {WEIGHTS_FILE} cannot be read ({type(e).__name__}); is it complete?"
        ) from None
    if set(pairs) != set(expected):
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} changed since its header was checked")
    weights = {}
    for key, (lora_a, lora_b) in pairs.items():
        name = f"{where}: layer {key[0]} {key[1]}"
        for which, tensor, shape in (
            ("A", lora_a, expected[key][0]),
            ("B", lora_b, expected[key][1]),
        ):
            if tensor is None:
                raise LoRAAdapterError(f"{name}: lora_{which} is missing")
            if tensor.dtype not in _FLOAT_DTYPES:
                raise LoRAAdapterError(
                    f"{name}: lora_{which} is {tensor.dtype}, not floating point"
                )
            if tuple(tensor.shape) != tuple(shape):
                raise LoRAAdapterError(
                    f"{name}: lora_{which} is {list(tensor.shape)}, its header said {list(shape)}"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise LoRAAdapterError(f"{name}: lora_{which} holds NaN or infinite values")
        scaling = config.scaling(lora_a.shape[0])
        a, b = lora_a.to(dtype), (lora_b.float() * scaling).to(dtype)
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise LoRAAdapterError(f"{name}: its weights (B times {scaling:g}) overflow {dtype}")
        # The update the adapter adds to the layer's weight, B @ A (scaled), must be finite in
        # the serving dtype too: values of 1e30 are, their products are not (the outputs were
        # NaN). Entry (i, j) is at most |row i of B| * |column j of A| (Cauchy-Schwarz), so
        # the bound costs O((out + in) * r), not the product's O(out * in * r).
        bound = float(b.double().norm(dim=1).max() * a.double().norm(dim=0).max())
        limit = torch.finfo(dtype).max
        if not bound <= limit:
            raise LoRAAdapterError(
                f"{name}: lora_B @ lora_A (B times {scaling:g}) may reach {bound:.3g}, beyond "
                f"{dtype}'s range ({limit:.3g}): its outputs would be infinite or NaN"
            )
        weights[key] = (a, b)
    return weights
