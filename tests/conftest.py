"""Shared test setup: hypothesis profiles and the GPU skip rule.

HYPOTHESIS_PROFILE=ci (default): derandomized, few examples, reproducible in CI.
HYPOTHESIS_PROFILE=dev: more, random examples for local bug hunting.
Tests marked ``gpu`` are skipped when torch sees no CUDA device.
"""
import os

import pytest
import torch

# Kernels compile for Hopper even on a CPU-only machine; the DSL reads this at import time.
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda():
    """The CUDA device; skips the test when there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
