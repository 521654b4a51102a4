# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the codebook usage / perplexity metrics over an evaluation run."""

from __future__ import annotations

import math

import pytest
import torch
from ignite.engine import Engine
from torch import nn

from common.vqgan.metrics import CodebookMetric, codebook_metrics
from common.vqgan.networks import VQGAN, EMAVectorQuantizer

N_CODES = 8
CODES = torch.tensor([[10.0 * k, -5.0 * k] for k in range(N_CODES)])
# two batches; overall code counts: 0 x 3, 1 x 3, 2 x 1, 5 x 1 (codes 3, 4, 6, 7 unused)
ASSIGNMENTS = [[0, 0, 1, 5], [1, 1, 2, 0]]
COUNTS = [3, 3, 1, 0, 0, 1, 0, 0]


def _quantizer() -> EMAVectorQuantizer:
    q = EMAVectorQuantizer(N_CODES, 2)
    with torch.no_grad():
        q.embeddings.copy_(CODES)
        q.embed_sum.copy_(CODES)
        q.cluster_size.fill_(1.0)
        q.initialized.fill_(True)
    return q.eval()


def _batches() -> list[torch.Tensor]:
    """Latents ``(1, 2, 4, 1, 1)`` whose voxels lie near the codes of ``ASSIGNMENTS``."""
    return [(CODES[a] + 0.3).t().reshape(1, 2, len(a), 1, 1) for a in ASSIGNMENTS]


def _evaluator(q: nn.Module, quantizer: EMAVectorQuantizer) -> Engine:
    def step(engine, batch):
        with torch.no_grad():
            return quantizer(batch)["indices"]

    engine = Engine(step)
    CodebookMetric(q, "usage").attach(engine, "usage")
    CodebookMetric(q, "perplexity").attach(engine, "perplexity")
    return engine


def _expected_perplexity(counts: list[int]) -> float:
    total = sum(counts)
    return math.exp(-sum(c / total * math.log(c / total) for c in counts if c))


def test_metrics_equal_usage_and_perplexity_of_the_assigned_codes():
    q = _quantizer()
    engine = _evaluator(q, q)
    state = engine.run(_batches(), max_epochs=1)
    assert q.usage_counts.tolist() == COUNTS
    assert state.metrics["usage"] == 4 / 8
    assert state.metrics["perplexity"] == pytest.approx(_expected_perplexity(COUNTS), rel=1e-6)
    assert state.metrics["perplexity"] == pytest.approx(
        math.exp(-(2 * 0.375 * math.log(0.375) + 2 * 0.125 * math.log(0.125)))
    )


def test_histogram_is_reset_at_the_start_of_each_run():
    q = _quantizer()
    engine = _evaluator(q, q)
    q.usage_counts.fill_(100)  # stale counts from somewhere else must not leak in
    first = dict(engine.run(_batches(), max_epochs=1).metrics)
    second = dict(engine.run(_batches(), max_epochs=1).metrics)
    assert first == second
    assert q.usage_counts.tolist() == COUNTS  # one run's counts, not two
    # a run on only the first batch reports that batch alone
    only_first = engine.run(_batches()[:1], max_epochs=1).metrics
    assert only_first["usage"] == 3 / 8
    assert only_first["perplexity"] == pytest.approx(_expected_perplexity([2, 1, 0, 0, 0, 1, 0, 0]), rel=1e-6)


def test_metric_reads_the_quantizer_of_a_vqgan():
    torch.manual_seed(0)
    model = VQGAN(n_hiddens=4, norm_num_groups=4, downsample=[2, 2, 2], embedding_dim=2, n_codes=N_CODES)
    with torch.no_grad():
        model.quantizer.embeddings.copy_(CODES)
    model.eval()
    metrics = codebook_metrics(model)
    assert set(metrics) == {"val_codebook_usage", "val_perplexity"}
    assert metrics["val_codebook_usage"].statistic == "usage" and metrics["val_perplexity"].statistic == "perplexity"
    assert all(m.quantizer is model.quantizer for m in metrics.values())
    assert set(codebook_metrics(model, prefix="test_")) == {"test_codebook_usage", "test_perplexity"}
    engine = Engine(lambda e, batch: model.quantize(batch)["indices"])
    for name, metric in metrics.items():
        metric.attach(engine, name)
    state = engine.run(_batches(), max_epochs=1)
    assert state.metrics["val_codebook_usage"] == 0.5
    assert state.metrics["val_perplexity"] == pytest.approx(_expected_perplexity(COUNTS), rel=1e-6)


def test_training_steps_do_not_count():
    q = _quantizer()
    engine = Engine(lambda e, batch: q.train()(batch)["indices"])
    CodebookMetric(q, "usage").attach(engine, "usage")
    assert engine.run(_batches(), max_epochs=1).metrics["usage"] == 0.0


def test_invalid_statistic_and_module_are_errors():
    with pytest.raises(ValueError, match="statistic must be 'usage' or 'perplexity', got 'entropy'"):
        CodebookMetric(_quantizer(), "entropy")
    with pytest.raises(TypeError, match=r"Linear does not count code usage \(no 'usage_counts'\)"):
        CodebookMetric(nn.Linear(2, 2))
