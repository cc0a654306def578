"""Repro: Inductor computes a wrong training forward for a GPT-2 of width 1280 compiled as one graph.

The harness's GPT (`gpt2.model.gpt.GPT`, 2 blocks, d=1280, 20 heads, tied embedding; nothing else of the harness)
under bf16 autocast, batch 8 x 1024 random tokens: the loss and the tied embedding's gradient of
`torch.compile(model)` against the same weights run eagerly, with Inductor's defaults and with
`loop_ordering_after_fusion` off. Seen on one H100, torch 2.11.0+cu130: the defaults give a step-0 loss of 11.041
against 11.081 and a 26% error in the embedding's gradient; `aot_eager` is exact, and so is Inductor with
`loop_ordering_after_fusion=False` or `inplace_buffers=False`; width 768, or one block, is exact. A compact
nanoGPT-style model of the same shape did not reproduce it (H200), so the graph's exact form matters.
The harness turns loop re-ordering off for every compile (gpt2/runtime/compiling.py).

    python benchmarks/repro/inductor_loop_ordering_inplace.py     # exit 1 while the bug is present
"""

import sys
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gpt2.config.schema import ModelConfig  # noqa: E402
from gpt2.model.gpt import GPT  # noqa: E402


def loss_and_grad(model: GPT, fn, idx: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = fn(idx, targets)
    loss.backward()
    return loss.item(), model.wte.weight.grad.float().clone()


def main() -> int:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=20, n_embd=1280)).cuda()
    idx, targets = torch.randint(0, 50257, (2, 8, 1024), device="cuda")
    ref_loss, ref_grad = loss_and_grad(model, model, idx, targets)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}: eager loss {ref_loss:.5f}")
    bad = False
    for setting in (True, False):
        torch._dynamo.reset()
        torch._inductor.config.loop_ordering_after_fusion = setting
        loss, grad = loss_and_grad(model, torch.compile(model), idx, targets)
        err = ((grad - ref_grad).norm() / ref_grad.norm()).item()
        wrong = abs(loss - ref_loss) > 5e-3 or err > 0.05  # bf16 noise: ~1e-5 in the loss, ~0.5% in the gradient
        bad |= wrong and setting
        print(f"loop_ordering_after_fusion={setting!s:5}: loss {loss:.5f}, wte grad rel err {err:.4f}"
              f" -> {'WRONG' if wrong else 'ok'}")
    print("BUG PRESENT" if bad else "no bug")
    return int(bad)


if __name__ == "__main__":
    sys.exit(main())
