"""The CUDA error gate and NVRTC compilation (CPU only: no GPU, no driver)."""

from __future__ import annotations

import types

import pytest

from ubnext._environment.cuda import check, drv, nvrtc_compile
from ubnext._protocol.errors import CudaError

driver = pytest.importorskip("cuda.bindings.driver")
runtime = pytest.importorskip("cuda.bindings.runtime")
nvrtc = pytest.importorskip("cuda.bindings.nvrtc")

KERNEL = r"""
#include "scale.cuh"
extern "C" __global__ void scale(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = ubnext_scale(x[i]);
}
"""
HEADERS = {"scale.cuh": "__device__ inline float ubnext_scale(float v) { return 2.f * v; }\n"}


@pytest.mark.parametrize(
    "success",
    [driver.CUresult.CUDA_SUCCESS, runtime.cudaError_t.cudaSuccess, nvrtc.nvrtcResult.NVRTC_SUCCESS],
)
def test_check_success_unpacks_values(success):
    assert check((success,), "f") is None
    assert check((success, 7), "f") == 7
    assert check((success, 1, "b"), "f") == (1, "b")


def test_check_driver_error():
    err = driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as info:
        check((err, None), "cuMemCreate")
    assert info.value.call == "cuMemCreate"
    assert info.value.code == int(err)
    assert str(info.value).startswith("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY")


def test_check_runtime_error():
    err = runtime.cudaError_t.cudaErrorMemoryAllocation
    with pytest.raises(CudaError) as info:
        check((err, None), "cudaMalloc")
    assert info.value.code == int(err)
    assert str(info.value) == "cudaMalloc: cudaErrorMemoryAllocation: out of memory"


def test_check_nvrtc_error():
    err = nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION
    with pytest.raises(CudaError) as info:
        check((err,), "nvrtcCompileProgram")
    assert str(info.value) == "nvrtcCompileProgram: NVRTC_ERROR_INVALID_OPTION"


def test_drv_uses_the_injected_driver():
    calls = []

    def cuThing(a, b):
        calls.append((a, b))
        return (driver.CUresult.CUDA_SUCCESS, a + b)

    def cuBroken():
        return (driver.CUresult.CUDA_ERROR_INVALID_VALUE, None)

    fake = types.SimpleNamespace(cuThing=cuThing, cuBroken=cuBroken)
    assert drv("cuThing", 2, 3, driver=fake) == 5
    assert calls == [(2, 3)]
    with pytest.raises(CudaError, match="^cuBroken: CUDA_ERROR_INVALID_VALUE"):
        drv("cuBroken", driver=fake)


def test_nvrtc_compiles_cubin_for_sm90a_without_gpu():
    image = nvrtc_compile(KERNEL, "scale.cu", ["--gpu-architecture=sm_90a"], HEADERS)
    assert image[:4] == b"\x7fELF"


def test_nvrtc_ptx_for_virtual_arch():
    ptx = nvrtc_compile(KERNEL, "scale.cu", ["-arch=compute_90a", "-std=c++17"], HEADERS)
    assert b".target sm_90a" in ptx
    assert b".entry scale" in ptx


def test_nvrtc_syntax_error_carries_the_log():
    with pytest.raises(CudaError) as info:
        nvrtc_compile("__global__ void broken( {", "broken.cu", ["--gpu-architecture=sm_90a"])
    assert info.value.call == "nvrtcCompileProgram"
    assert info.value.code == int(nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION)
    message = str(info.value)
    assert message.startswith("nvrtcCompileProgram: NVRTC_ERROR_COMPILATION compiling broken.cu")
    assert "broken.cu(1): error" in message


def test_nvrtc_missing_header_is_a_compile_error():
    with pytest.raises(CudaError, match="scale.cuh"):
        nvrtc_compile(KERNEL, "scale.cu", ["--gpu-architecture=sm_90a"])


def test_nvrtc_bad_option():
    with pytest.raises(CudaError) as info:
        nvrtc_compile(KERNEL, "scale.cu", ["--no-such-option"], HEADERS)
    assert info.value.code == int(nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION)
