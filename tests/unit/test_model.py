"""The model: Hugging Face parity, GPT-2 initialisation, vocab padding, activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch

from gpt2.config.schema import ModelConfig
from gpt2.model.gpt import GPT
from gpt2.model.hf_weights import hf_config_for, hf_to_ours, ours_to_hf

TINY = dict(n_layer=2, n_head=4, n_embd=64, n_positions=64)


def _hf_model(cfg: ModelConfig):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(hf_config_for(cfg)).eval()


@pytest.mark.parametrize("pad_vocab", [True, False])
def test_logits_match_transformers(pad_vocab: bool) -> None:
    cfg = ModelConfig(**TINY, pad_vocab=pad_vocab)
    hf = _hf_model(cfg)
    ours = GPT(cfg).eval()
    ours.load_state_dict(hf_to_ours(hf.state_dict(), cfg))
    idx = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        expected = hf(idx).logits
        got = ours(idx)
    assert got.shape == expected.shape == (2, 37, cfg.vocab_size)
    assert (got - expected).abs().max().item() <= 1e-5


def test_export_round_trip_to_transformers() -> None:
    cfg = ModelConfig(**TINY)
    torch.manual_seed(1)
    ours = GPT(cfg).eval()
    hf = _hf_model(cfg)
    hf.load_state_dict(ours_to_hf(ours.state_dict(), cfg))
    idx = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert (hf(idx).logits - ours(idx)).abs().max().item() <= 1e-5


def test_loss_matches_cross_entropy_and_padding_is_invisible() -> None:
    """Padded vocab rows never change the loss, whatever their weights."""
    padded = ModelConfig(**TINY, pad_vocab=True)
    plain = ModelConfig(**TINY, pad_vocab=False)
    assert padded.padded_vocab_size == 50304 and plain.padded_vocab_size == 50257
    torch.manual_seed(2)
    a = GPT(padded)
    b = GPT(plain)
    sd = a.state_dict()
    sd_plain = {k: (v[: plain.vocab_size] if k in ("wte.weight", "lm_head.weight") else v) for k, v in sd.items()}
    b.load_state_dict(sd_plain)
    with torch.no_grad():
        a.wte.weight[plain.vocab_size:] = 100.0  # huge padded logits would dominate if not masked
    idx = torch.randint(0, plain.vocab_size, (2, 16))
    tgt = torch.randint(0, plain.vocab_size, (2, 16))
    loss_a, correct_a = a(idx, tgt)
    loss_b, correct_b = b(idx, tgt)
    logits = b(idx)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, plain.vocab_size), tgt.reshape(-1))
    assert torch.allclose(loss_a, loss_b, atol=1e-6) and torch.allclose(loss_b, ref, atol=1e-6)
    assert correct_a == correct_b == (logits.argmax(-1) == tgt).sum()


def test_gpt2_initialisation_statistics() -> None:
    cfg = ModelConfig(n_layer=8, n_head=4, n_embd=256, n_positions=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    block = model.blocks[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 1e-3
    assert abs(block.mlp.c_fc.weight.std().item() - 0.02) < 1e-3
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert abs(block.attn.c_proj.weight.std().item() - resid_std) < 5e-4
    assert abs(block.mlp.c_proj.weight.std().item() - resid_std) < 5e-4
    assert block.attn.c_attn.bias.abs().max() == 0
    assert model.lm_head.weight is model.wte.weight
    # a fresh model predicts ~uniformly: first loss close to ln(vocab)
    idx = torch.randint(0, cfg.vocab_size, (4, 64))
    loss, _ = model(idx, torch.roll(idx, -1, 1))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_activation_checkpointing_gives_same_gradients() -> None:
    cfg = ModelConfig(**TINY)
    torch.manual_seed(3)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    grads = []
    for ac in (False, True):
        model.zero_grad()
        model.activation_checkpointing = ac
        loss, _ = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=1e-7)
