"""Efficiency figures: the GPU peak table, model FLOPs, MFU arithmetic, and one rank's meter."""

import time

import pytest
import torch
from torch import nn

from trainflow.efficiency import (
    EfficiencyMeter,
    batch_work,
    matmul_params,
    mfu,
    peak_bf16_flops,
    training_flops,
)


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
    ],
)
def test_gpu_names_map_to_their_own_peak(name, flops):
    assert peak_bf16_flops(name) == flops


@pytest.mark.parametrize("name", ["Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA A1000", "cpu", ""])
def test_unknown_gpus_and_near_names_have_no_peak(name):
    # "A1000" contains "A100" and "A10", but names no device in the table.
    assert peak_bf16_flops(name) is None


def test_model_flops_count_linear_weights_and_attention():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert matmul_params(model) == 8 * 16 + 16 * 4  # the embedding lookup costs no FLOPs
    assert training_flops(1000) == 6000
    assert training_flops(1000, num_layers=2, hidden_size=8, seq_len=4) == 6000 + 12 * 2 * 8 * 4
    assert training_flops(1000, num_layers=2, hidden_size=8) == 6000  # no sequence: no term


def test_mfu_is_achieved_over_peak_flops_of_all_devices():
    # A 1B-parameter model at 10k tokens/s on 2 devices of 100 TFLOP/s: 6e9 * 1e4 / 2e14.
    assert mfu(6e9, 1e4, 100e12, 2) == pytest.approx(0.3)


def test_language_model_batches_count_only_real_tokens():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
    }
    assert batch_work(batch) == (2, 4)
    assert batch_work({"input_ids": torch.ones(3, 5, dtype=torch.long)}) == (3, 15)
    assert batch_work(torch.zeros(7, 2)) == (7, 0)


def test_meter_on_one_cpu_process_reports_plausible_figures_without_gpu_ones():
    meter = EfficiencyMeter(torch.device("cpu"), flops_per_token=6e6)
    meter.start()
    for _ in range(3):
        with meter.data_wait():
            time.sleep(0.01)
        meter.count(4, 100)
        time.sleep(0.03)
        meter.step()
    meter.pause()
    time.sleep(0.2)  # a validation pass: not part of the window
    meter.resume()
    figures = meter.report()
    assert set(figures) == {
        "eff_samples_per_s",
        "eff_tokens_per_s",
        "eff_step_time_s",
        "eff_data_wait_share",
        "eff_peak_memory_mb",
    }
    assert 0.04 <= figures["eff_step_time_s"] < 0.1
    assert figures["eff_tokens_per_s"] == pytest.approx(25 * figures["eff_samples_per_s"])
    assert 0.1 < figures["eff_data_wait_share"] < 0.5
    assert figures["eff_peak_memory_mb"] > 10


def test_meter_without_steps_reports_nothing():
    assert EfficiencyMeter(torch.device("cpu")).report() == {}


def test_only_the_time_a_batch_takes_to_arrive_is_a_data_wait():
    meter = EfficiencyMeter(torch.device("cpu"))

    def slow_loader():
        for i in range(3):
            time.sleep(0.05)
            yield i

    for _batch in meter.timed(slow_loader()):
        time.sleep(0.02)  # the step: not a wait
        meter.count(1)
        meter.step()
    assert meter.steps == 3 and meter.samples == 3
    assert 0.15 <= meter.waited_s < 0.2
    assert meter.report()["eff_data_wait_share"] == pytest.approx(
        meter.waited_s / meter.elapsed_s()
    )


def test_a_pause_between_steps_leaves_the_window():
    meter = EfficiencyMeter(torch.device("cpu"))
    meter.start()
    meter.step()
    meter.pause()
    time.sleep(0.2)
    meter.resume()
    meter.step()
    assert meter.elapsed_s() < 0.05
