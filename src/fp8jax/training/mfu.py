"""Model FLOPs utilization: the model's training FLOPs per second against the GPU's BF16 peak.

The count is the model's, not the program's: what one training token needs,
whatever the step recomputes (activation checkpointing adds no model FLOPs)
and in whatever precision its GEMMs run. FP8 and BF16 runs are measured
against the same dense BF16 peak, so their MFUs compare as their tokens/s do
(docs/train.md#mfu).
"""

from __future__ import annotations

import jax

from fp8jax.models.gpt import GptConfig

# Dense (no sparsity) BF16 tensor-core peaks, FLOP/s, by ``jax.Device.device_kind``.
# Only GPUs whose datasheet peak is known are listed; any other device has no
# MFU rather than a guessed one.
BF16_PEAK_FLOPS = {
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM
}


def flops_per_token(model: GptConfig, seq_len: int) -> float:
    """Training FLOPs (forward and backward) per token of ``model`` at ``seq_len``.

    Six per weight of every GEMM (two forward; two each for the data and the
    weight gradient): the block projections and the LM head. The embedding
    is a lookup by convention (its one-hot GEMM is an implementation choice)
    and is not counted. Attention adds, per layer, ``2 * seq_len * heads *
    head_dim`` forward for the scores and as many for the weighted sum of the
    values, halved by the causal mask (a query sees ``(seq_len + 1) / 2`` keys
    on average), times three for the backward.

    An MoE model counts its active weights only: each token's ``top_k``
    routed experts, the shared experts and the router, not the experts it
    is not sent to (docs/train.md#mfu).
    """
    h, v, n = model.hidden, model.vocab_size, model.heads
    d = h // n
    # Every block GEMM's weights (norm scales excluded), the active experts only.
    norms = 2 * h * model.layers + h
    matmul_weights = model.num_params(active=True) - norms - v * h
    attention = model.layers * 3 * 4 * n * d * (seq_len + 1) / 2
    return 6.0 * matmul_weights + attention


def peak_flops(devices=None) -> tuple[float | None, str]:
    """``(total dense BF16 FLOP/s, device kind)`` of ``devices`` (default: all of JAX's).

    The total is None when the device kind is not in :data:`BF16_PEAK_FLOPS`
    (a CPU, an unlisted GPU): its MFU is then unknown, not estimated.
    """
    devices = jax.devices() if devices is None else devices
    kind = devices[0].device_kind
    peak = BF16_PEAK_FLOPS.get(kind)
    return (None if peak is None else peak * len(devices)), kind


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """The fraction of ``peak`` FLOP/s that ``tokens_per_s`` tokens of the model use; None
    without a peak."""
    if peak is None or tokens_per_s is None:
        return None
    return tokens_per_s * flops_per_token / peak


def describe(peak: float | None, kind: str, devices: int, value: float | None = None) -> str:
    """The MFU ``value`` (None: only its basis, for a header) with the peak it is against."""
    if peak is None:
        return f"MFU n/a: no known BF16 peak for {kind!r}"
    per_device = peak / devices
    where = f"{devices} x {kind}" if devices > 1 else kind
    shown = "MFU" if value is None else f"MFU {value:.1%}"
    return f"{shown} against the {per_device / 1e12:.0f} TFLOP/s dense BF16 peak of {where}"
