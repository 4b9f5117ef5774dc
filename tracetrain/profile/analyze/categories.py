"""Name rules: which category a GPU kernel belongs to, which host events mean data loading, host
synchronisation, communication or a training phase, and how to shorten C++ kernel names.

Kernel categories (first matching rule wins; matched case-insensitively against the full name):

| category        | rule                                                                                 |
|-----------------|--------------------------------------------------------------------------------------|
| memcpy_h2d/d2h/ | a `gpu_memcpy` event; direction from its name (`Memcpy HtoD (Pageable -> Device)`):  |
| d2d/other       | HtoD, DtoH, DtoD (and PtoP for peer copies, counted as d2d)                          |
| memset          | a `gpu_memset` event                                                                 |
| communication   | `nccl` / `rccl` (ncclDevKernel_AllReduce_..., ncclKernel_...)                        |
| attention       | `flash`, `fmha`, `attention`, `attn`, `sdpa`, `mha`, cuDNN's SDPA-backward helpers   |
|                 | `dot_do_o`/`convert_dq` (before gemm, for `fmha_cutlassF...`)                        |
| optimizer       | `multi_tensor_apply`, `adam`, `sgd`, `lamb_`, `lion_` (foreach ops included); Inductor's|
|                 | horizontally fused foreach kernels `triton_for_` (a compiled optimizer step)          |
| normalisation   | `rms_norm`/`rmsnorm`, `layer_norm`/`layernorm`, `group_norm`, `batch_norm`,          |
|                 | `norm_fwd/bwd`, `GammaBeta` (layer norm's weight gradient), cuDNN's `bn_fw_`/`bn_bw_`,|
|                 | `RowwiseMoments`/`welford` (a norm's statistics) (MIOpen's by `batch_norm`)          |
| gemm            | `gemm`, `gemv`, `nvjet`, `xmma`, `cutlass`, `cublas`, `wgmma`, `Kernel2`, `triton_tem`,|
|                 | `splitKreduce`, `matmul`; convolutions, which run as implicit GEMMs on the tensor     |
|                 | cores: `convolve`/`convolution`, `conv2d_`/`conv3d_`, `naive_conv`, `winograd`,      |
|                 | `fft2d`, `xmma_fprop/dgrad/wgrad`, cuDNN's `wgrad_alg0_engine`/`dgrad_engine`; AMD's |
|                 | Tensile GEMMs `Cijk_` (rocBLAS, hipBLASLt) and MIOpen's `igemm`                      |
| reduction       | `reduce`, `softmax`, `triton_red_`, `triton_per_`, `cross_entropy`, `nll_loss`, `argmax`,|
|                 | pooling (`max_pool`, `avg_pool`, `adaptive_average_pool`), and the whole-tensor       |
|                 | primitives scan, sort and histogram (`cub::DeviceScan...`, `RadixSort`, `sort`);    |
|                 | Inductor's split scans `triton_spl_`                                                 |
| elementwise     | `elementwise`, `triton_poi_`, `fill_kernel`, `CatArray`, copies (`copy`), `dropout`, |
|                 | layout transposes `nchwToNhwc`/`nhwcToNchw`, `permute`; gathers and embeddings       |
|                 | (`embedding`, FBGEMM's `split_embedding_...`, `indexSelect`, `gather`, `scatter`,   |
|                 | `linearize_index`, `bounds_check_indices`, `searchsorted`); Inductor kernels whose  |
|                 | name does not say pointwise or reduction: the generic `triton_` that Triton extends |
|                 | with its argument signature (`triton__0d1d2d3de`, Inductor before mid-2023, and      |
|                 | later with `unique_kernel_names` off), `triton_fused_...` and `triton_unk_...`      |
|                 | (see below)                                                                          |
| gemm            | any other cuDNN (`cudnn::`, `cudnn_infer_..._scudnn_...`, `cask_cudnn...`), MIOpen,  |
|                 | `rocblas` or `hipblaslt` kernel (last, so that their norm, softmax and layout kernels|
|                 | match the rules above first)                                                         |
| other           | anything else                                                                        |

Inductor (torch.compile) names its Triton kernels `triton_<kind>_<fused ops>_<n>` since mid-2023:
`poi` pointwise, `red` reduction, `per` persistent reduction, `tem` template (a GEMM, or FlexAttention's
`..._flex_attention_...`), `for` foreach, `spl` split scan, `unk` a kernel of mixed kinds. Before that
every kernel was named `triton_` and Triton appended the specialisation of its arguments, e.g.
`triton__0d1d2d3d4d5d6d78d9d`, so the name no longer tells a pointwise kernel from a reduction (nor, with
max-autotune, from a GEMM template). Those generic names count as elementwise: almost all of them are
fused pointwise or reduction kernels, memory-bound either way, and where a fused op's name survives
(`triton_fused_native_layer_norm_...`, `triton_fused__softmax_...`) the rules above take it first.

Host (CPU) ranges that explain an idle GPU (in older schemas these ranges, and `ProfilerStep#N` and
the phase ranges, are `Operator`/`cpu_op` events; `is_range_name` tells the parser they are ranges):

| cause          | host events                                                                          |
|----------------|--------------------------------------------------------------------------------------|
| data loader    | annotations named like `enumerate(DataLoader)#...`, `..._next_data`, `tracetrain/data_wait`,|
|                | `data_load`/`load_data`/`fetch_data`/`get_batch`, or a path segment equal to `data`     |
| sync           | `cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`, blocking    |
|                | `cudaMemcpy` (not `...Async`), driver `cuStreamSynchronize`/`cuCtxSynchronize`; ops   |
|                | `aten::item`, `aten::_local_scalar_dense`, `aten::nonzero`                          |
| communication  | ops/annotations starting `c10d::`, `nccl:`, `gloo:`; `record_param_comms`, `ProcessGroup`|
"""

from __future__ import annotations

import re
from typing import Final

CATEGORIES: Final = (
    "gemm",
    "attention",
    "normalisation",
    "elementwise",
    "reduction",
    "optimizer",
    "communication",
    "memcpy_h2d",
    "memcpy_d2h",
    "memcpy_d2d",
    "memcpy_other",
    "memset",
    "other",
)
MEMCPY_CATEGORIES: Final = ("memcpy_h2d", "memcpy_d2h", "memcpy_d2d", "memcpy_other")
# Categories whose kernels stream memory: their speed is bytes/s against HBM bandwidth.
MEMORY_CATEGORIES: Final = ("normalisation", "elementwise", "reduction", "optimizer", "memset")

_KERNEL_RULES: Final = [
    ("communication", re.compile(r"nccl|rccl", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|mha|dot_do_o|convert_dq", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|sgd|lamb_|lion_|^triton_for_", re.I)),
    (
        "normalisation",
        re.compile(
            r"rms_?norm|layer_?norm|group_?norm|batch_?norm|norm_(fwd|bwd)|gammabeta|bn_(fw|bw)_|rowwisemoments|welford",
            re.I,
        ),
    ),
    (
        "gemm",
        re.compile(
            r"gemm|gemv|nvjet|xmma|cutlass|cublas|wgmma|\bKernel2\b|triton_tem|splitkreduce|matmul"
            # Convolutions: implicit GEMMs on the same tensor cores, so they are matmul-like compute.
            r"|convolve|convolution|conv[23]d_|naive_conv|winograd|fft2d|wgrad_alg\d|dgrad_(alg|engine)"
            # AMD: rocBLAS's and hipBLASLt's GEMMs (Tensile's `Cijk_...` kernels).
            r"|cijk_",
            re.I,
        ),
    ),
    (
        "reduction",
        re.compile(
            r"reduce|softmax|triton_red_|triton_per_|cross_entropy|nll_loss|argmax"
            # Pooling reduces a window; scan, sort and histogram are whole-tensor primitives (CUB).
            r"|max_pool|avg_pool|average_pool|devicescan|radixsort|sort|histogram|^triton_spl_",
            re.I,
        ),
    ),
    (
        "elementwise",
        re.compile(
            r"elementwise|triton_poi_|fill_kernel|catarray|copy|dropout|nchwtonhwc|nhwctonchw|permute"
            # Gathers: embedding lookups (FBGEMM's table-batched `split_embedding_...`) and indexing
            # stream memory row by row like elementwise kernels.
            r"|embedding|index_?select|gather|scatter|linearize_index|bounds_check_indices|searchsorted"
            # Inductor's generic names (module docstring): `triton_`, `triton__0d1d2d3de`, `triton_fused_...`.
            r"|^triton_(_[0-9de]+)?$|^triton_(fused|unk)_",
            re.I,
        ),
    ),
    # Last: the rest of the kernels of cuDNN and MIOpen are convolution variants (`cudnn::detail::...`,
    # `cudnn_infer_volta_scudnn_128x64_relu_...`, `miopenSp3AsmConv...`) or their index set-up
    # (`cask_cudnn_infer::computeOffsetsKernel`), those of rocBLAS and hipBLASLt GEMM variants; their
    # norm, softmax and layout kernels matched the rules above.
    ("gemm", re.compile(r"cudnn|miopen|rocblas|hipblaslt", re.I)),
]

_DATA_RANGE: Final = re.compile(
    r"dataloader|_next_data|data_wait|data_load|load_data|fetch_data|get_batch|(^|[/#.])data($|[/#.])", re.I
)
_SYNC_RUNTIME: Final = frozenset(
    {
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cudaMemcpy2D",
        "cuStreamSynchronize",
        "cuCtxSynchronize",
        "cuEventSynchronize",
        "cuMemcpyDtoH_v2",
    }
)
_SYNC_OPS: Final = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::nonzero"})
_COMM_RANGE: Final = re.compile(r"^(c10d::|nccl:|gloo:)|record_param_comms|ProcessGroup")

PHASES: Final = ("data_wait", "forward", "backward", "optimizer", "checkpoint")
_PHASE_RULES: Final = [
    ("data_wait", re.compile(r"^tracetrain/data_wait|^enumerate\(DataLoader\)")),
    ("forward", re.compile(r"^tracetrain/forward|^## forward ##")),
    ("backward", re.compile(r"^tracetrain/backward|^## backward ##")),
    ("optimizer", re.compile(r"^tracetrain/optimizer|^Optimizer\.(step|zero_grad)#|^## optimizer ##")),
    ("checkpoint", re.compile(r"^tracetrain/checkpoint")),
]
_TRACETRAIN_PHASE: Final = re.compile(r"^tracetrain/([A-Za-z0-9_]+)$")
STEP_ANNOTATION: Final = re.compile(r"^ProfilerStep#\d+$")


def kernel_category(name: str, kind: str) -> str:
    """Category of a GPU event; `kind` is "kernel", "memcpy" or "memset" (see the module table)."""
    if kind == "memcpy":
        return memcpy_direction(name)
    if kind == "memset":
        return "memset"
    for category, pattern in _KERNEL_RULES:
        if pattern.search(name):
            return category
    return "other"


def memcpy_direction(name: str) -> str:
    """`memcpy_h2d` etc. from a Kineto memcpy name such as `Memcpy DtoH (Device -> Pinned)`."""
    upper = name.upper()
    if "HTOD" in upper:
        return "memcpy_h2d"
    if "DTOH" in upper:
        return "memcpy_d2h"
    if "DTOD" in upper or "PTOP" in upper:
        return "memcpy_d2d"
    return "memcpy_other"


def is_pageable_copy(name: str) -> bool:
    """Kineto names a copy from or to pageable host memory `Memcpy HtoD (Pageable -> Device)`."""
    return "pageable" in name.lower()


def is_data_range(name: str) -> bool:
    return bool(_DATA_RANGE.search(name)) and not STEP_ANNOTATION.match(name)


def is_range_name(name: str) -> bool:
    """Whether a host event named `name` is a record_function range (a step, a training phase, data
    loading) rather than an operator. Older Kineto schemas (2021) write these ranges as `Operator` or
    `cpu_op` events, not `user_annotation`; the parser reads them by this name rule."""
    return bool(STEP_ANNOTATION.match(name)) or is_data_range(name) or phase_of(name) is not None


def is_sync_runtime(name: str) -> bool:
    return name in _SYNC_RUNTIME


def is_sync_op(name: str) -> bool:
    return name in _SYNC_OPS


def is_comm_range(name: str) -> bool:
    return bool(_COMM_RANGE.search(name))


def phase_of(name: str) -> str | None:
    """The training phase an annotation marks, or None. Unknown `tracetrain/<x>` names give `x`."""
    for phase, pattern in _PHASE_RULES:
        if pattern.search(name):
            return phase
    match = _TRACETRAIN_PHASE.match(name)
    return match.group(1) if match else None


def collective_of(name: str) -> str:
    """`AllReduce` from `ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...)`; "other" when unnamed."""
    match = re.search(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", name)
    return match.group(1) if match else "other"


def _strip_trailing_args(name: str) -> str:
    """Drop a trailing balanced `(...)` argument list."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i] if i > 0 else name
    return name


def _collapse_templates(name: str, keep_depth: int) -> str:
    """Replace template arguments nested deeper than `keep_depth` with an ellipsis."""
    out: list[str] = []
    depth = 0
    for char in name:
        if char == "<":
            depth += 1
            if depth == keep_depth + 1:
                out.append("<…")
            if depth > keep_depth:
                continue
        elif char == ">":
            depth -= 1
            if depth == keep_depth:
                out.append(">")
            if depth >= keep_depth:
                continue
        elif depth > keep_depth:
            continue
        out.append(char)
    return "".join(out)


def short_kernel_name(name: str, max_chars: int = 90) -> str:
    """A readable kernel name: no `void`, no argument list, no `(anonymous namespace)`, no
    `at::native::`, template arguments kept one level deep, at most `max_chars` characters."""
    short = name.strip()
    if short.startswith("void "):
        short = short[5:]
    short = _strip_trailing_args(short)
    short = short.replace("(anonymous namespace)::", "").replace("at::native::", "")
    short = _collapse_templates(short, keep_depth=2 if short.count("<") < 3 else 1)
    short = re.sub(r"\s+", " ", short).strip()
    return short if len(short) <= max_chars else short[: max_chars - 1] + "…"


# aten ops whose recorded `Input Dims` give a GEMM's shape (see bound.gemm_shape for the formulas).
GEMM_OPS: Final = frozenset(
    {
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::matmul",
        "aten::linear",
        "aten::_scaled_mm",
        "aten::addmm_",
        "aten::mm.out",
    }
)
