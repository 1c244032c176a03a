"""Small models and synthetic data for the trainer, demos, tests and benchmarks."""

from __future__ import annotations

from lm_resiliency.models.gpt import GPTConfig, SyntheticTokens, TinyGPT, synthetic_batches

__all__ = ["GPTConfig", "SyntheticTokens", "TinyGPT", "synthetic_batches"]
