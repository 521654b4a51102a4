# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One rule for which way every bundle's key metric improves, and one split of the validation metrics into the key
metric and the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import UserError
from common.metrics.key_metric import additional_metrics, key_metric_mode, key_val_metric, metric_cmp_fn

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name", ["val_loss", "loss", "val_proj_error", "val_ibs", "ibs", "val_brier_2", "brier_1.5", "val_brier_5y"]
)
def test_lower_is_better(name: str) -> None:
    assert key_metric_mode(name) == "min"
    assert metric_cmp_fn(name)(0.1, 0.2) and not metric_cmp_fn(name)(0.2, 0.2) and not metric_cmp_fn(name)(0.3, 0.2)


@pytest.mark.parametrize(
    "name", ["val_psnr", "val_ssim", "val_ms_ssim", "uno_c", "harrell_c", "val_auc_2", "auc_1.5", "val_codebook_usage"]
)
def test_higher_is_better(name: str) -> None:
    assert key_metric_mode(name) == "max"
    assert metric_cmp_fn(name)(0.3, 0.2) and not metric_cmp_fn(name)(0.2, 0.2) and not metric_cmp_fn(name)(0.1, 0.2)


def test_every_bundle_reads_the_rule_from_one_place() -> None:
    """No bundle config states a min/max rule or a mode: the handlers derive it from ``key_metric``, and every
    evaluator ranking by a key metric takes its ``metric_cmp_fn`` from the shared function."""
    import json

    def nodes(value):
        if isinstance(value, dict):
            yield value
            for v in value.values():
                yield from nodes(v)
        elif isinstance(value, list):
            for v in value:
                yield from nodes(v)

    for config in sorted(p for p in REPO.glob("bundles/*/configs/*.json") if p.name != "metadata.json"):
        text = config.read_text()
        assert "endswith('loss')" not in text and "lambda current, prev" not in text, config
        assert "key_metric_mode" not in text and "metric_name" not in text, config
        for node in nodes(json.loads(text)):
            target = str(node.get("_target_", ""))
            if target.endswith(("MetricsRecorder", "BestCheckpointSaver")):
                assert "mode" not in node, f"{config}: {target} derives its mode from key_metric"
            if "key_val_metric" in node and target:
                cmp_fn = node.get("metric_cmp_fn", {})
                assert cmp_fn.get("_target_") == "common.metrics.key_metric.metric_cmp_fn", f"{config}: {target}"


def test_the_key_metric_and_the_others_partition_the_validation_metrics() -> None:
    metrics = {"val_psnr": object(), "val_ssim": object(), "val_ms_ssim": object()}
    key, others = key_val_metric(metrics, "val_ssim"), additional_metrics(metrics, "val_ssim")
    assert key == {"val_ssim": metrics["val_ssim"]}
    assert others == {"val_psnr": metrics["val_psnr"], "val_ms_ssim": metrics["val_ms_ssim"]}
    assert list(others) == ["val_psnr", "val_ms_ssim"]  # the validation order is kept
    with pytest.raises(
        UserError, match=r"key_metric 'val_dice' is not one of the validation metrics \['val_ms_ssim', "
    ):
        key_val_metric(metrics, "val_dice")
