"""UAQ, update-aware quantization (QuRL sec. 4.3): a one-time, function-preserving reparametrization (ALGORITHMS.md,
"UAQ: update-aware quantization"; docs/algorithms.md, "UAQ: details").

For every decoder layer: multiply the input RMSNorm weight by `s` and divide the q/k/v projection weights by `s`;
likewise the post-attention RMSNorm and the gate/up projections. RMSNorm output feeds those projections linearly,
so the logits are unchanged (to fp32 rounding), but the learner then trains weights that are `s` times smaller for
the same function: an optimizer step of the same size is `s` times larger relative to the weight, while the
per-channel quantization error (proportional to the weight's scale) shrinks by `s`.

Also the per-step metrics of QuRL eqs. 13-14: `norm_update = ||theta_{k+1} - theta_k||^2 / ||theta_k||^2` and
`norm_quant_err = ||Q(theta_k) - theta_k||^2 / ||theta_k||^2`, globally and per layer type.
"""

from __future__ import annotations

import torch

from quant_sync import native
from quant_sync.quantizers import dequantize_published

NORM_TO_LINEARS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


@torch.no_grad()
def apply_uaq(model: torch.nn.Module, scale: float) -> int:
    """Reparametrize a Llama-family model in place; returns the number of decoder layers changed."""
    if scale == 1.0:
        return 0
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    for layer in layers:
        for norm_name, linear_names in NORM_TO_LINEARS.items():
            getattr(layer, norm_name).weight.mul_(scale)
            for dotted in linear_names:
                module = layer
                for part in dotted.split("."):
                    module = getattr(module, part)
                module.weight.div_(scale)  # every input column; biases act after the matmul and stay
    return len(layers)


def layer_type(name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `q_proj`; used to group metrics by layer type."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else name


def _squared_error(value: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scheme: str) -> tuple[float, float]:
    """(||dequantized - value||^2, ||value||^2) of one published tensor: one C++ pass a row for int8 per-row scales
    (`quant_sync.native`), else torch's ops in chunks of ~8 MiB (not whole-tensor copies)."""
    if scheme == "int8" and scale.dim() == 1 and q.shape == value.shape and native.takes(value):
        return native.int8_row_errors(value, q, scale)
    rows = max(1, 2**21 // max(value[0].numel(), 1))
    err = norm = 0.0
    for lo in range(0, value.shape[0], rows):
        part = value[lo : lo + rows].detach().to(torch.float32)
        residual = dequantize_published(q[lo : lo + rows], scale[lo : lo + rows], scheme).sub_(part)
        # fp32 within a row (a few thousand terms), float64 across rows: 4x cheaper than float64 throughout
        err += float(residual.mul_(residual).sum(-1).double().sum())
        norm += float((part * part).sum(-1).double().sum())
    return err, norm


def quant_error_by_type(
    state: dict[str, torch.Tensor], published: dict[str, torch.Tensor], scheme: str = "int8"
) -> dict[str, float]:
    """norm_quant_err over all quantized linears and per layer type, from the published (q, scale) pairs."""
    sums: dict[str, list[float]] = {}
    for name, value in state.items():
        scale = published.get(name + "_scale")
        if scale is None:
            continue
        err, norm = _squared_error(value, published[name], scale, scheme)
        for key in ("all", layer_type(name)):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += err
            acc[1] += norm
    return {
        ("norm_quant_err" if key == "all" else f"norm_quant_err/{key}"): err / norm if norm else 0.0
        for key, (err, norm) in sums.items()
    }
