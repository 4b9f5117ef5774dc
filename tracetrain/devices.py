"""Accelerator table: peak dense FLOP/s, memory and bandwidth by device name, from vendor datasheets
(SXM/NVL/PCIe variants differ). Used for MFU and by the planner. An unknown device gets no entry:
callers then report no MFU rather than a made-up one, unless the user gives `logging.peak_tflops`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float  # dense (no sparsity)
    fp8_tflops: float
    fp32_tflops: float  # plain (non-tensor-core) fp32
    memory_gib: float  # as the driver reports it (nvidia-smi's total), in GiB
    hbm_tb_s: float


# Matched in order against torch.cuda.get_device_name(); more specific names first.
DEVICES: list[tuple[str, DeviceSpec]] = [
    # Memory: H100 SXM and H200 as read by nvidia-smi on the machines used here (81,559 and 143,771 MiB);
    # the others from their marketed size in GiB, which their drivers report approximately.
    # GH200 Grace Hopper (NVIDIA datasheet): the same Hopper GPU as H100 SXM, with 96 GB HBM3 at 4 TB/s
    # or 144 GB HBM3e at 4.9 TB/s; the driver names the latter "GH200 144G HBM3e", the former after its
    # 480 GB of CPU memory ("GH200 480GB").
    ("GH200 144G", DeviceSpec("GH200 144GB HBM3e", 989.4, 1978.9, 66.9, 144.0 * 1e9 / 2**30, 4.9)),
    ("GH200", DeviceSpec("GH200", 989.4, 1978.9, 66.9, 95.0, 4.0)),
    ("H200", DeviceSpec("H200 SXM", 989.4, 1978.9, 66.9, 143771 / 1024, 4.8)),
    ("H100 PCIe", DeviceSpec("H100 PCIe", 756.0, 1513.0, 51.2, 79.6, 2.0)),
    ("H100 NVL", DeviceSpec("H100 NVL", 835.0, 1670.0, 60.0, 93.6, 3.9)),
    ("H100", DeviceSpec("H100 SXM", 989.4, 1978.9, 66.9, 81559 / 1024, 3.35)),
    ("A100", DeviceSpec("A100", 312.0, 0.0, 19.5, 79.2, 2.0)),
    ("L40S", DeviceSpec("L40S", 362.1, 733.0, 91.6, 44.4, 0.864)),
]


def lookup_device(device_name: str) -> DeviceSpec | None:
    for key, spec in DEVICES:
        if key.lower() in device_name.lower():
            return spec
    return None


def peak_flops(device_name: str, precision: str, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s for MFU: the override if given, else the table's figure for `precision`."""
    if override_tflops > 0:
        return override_tflops * 1e12
    spec = lookup_device(device_name)
    if spec is None:
        return None
    return {"bf16": spec.bf16_tflops, "fp16": spec.bf16_tflops, "fp8": spec.fp8_tflops, "fp32": spec.fp32_tflops}[
        precision
    ] * 1e12


def free_device_bytes(device: object) -> int:
    """Bytes a new allocation can get on a CUDA device now: free in the driver plus what torch's caching
    allocator holds unused. No device sync. (The fused cross-entropy's adaptive chunk and generation's
    prefill chunk size themselves by it.)"""
    import torch

    free, _ = torch.cuda.mem_get_info(device)  # type: ignore[arg-type]  # a torch.device or an index
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # type: ignore[arg-type]  # a torch.device or an index, as mem_get_info takes
