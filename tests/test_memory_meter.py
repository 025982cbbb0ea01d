"""The activation meter counts saved-for-backward bytes (not weights) and releases them after backward."""

import torch

from lightning_distmm.parallel.memory import ActivationMeter


def test_meter_counts_activations_linearly_and_frees_them():
    net = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 100))
    meter = ActivationMeter()
    per_sample = []
    for batch in (64, 128):
        with meter.track():
            loss = net(torch.randn(batch, 100)).sum()
        per_sample.append(meter.live / batch)
        loss.backward()
        assert meter.live == 0
    assert per_sample[0] == per_sample[1] == 800  # input + ReLU output, 100 floats each; weights not counted
    assert meter.peak == 128 * 800
