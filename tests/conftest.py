import zlib

import pytest
import torch

import ltx_kernels

CUDA_AVAILABLE = torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device: GPU tests run on a machine with an H100/H200"


def pytest_configure(config):
    if ltx_kernels.load_error is not None:
        raise pytest.UsageError(f"ltx_kernels extension failed to load: {ltx_kernels.load_error}")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "gpu" in item.keywords and not CUDA_AVAILABLE:
            item.add_marker(skip_gpu)


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=_devices())
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different but reproducible seed per test: fresh random inputs, never zeros.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _restore_diffusers_attention_backend():
    # diffusers' set_attention_backend also sets the process-wide active backend, which every
    # attention without its own backend then uses: restored after each test, so that no test's
    # backend leaks into the next (seen: HunyuanVideo-1.5's bf16 bit-identity after a test that
    # set _native_math).
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:  # no diffusers: nothing to restore
        yield
        return
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


@pytest.fixture
def int8_at_every_length(monkeypatch):
    # The tiny models' and tests' calls are far shorter than the lengths from which
    # attention="int8" attends in 8 bits on a GPU (injector.LTX_INT8_ATTENTION_FASTER): on a GPU,
    # tests that exercise the 8-bit path take it at every length. (The rule itself:
    # test_inject_int8_attention.test_int8_follows_the_measured_table.)
    from ltx_kernels.integration import injector

    monkeypatch.setitem(injector.LTX_INT8_ATTENTION_FASTER, (9, 0), ((64, 0), (128, 0)))
    if CUDA_AVAILABLE:  # (attention._int8_measured_faster is a constant in compiled graphs)
        torch._dynamo.reset()
