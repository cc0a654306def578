"""FLOPs/token, MFU and token accounting on known configurations, computed by hand here."""

from __future__ import annotations

import pytest
import torch

from gpt2.config.schema import MODEL_PRESETS, ModelConfig
from gpt2.model.flops import flops_per_token, hardware_flops_per_token, model_params_for_flops
from gpt2.model.gpt import GPT
from gpt2.observe.metrics import LapTimer, ThroughputMeter, device_peak_tflops


def test_gpt2_large_flops_per_token_by_hand() -> None:
    cfg = ModelConfig(**MODEL_PRESETS["gpt2-large"])
    L, d, V, T = 36, 1280, 50257, 1024
    per_block = 4 * d * d + 4 * d + 8 * d * d + 5 * d + 4 * d  # attn (qkv+proj), mlp (up+down), 2 LNs
    n = L * per_block + 2 * d + V * d  # + ln_f + tied token embedding (the LM head), no wpe
    assert model_params_for_flops(cfg) == n == 772_719_360
    assert flops_per_token(cfg, T) == 6 * n + 12 * L * d * T
    # the target: 55% MFU on 4 x 989 TFLOP/s is ~418k tokens/s
    tok_s = 0.55 * 4 * 989e12 / flops_per_token(cfg, T)
    assert 418_000 < tok_s < 418_500


def test_gpt2_large_hardware_flops_with_checkpointing_by_hand() -> None:
    # Only the 36 blocks are re-run: 2 x 708,387,840 block params + 4 L d T attention forward
    # = 1,416,775,680 + 188,743,680 on top of 5,202,547,200 model FLOPs. The LM head is not re-run,
    # so this is x1.3086, below the whole-model x4/3 (6,936,729,600).
    cfg = ModelConfig(**MODEL_PRESETS["gpt2-large"])
    assert hardware_flops_per_token(cfg, 1024, activation_checkpointing=False) == 5_202_547_200
    assert hardware_flops_per_token(cfg, 1024, activation_checkpointing=True) == 6_808_066_560


def test_flops_parameter_count_matches_real_model() -> None:
    cfg = ModelConfig(n_layer=3, n_head=4, n_embd=96, n_positions=128)
    model = GPT(cfg)
    padding_rows = cfg.padded_vocab_size - cfg.vocab_size
    counted = model.num_params() - model.wpe.weight.numel() - padding_rows * cfg.n_embd
    assert counted == model_params_for_flops(cfg)


def test_meter_excludes_warmup_and_counts_dp_replicas_only() -> None:
    # tp=2 x dp=2 on 4 GPUs: tokens per step counts the 2 replicas, MFU divides by all 4 GPUs
    cfg = ModelConfig(**MODEL_PRESETS["gpt2-large"])
    fpt = flops_per_token(cfg, 1024)
    hw_fpt = hardware_flops_per_token(cfg, 1024, activation_checkpointing=True)
    tokens_per_step = 2 * 8 * 1 * 1024
    meter = ThroughputMeter(tokens_per_step=tokens_per_step, flops_per_token=fpt, hw_flops_per_token=hw_fpt,
                            n_devices=4, peak_tflops=989.0, warmup_steps=2)
    for step, seconds in enumerate([9.0, 9.0, 0.5, 0.5, 0.5], start=1):
        meter.record(step, seconds)
    s = meter.summary()
    assert s["measured_steps"] == 3
    assert s["tokens_per_s"] == pytest.approx(tokens_per_step / 0.5)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(tokens_per_step / 0.5 / 4)
    assert s["mfu"] == pytest.approx(tokens_per_step / 0.5 * fpt / (4 * 989e12))
    assert s["hfu"] == pytest.approx(s["mfu"] * hw_fpt / fpt)


def test_meter_without_measured_steps_reports_none() -> None:
    meter = ThroughputMeter(tokens_per_step=10, flops_per_token=1.0, hw_flops_per_token=1.0, n_devices=1,
                            peak_tflops=None, warmup_steps=5)
    meter.record(1, 1.0)
    assert meter.summary()["tokens_per_s"] is None


def test_peak_table_override_and_unknown_device_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert device_peak_tflops(torch.device("cpu"), override=123.0) == 123.0
    with caplog.at_level("WARNING", logger="gpt2"):
        assert device_peak_tflops(torch.device("cpu")) is None
    assert "--peak-tflops" in caplog.text


@pytest.mark.parametrize(("name", "tflops"), [
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA L40", 181.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
])
def test_peak_table_matches_whole_product_names(name: str, tflops: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Names as torch.cuda.get_device_name() reports them; "L40" must not take L4's peak, "GH200" not H200's by
    accident, "H200 NVL" not the SXM part's."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_tflops(torch.device("cuda", 0)) == tflops


@pytest.mark.parametrize("name", ["NVIDIA L40G", "NVIDIA H1000", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"])
def test_unknown_gpu_warns_and_reports_no_mfu(name: str, caplog: pytest.LogCaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with caplog.at_level("WARNING", logger="gpt2"):
        assert device_peak_tflops(torch.device("cuda", 0)) is None
    assert f"unknown GPU {name!r}" in caplog.text and "--peak-tflops" in caplog.text


def test_laps_between_synchronised_ones_add_up_to_the_wall_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 10.5, 11.0, 13.0])  # restart, then three laps
    monkeypatch.setattr("gpt2.observe.metrics.time.perf_counter", lambda: next(clock))
    timer = LapTimer(torch.device("cpu"))
    laps = [timer.lap(sync=False), timer.lap(sync=False), timer.lap(sync=True)]
    assert laps == [0.5, 0.5, 2.0] and sum(laps) == 13.0 - 10.0


def test_the_meter_reports_each_log_interval_once() -> None:
    meter = ThroughputMeter(tokens_per_step=100, flops_per_token=1.0, hw_flops_per_token=1.0, n_devices=1,
                            peak_tflops=None, warmup_steps=0)
    for step, seconds in enumerate([0.1, 0.1, 0.4], start=1):  # two queued steps, then the synchronised one
        meter.record(step, seconds)
    first = meter.interval()
    assert first["step_time_s"] == pytest.approx(0.2) and first["tokens_per_s"] == pytest.approx(500)
    meter.record(4, 0.3)
    assert meter.interval()["step_time_s"] == pytest.approx(0.3)  # the next interval alone


def test_the_loop_synchronises_only_where_a_window_starts_or_ends(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last warm-up step, log steps, save and evaluation steps (then the timer restarts), the last step; no
    other step waits for the device (a host-bound step would stall there). --profile's write after its last profiled
    step is left out too."""
    import train
    from gpt2.train import loop

    synced: list[bool] = []
    restarts: list[int] = []

    class Recording(LapTimer):
        def lap(self, sync: bool) -> float:
            synced.append(sync)
            return super().lap(sync)

        def restart(self) -> None:
            restarts.append(len(synced))
            super().restart()

    monkeypatch.setattr(loop, "LapTimer", Recording)
    assert train.main(["--model", "gpt2-tiny", "--n-layer", "1", "--seq-len", "16", "--batch-size", "1", "--data",
                       "synthetic", "--device", "cpu", "--max-steps", "14", "--throughput-warmup-steps", "1",
                       "--profile", "--log-interval", "5", "--eval-interval", "7", "--eval-batches", "1",
                       "--save-interval", "11", "--save-dir", str(tmp_path / "ck"), "--out-dir", str(tmp_path / "runs"),
                       "--wandb", "disabled"]) == 0
    # untimed: 1 warm-up + the profiler's warm-up step + 3 profiled steps (2-5); the profile is written after step 5
    assert [step for step, sync in enumerate(synced, start=1) if sync] == [1, 5, 7, 10, 11, 14]
    assert restarts == [0, 5, 7, 11, 14]  # the start, the profile's write, the evaluation, the saves at 11 and 14
