"""Shared test setup: hypothesis profiles, the GPU skip rule, and ``standin`` (the public API
run on CPU with the fp32 oracle in place of the kernel).

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

from flash_cute import dispatch, interface  # noqa: E402 (after CUTE_DSL_ARCH is set)
from flash_cute.reference import attention_ref  # noqa: E402

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


@pytest.fixture
def standin(monkeypatch):
    """Run the public API on CPU with dispatch.fwd = the reference; records each call."""
    calls = []

    def fwd(q, k, v, *, dropout_p=0.0, max_seqlen_q=None, max_seqlen_k=None,
            learnable_sink=None, **kw):
        calls.append(dict(q=q, k=k, v=v, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                          learnable_sink=learnable_sink, **kw))
        sink = None if learnable_sink is None else learnable_sink.detach().float()
        out, lse = attention_ref(q, k, v, sink=sink, **kw)
        # dispatch.fwd returns out contiguous, and the op's fake impl says so to torch.compile.
        return out.contiguous(), lse

    monkeypatch.setattr(interface, "_REQUIRE_CUDA", False)
    monkeypatch.setattr(dispatch, "fwd", fwd)
    return calls
