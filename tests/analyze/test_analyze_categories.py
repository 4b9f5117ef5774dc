"""Name rules: kernel categories of real Hopper/PyTorch kernel names, short names, host ranges."""

from __future__ import annotations

import pytest

from tracetrain.profile.analyze.bound import gemm_shape
from tracetrain.profile.analyze.categories import (
    collective_of,
    is_comm_range,
    is_data_range,
    is_pageable_copy,
    is_sync_op,
    is_sync_runtime,
    kernel_category,
    phase_of,
    short_kernel_name,
)

REAL_KERNELS = [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "gemm"),
    (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "gemm",
    ),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "gemm",
    ),
    ("Kernel2", "gemm"),
    (
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, false, __nv_bfloat16, "
        "__nv_bfloat16, false, false, false>(cublasLt::cublasSplitKParams<float>, float const*)",
        "gemm",
    ),
    ("triton_tem_fused_mm_0", "gemm"),
    (
        "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int, float, float, float, float, "
        "false, true, true, false, 7, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, "
        "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >("
        "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched"
        "<float const>, cublasGemvTensorStridedBatched<float>, float>)",
        "gemm",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "elementwise",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
        "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#1}::"
        "operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, ...)",
        "elementwise",
    ),
    ("triton_poi_fused_add_mul_silu_0", "elementwise"),
    ("flash_fwd_kernel", "attention"),
    (
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
        "2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>"
        " >, true, false, false, false, false, true, false, false>(pytorch_flash::Flash_bwd_params)",
        "attention",
    ),
    (
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t,"
        " cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "attention",
    ),
    (
        "void cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0",
        "attention",
    ),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    (
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float*, "
        "float*>(...)",
        "optimizer",
    ),
    ("_adamw_kernel", "optimizer"),  # tracetrain's own AdamW update (kernels/adamw_triton.py)
    (
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
        "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)",
        "normalisation",
    ),
    ("void at::native::(anonymous namespace)::rms_norm_kernel<float>(...)", "normalisation"),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}"
        ">, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, ...>)",
        "reduction",
    ),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "reduction",
    ),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "reduction"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>", "elementwise"),
    # From a real H200 trace (torch 2.11, CUDA 13): cuBLAS nvjet, cuDNN SDPA and its helpers.
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "gemm"),
    (
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_0",
        "attention",
    ),
    (
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, void*, "
        "unsigned int, unsigned int, unsigned int, unsigned int)",
        "attention",
    ),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)", "attention"),
    (
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float, 32u, "
        "32u, 256u, false, true, false>(long, long, c10::BFloat16 const*, c10::BFloat16 const*, float const*, "
        "float const*, c10::BFloat16*, c10::BFloat16*)",
        "normalisation",
    ),
    (
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>(float*, "
        "float const*, int, int, int, bool const*, int, bool)",
        "reduction",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<8, at::native::AUnaryFunctor<c10::BFloat16, "
        "c10::BFloat16, c10::BFloat16, at::native::binary_internal::DivFunctor<c10::BFloat16> >, "
        "std::array<char*, 2ul> >(int, ...)",
        "elementwise",
    ),
    ("some_custom_kernel", "other"),
]


@pytest.mark.parametrize("name, category", REAL_KERNELS)
def test_real_kernel_names_get_their_category(name, category):
    assert kernel_category(name, "kernel") == category


# Inductor kernel names from real profiles: before mid-2023 every kernel was `triton_` plus Triton's
# argument specialisation (the first five are names seen in published profiler tables and NaN-tracing
# reports of torch 2.0-2.3 runs); since then `triton_<kind>_<fused ops>_<n>`.
INDUCTOR_KERNELS = [
    ("triton__0d1d2d3d4d5d6d78d9d", "elementwise"),
    ("triton__0d1d2d", "elementwise"),
    ("triton__0d1d2d3d4e5de", "elementwise"),
    ("triton__0d1d2d3de", "elementwise"),
    ("triton__0d1d2", "elementwise"),
    ("triton_", "elementwise"),  # unique_kernel_names off, Triton without the signature suffix
    ("triton_fused_add_mul_0d1d2de", "elementwise"),
    ("triton_fused_native_layer_norm_0d1d2d3d4d5de6de", "normalisation"),  # the fused op's name decides
    ("triton_poi_fused_add_cos_sin_0", "elementwise"),  # HTA's triton_example trace
    ("triton_per_fused__softmax_1", "reduction"),
    ("triton_for_fused_0", "optimizer"),  # horizontal foreach fusion: a compiled optimizer step
    ("triton_spl_fused_cumsum_0", "reduction"),
    ("triton_unk_fused_add_mean_0", "elementwise"),
    ("triton_tem_fused_flex_attention_0", "attention"),
]


@pytest.mark.parametrize("name, category", INDUCTOR_KERNELS)
def test_inductor_kernel_names_old_and_new(name, category):
    assert kernel_category(name, "kernel") == category


def test_user_triton_kernels_are_not_taken_for_inductor_ones():
    # A hand-written Triton kernel keeps its own name; the generic rule matches Inductor's shapes only.
    assert kernel_category("_rms_norm_fwd_triton", "kernel") == "normalisation"
    assert kernel_category("_fwd_kernel_triton_0d1d2d", "kernel") == "other"


@pytest.mark.parametrize(
    "name, category",
    [
        ("Memcpy HtoD (Pageable -> Device)", "memcpy_h2d"),
        ("Memcpy DtoH (Device -> Pinned)", "memcpy_d2h"),
        ("Memcpy DtoD (Device -> Device)", "memcpy_d2d"),
        ("Memcpy PtoP (Device -> Device)", "memcpy_d2d"),
    ],
)
def test_copies_by_direction(name, category):
    assert kernel_category(name, "memcpy") == category
    assert kernel_category("Memset (Device)", "memset") == "memset"


def test_pageable_copies_are_recognised():
    assert is_pageable_copy("Memcpy HtoD (Pageable -> Device)")
    assert not is_pageable_copy("Memcpy DtoH (Device -> Pinned)")


def test_short_names_drop_noise_and_keep_the_functor():
    short = short_kernel_name(REAL_KERNELS[7][0])
    assert short == "vectorized_elementwise_kernel<4, CUDAFunctor_add<…>, std::array<…> >"
    assert short_kernel_name("flash_fwd_kernel") == "flash_fwd_kernel"
    assert short_kernel_name(REAL_KERNELS[14][0]) == "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    assert len(short_kernel_name(REAL_KERNELS[16][0])) <= 90
    assert not short_kernel_name(REAL_KERNELS[16][0]).startswith(("void", "at::native"))


def test_host_range_rules():
    assert is_data_range("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__")
    assert is_data_range("tracetrain/data_wait") and is_data_range("_next_data")
    assert not is_data_range("ProfilerStep#3") and not is_data_range("aten::mm")
    assert is_sync_runtime("cudaStreamSynchronize") and is_sync_runtime("cudaMemcpy")
    assert not is_sync_runtime("cudaMemcpyAsync") and not is_sync_runtime("cudaLaunchKernel")
    assert is_sync_op("aten::item") and is_sync_op("aten::_local_scalar_dense")
    assert is_comm_range("c10d::allreduce_") and is_comm_range("nccl:all_reduce")
    assert not is_comm_range("aten::add")


@pytest.mark.parametrize(
    "name, phase",
    [
        ("tracetrain/forward", "forward"),
        ("tracetrain/backward", "backward"),
        ("tracetrain/optimizer", "optimizer"),
        ("tracetrain/data_wait", "data_wait"),
        ("tracetrain/checkpoint", "checkpoint"),
        ("## forward ##", "forward"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        ("Optimizer.zero_grad#AdamW.zero_grad", "optimizer"),
        ("tracetrain/eval", "eval"),
        ("ProfilerStep#4", None),
        ("aten::mm", None),
    ],
)
def test_phase_rules(name, phase):
    assert phase_of(name) == phase


def test_collective_names():
    assert collective_of(REAL_KERNELS[14][0]) == "AllReduce"
    assert collective_of("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)") == "AllGather"


@pytest.mark.parametrize(
    "op, dims, flops, m",
    [
        ("aten::mm", [[8192, 4096], [4096, 1024]], 2 * 8192 * 4096 * 1024, 8192),
        ("aten::addmm", [[1024], [64, 4096], [4096, 1024], [], []], 2 * 64 * 4096 * 1024, 64),
        ("aten::bmm", [[8, 128, 64], [8, 64, 256]], 2 * 8 * 128 * 64 * 256, 128),
        ("aten::linear", [[4, 512, 4096], [11008, 4096], [11008]], 2 * 2048 * 4096 * 11008, 2048),
        ("aten::matmul", [[4, 512, 4096], [4096, 1024]], 2 * 4 * 512 * 4096 * 1024, 2048),
        ("aten::matmul", [[4, 512, 64], [4, 64, 512]], 2 * 4 * 512 * 64 * 512, 512),
    ],
)
def test_gemm_flops_from_shapes(op, dims, flops, m):
    shape = gemm_shape(op, dims, ["c10::BFloat16"] * len(dims))
    assert shape is not None and shape.flops == flops and shape.m == m and shape.precision == "bf16"
