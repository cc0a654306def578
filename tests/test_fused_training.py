"""Training with a fused-kernel backend follows the `none` backend step by step.

CPU: triton (interpreted) vs none, fp32, tiny GPT-2, 20 AdamW steps; the loss curves must agree to
1e-4 absolute at every step (fp32 summation order is the only difference; seen: 3e-6). GPU: triton and cuda vs
none under bf16 autocast, to 3e-2 (bf16 rounding differs between fused and unfused epilogues).
"""

from __future__ import annotations

import pytest
import torch

from fused_kernels import get_ops
from gpt2.config import ModelConfig
from gpt2.model import GPT
from tests._fused_helpers import GPU

STEPS = 20


def _losses(backend: str, device: str, autocast_dtype: torch.dtype | None, cfg: ModelConfig, B: int, T: int):
    torch.manual_seed(0)
    model = GPT(cfg, ops=get_ops(backend)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (4, B, T + 1), generator=gen).to(device)  # 4 batches, cycled
    losses = []
    for step in range(STEPS):
        batch = data[step % 4]
        with torch.autocast(device, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss, _ = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_follows(backend: str, device: str, autocast_dtype, cfg: ModelConfig, B: int, T: int, tol: float):
    ref = _losses("none", device, autocast_dtype, cfg, B, T)
    got = _losses(backend, device, autocast_dtype, cfg, B, T)
    assert ref[-1] < ref[0] - 0.5, f"the reference run did not learn: {ref}"
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    assert max(diffs) <= tol, f"{backend} vs none: max |dloss| {max(diffs):.3g} > {tol}\n{got}\n{ref}"


def test_triton_training_matches_none_cpu():
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _assert_follows("triton", device, None, cfg, B=2, T=16, tol=1e-4)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=GPU), pytest.param("cuda", marks=GPU)])
def test_training_matches_none_gpu_bf16(backend):
    cfg = ModelConfig(n_layer=4, n_head=12, n_embd=768, n_positions=256)  # full GPT-2 vocabulary (padded)
    _assert_follows(backend, "cuda", torch.bfloat16, cfg, B=8, T=256, tol=3e-2)
