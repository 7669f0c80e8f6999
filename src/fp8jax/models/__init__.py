"""Models built from fp8jax's Flax modules: a small GPT for ``fp8jax train``."""

from fp8jax.models.bf16_layer import Bf16TransformerLayer
from fp8jax.models.gpt import Gpt, GptConfig, next_token_loss

__all__ = ["Bf16TransformerLayer", "Gpt", "GptConfig", "next_token_loss"]
