"""A small decoder-only language model built from fp8jax's Linen modules.

Token embedding -> ``layers`` x :class:`fp8jax.flax.linen.TransformerLayer`
(causal, RoPE, RMSNorm, SwiGLU, no biases; scanned with ``nn.scan``) -> final
RMSNorm -> LM head. In ``precision="fp8"`` every block GEMM (QKV, attention
output, both MLP GEMMs; 4 forward, 8 backward) is FP8; the embedding, the
attention core and the LM head stay BF16, as in TransformerEngine recipes.
``precision="bf16"`` swaps each block for
:class:`~fp8jax.models.bf16_layer.Bf16TransformerLayer`, which has the same
parameters and runs the same GEMMs in BF16: same key, same initial weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fp8jax.flax import FP8_COLLECTION, _attention
from fp8jax.flax import linen as fnn
from fp8jax.flax._common import BATCH, EMBED, LENGTH, RESIDUAL
from fp8jax.flax._moe import MoEConfig
from fp8jax.models.bf16_layer import Bf16TransformerLayer
from fp8jax.recipes import Recipe
from fp8jax.sharding import constrain

PRECISIONS = ("fp8", "bf16")
# Activation checkpointing of each block (docs/design.md#activation-checkpointing):
# what the forward keeps for the backward; everything else is recomputed there.
REMAT_POLICIES = {
    "none": None,  # no checkpointing: every residual is kept
    # The projections' GEMM outputs; the FP8 casts of their operands are
    # recomputed from them (and from the f32 kernels) in the backward.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,  # only each block's input
}
VOCAB = "vocab"  # logical axis name of the embedding's and LM head's vocabulary axis


class ByteEmbed(nn.Module):
    """The token embedding, looked up as a one-hot matmul.

    ``jnp.take``'s gradient is a scatter-add of every token's row into
    ``vocab_size`` rows: on the H200 it took a tenth of the ``medium`` step,
    all of it in atomic updates of 256 rows (docs/design.md#the-gpt-model).
    With 256 tokens the
    one-hot product is cheap, its gradient is a GEMM that accumulates in
    f32, and the forward result is the same (each output is one table entry
    times 1). Same parameter name and initializer as ``nn.Embed``.
    """

    num_embeddings: int
    features: int
    embedding_init: Any
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.param(
            "embedding", self.embedding_init, (self.num_embeddings, self.features), jnp.float32
        )
        one_hot = jax.nn.one_hot(tokens, self.num_embeddings, dtype=self.dtype)
        return jnp.dot(one_hot, table.astype(self.dtype), preferred_element_type=self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptConfig:
    """Model shape. Every GEMM dimension is a multiple of 16, as Hopper FP8 GEMMs need.

    Attributes:
      hidden: model width.
      layers: transformer blocks.
      heads: attention heads (head_dim = hidden // heads).
      ffn: SwiGLU inner width (about 8/3 of hidden).
      kv_heads: key/value heads (GQA); None means heads.
      vocab_size: 256 for bytes.
      experts: routed experts per MoE layer; 0 (the default) makes every
        layer's feed-forward a dense SwiGLU MLP. Otherwise each layer after
        the first ``dense_layers`` is a :class:`fp8jax.flax.linen.MoEBlock`
        (router in f32, SwiGLU experts ``expert_ffn`` wide).
      top_k: experts per token.
      expert_ffn: each expert's inner width; None means ``ffn``.
      shared_experts: always-on experts per MoE layer, each ``expert_ffn`` wide.
      dense_layers: the first layers keep a dense MLP ``ffn`` wide (DeepSeek's first layer).
      capacity_factor: None (dropless) or the MoE blocks' capacity factor.
    """

    hidden: int
    layers: int
    heads: int
    ffn: int
    kv_heads: int | None = None
    vocab_size: int = 256
    experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    capacity_factor: float | None = None

    def __post_init__(self):
        for field in ("hidden", "layers", "heads", "ffn", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GptConfig.{field} must be an int >= 1, got {value!r}.")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"GptConfig.heads={self.heads} must divide hidden={self.hidden} into an even "
                "head_dim (RoPE rotates pairs of features)."
            )
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"GptConfig.top_k must be in [1, experts={self.experts}], got {self.top_k!r}."
            )
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(
                f"GptConfig.dense_layers must be in [0, layers={self.layers}], got "
                f"{self.dense_layers!r}."
            )

    @property
    def moe_layers(self) -> int:
        """Layers whose feed-forward is an MoE block."""
        return self.layers - self.dense_layers if self.experts else 0

    def _layer_params(self, moe: bool, active: bool) -> int:
        h, f, d = self.hidden, self.ffn, self.hidden // self.heads
        kv = self.kv_heads or self.heads
        attention = h * (self.heads + 2 * kv) * d + self.heads * d * h + 2 * h
        if not moe:
            return attention + 3 * h * f
        fe = self.expert_ffn or f
        routed = self.top_k if active else self.experts
        return attention + 3 * h * fe * (routed + self.shared_experts) + h * self.experts

    def num_params(self, active: bool = False) -> int:
        """Parameters, embedding and LM head included; ``active``: those one token uses
        (its ``top_k`` routed experts, not all of them)."""
        dense = self.layers - self.moe_layers
        blocks = dense * self._layer_params(False, active)
        blocks += self.moe_layers * self._layer_params(True, active)
        return blocks + 2 * self.vocab_size * self.hidden + self.hidden


class _Block(nn.Module):
    """One layer, in the (carry, x) -> (carry, y) form nn.scan wants."""

    precision: str
    kwargs: dict

    @nn.compact
    def __call__(self, h, _):
        layer = fnn.TransformerLayer if self.precision == "fp8" else Bf16TransformerLayer
        # An explicit name: both layer classes must create their params under
        # the same scope, so the same key gives the same initial weights.
        return layer(**self.kwargs, name="layer")(h), None


class Gpt(nn.Module):
    """Decoder-only LM over bytes: ``tokens (batch, seq) int -> logits (batch, seq, vocab)``.

    Attributes:
      config: the model shape.
      precision: ``"fp8"`` (block GEMMs in FP8) or ``"bf16"``.
      recipe: the FP8 recipe (CurrentScaling, DelayedScaling); None: CurrentScaling.
      attention_implementation: passed to ``jax.nn.dot_product_attention``
        (None is XLA; ``"cudnn"`` on a GPU; ``"fp8"``: fp8jax's FP8 attention).
      attention_hadamard: with ``"fp8"``, rotate queries and keys by a fixed
        randomized Hadamard matrix before quantizing (the op's ``hadamard``).
      remat: activation checkpointing of each block, a key of
        :data:`REMAT_POLICIES`: ``"none"`` keeps every residual, ``"dots"``
        keeps the projections' GEMM outputs and recomputes the rest
        (their FP8 operands included),
        ``"full"`` keeps only each block's input
        (docs/design.md#activation-checkpointing).
      unroll_layers: unroll the scan over layers (the default). A rolled
        scan stacks every layer's saved activations in ``(layers, ...)``
        buffers, and XLA's GPU backend copies each slot in and out: GEMMs
        and cuDNN attention cannot read or write a dynamic slice of a loop
        buffer in place. In a deviceless H200 compile of the ``medium`` train
        step that was 45 GB of copies and 25 GB of zero-fill per step, about
        half of all bytes written; unrolled, the step ran about 20% faster on
        an H200 in BF16 and FP8 alike (docs/design.md#the-gpt-model). The
        parameters are stacked either way. The costs: compile
        time (7 s to about 50 s for ``medium``, deviceless), and under FSDP
        XLA gathers each kernel once and keeps it from the forward to the
        backward, where the rolled scan gathered it again: fewer all-gathers,
        but every layer's gathered kernel is alive at the peak. For
        ``medium`` on two H200s (``fsdp=2``) the peak still fell (13.9 to
        13.3 GiB per GPU, FP8), as the rolled scan's stacks went away; set
        False where a larger model's kernels do not fit.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from fp8jax.models.gpt import Gpt, GptConfig
      >>> model = Gpt(config=GptConfig(hidden=32, layers=2, heads=2, ffn=64))
      >>> tokens = jnp.zeros((2, 16), jnp.int32)
      >>> variables = jax.jit(model.init)(jax.random.key(0), tokens)
      >>> model.apply(variables, tokens).shape
      (2, 16, 256)
    """

    config: GptConfig
    precision: str = "fp8"
    recipe: Recipe | None = None
    attention_implementation: str | None = None
    attention_hadamard: bool = False
    unroll_layers: bool = True
    remat: str = "none"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"Gpt.precision must be one of {PRECISIONS}, got {self.precision!r}.")
        _attention.check_hadamard("Gpt", self.attention_hadamard, self.attention_implementation)
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"Gpt.remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}."
            )
        if self.precision == "bf16" and self.recipe is not None:
            raise ValueError("Gpt: precision='bf16' runs no FP8 GEMM; pass recipe=None with it.")
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        init = nn.initializers.normal(stddev=0.02)
        embed = ByteEmbed(
            c.vocab_size,
            c.hidden,
            embedding_init=nn.with_logical_partitioning(init, (VOCAB, EMBED)),
            name="embed",
        )
        # Under fp8jax.sharding.use_mesh: batch over dp/fsdp, so FSDP gathers weights.
        h = constrain(embed(tokens), RESIDUAL)
        kwargs = {
            "num_heads": c.heads,
            "intermediate_dim": c.ffn,
            "num_kv_heads": c.kv_heads,
            "activations": ("silu", "linear"),
            "norm_type": "rmsnorm",
            "causal": True,
            "use_rope": True,
            "use_bias": False,
            "attention_implementation": self.attention_implementation,
            "attention_hadamard": self.attention_hadamard,
        }
        if self.precision == "fp8":
            kwargs |= {"recipe": self.recipe, "dtype": jnp.bfloat16}
        block = _Block
        if self.remat != "none":
            # Inside the scan no common-subexpression pass can undo the
            # recompute, so no optimization barrier is needed (prevent_cse).
            block = nn.remat(_Block, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        for i in range(c.dense_layers if c.experts else 0):  # before the scan over MoE layers
            h, _ = block(self.precision, kwargs, name=f"dense_{i}")(h, None)
        if c.experts:
            fp8 = self.precision == "fp8"
            moe = MoEConfig(c.experts, c.top_k, shared_experts=c.shared_experts, fp8=fp8,
                            capacity_factor=c.capacity_factor)  # fmt: skip
            kwargs |= {"moe": moe, "intermediate_dim": c.expert_ffn or c.ffn}
        # The MoE blocks sow their load-balancing loss and routing statistics:
        # one value per layer where the caller makes those collections mutable.
        stack = nn.scan(
            block,
            variable_axes={"params": 0, FP8_COLLECTION: 0, "intermediates": 0, "moe_stats": 0},
            split_rngs={"params": True},
            length=c.layers - (c.dense_layers if c.experts else 0),
            unroll=c.layers if self.unroll_layers else 1,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        h, _ = stack(self.precision, kwargs, name="blocks")(h, None)
        h = fnn.LayerNorm(norm_type="rmsnorm", dtype=jnp.bfloat16, name="final_norm")(h)
        logits = nn.Dense(
            c.vocab_size,
            use_bias=False,
            dtype=jnp.bfloat16,
            kernel_init=nn.with_logical_partitioning(init, (EMBED, VOCAB)),
            name="lm_head",
        )(h)
        return constrain(logits, (BATCH, LENGTH, None))


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits`` (any float dtype) against int ``targets``, in f32."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()
