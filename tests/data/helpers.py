"""Tiny random Llama targets and a counting target provider for the data tests."""

from __future__ import annotations

import torch


def tiny_llama(tokenizer, *, seed: int = 0, eos_boost: float = 1.0):
    """A random 2-layer Llama (hidden 32) over the tokenizer's vocabulary, fp32, eval mode.

    ``eos_boost`` scales the EOS row of the (untied) LM head, so that greedy decoding ends some
    responses early and not others: the EOS logit becomes large whenever it is positive.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_boost
    return model


class CountingTarget:
    """A target provider that counts how often it is called and how often ``generate`` runs.

    ``fail_after``: raise RuntimeError on the generate call after that many (a simulated crash).
    """

    def __init__(self, model, tokenizer, fail_after: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.provided = 0
        self.generate_calls = 0
        self.fail_after = fail_after
        original = model.generate

        def generate(*args, **kwargs):
            if self.fail_after is not None and self.generate_calls >= self.fail_after:
                raise RuntimeError("simulated interruption")
            self.generate_calls += 1
            return original(*args, **kwargs)

        model.generate = generate

    def __call__(self):
        self.provided += 1
        return self.model, self.tokenizer
