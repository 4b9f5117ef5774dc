"""What the planner is asked about: `PlanInput` (model, batch, precision, memory options, parallel layout),
the GPU and link tables it looks hardware up in. `plan/mapping.py` builds one from a run's resolved spec.

GPU figures come from `tracetrain.devices.DEVICES` (one table); this module only maps short CLI-friendly
names ("h100-sxm", "h200", ...) onto its rows and adds what that table does not hold: the links between
GPUs and to the host (`LINKS`). Every hardware number can be overridden on the `PlanInput`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from tracetrain.devices import DEVICES, DeviceSpec
from tracetrain.errors import TracetrainError
from tracetrain.models.llama import ModelArgs
from tracetrain.spec import fsdp_param_dtype_for, fused_ce_applies

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Recompute = Literal["none", "selective", "full"]
ActOffload = Literal["none", "save_on_cpu", "streamed"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]

# Short names -> the `devices.DEVICES` key that names the same GPU.
GPU_NAMES: dict[str, str] = {
    "h100-sxm": "H100",
    "h100": "H100",
    "h100-pcie": "H100 PCIe",
    "h100-nvl": "H100 NVL",
    "h200": "H200",
    "gh200": "GH200",
    "gh200-96g": "GH200",
    "gh200-144g": "GH200 144G",
    "a100": "A100",
    "l40s": "L40S",
}


# Checked by PlanInput.validate_numbers: counts at least 1.
LAYOUT_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
COUNT_FIELDS: tuple[str, ...] = (
    "num_gpus",
    "micro_batch",
    "grad_accum",
    "seq_len",
    "gpus_per_node",
    "recompute_every",
    "pp_virtual_stages",
    "lora_rank",
)
# Sizes and hardware overrides: above 0 when given.
POSITIVE_FIELDS: tuple[str, ...] = (
    "gpu_memory_gib",
    "peak_tflops",
    "hbm_tb_s",
    "intra_node_gb_s",
    "inter_node_gb_s",
    "host_gb_s",
    "host_memory_gib",
    "cpu_adam_gb_s",
)


class PlanInputError(TracetrainError, ValueError):
    """A run the planner cannot answer for (a bad count, an unknown GPU, a layout that does not add up):
    one line naming the field, the value and what is allowed; the CLI prints it without a traceback."""


@dataclass(frozen=True)
class Links:
    """Achievable per-GPU, per-direction bandwidths in GB/s (1e9 bytes/s), from vendor datasheets.

    `intra_node`: GPU-to-GPU inside a node (NVLink 4 on H100/H200 SXM: 900 GB/s bidirectional = 450 per
    direction). `inter_node`: one 400 Gb/s InfiniBand NDR NIC per GPU = 50 GB/s each way (DGX H100 /
    HGX H200: eight single-port ConnectX-7 400 Gb/s NICs per 8-GPU node; collective_time.py lets a group
    with several ranks on a node use all their NICs). `host`: GPU <-> pinned CPU memory (PCIe Gen5 x16
    ~55 GB/s measured per direction; GH200: NVLink-C2C, 900 GB/s bidirectional = 450 each way, NVIDIA's
    GH200 datasheet).
    """

    intra_node_gb_s: float
    inter_node_gb_s: float
    host_gb_s: float


LINKS: dict[str, Links] = {
    "H100": Links(450.0, 50.0, 55.0),
    "H200": Links(450.0, 50.0, 55.0),
    "GH200 144G": Links(450.0, 50.0, 450.0),
    "GH200": Links(450.0, 50.0, 450.0),
    "H100 NVL": Links(300.0, 50.0, 55.0),  # NVLink bridge pairs; PCIe between pairs
    "H100 PCIe": Links(55.0, 50.0, 55.0),  # no NVLink: peers talk over PCIe Gen5
    "A100": Links(300.0, 25.0, 25.0),  # NVLink 3, HDR 200 Gb/s, PCIe Gen4
    "L40S": Links(25.0, 25.0, 25.0),  # PCIe Gen4 only
}


def device_spec(gpu: str) -> tuple[DeviceSpec, Links]:
    """The `DeviceSpec` and `Links` for a short name ("h100-sxm") or a device-table name ("NVIDIA H200")."""
    key = GPU_NAMES.get(gpu.lower())
    candidates = [(k, s) for k, s in DEVICES if (key == k if key else k.lower() in gpu.lower())]
    if not candidates:
        raise PlanInputError(f"unknown GPU {gpu!r}; known: {', '.join(GPU_NAMES)}")
    k, spec = candidates[0]
    return spec, LINKS[k]


@dataclass(frozen=True)
class PlanInput:
    """One training run to plan: everything the memory and time models need, nothing else.

    Sizes are per micro-batch and per data-parallel rank: `micro_batch` sequences of `seq_len` tokens,
    `grad_accum` micro-batches per optimizer step (with pp > 1 they are the pipeline's micro-batches
    unless `pp_microbatches` is set).
    """

    model: ModelArgs
    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    num_gpus: int = 1
    gpu: str = "h100-sxm"
    gpu_memory_gib: float | None = None  # override the device table's memory
    peak_tflops: float | None = None  # override the dense peak for `precision`
    hbm_tb_s: float | None = None  # override HBM bandwidth
    intra_node_gb_s: float | None = None  # override `Links`
    inter_node_gb_s: float | None = None
    host_gb_s: float | None = None
    gpus_per_node: int = 8
    host_memory_gib: float = 1024.0  # CPU memory per node (offloaded states must fit there)
    cpu_adam_gb_s: float = 150.0  # CPU memory bandwidth an offloaded AdamW gets, per node
    # numerics
    precision: Precision = "bf16"  # autocast dtype of the compute; fp32 = no autocast
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"  # train.fp8's scaling, with precision fp8
    param_dtype: Literal["fp32", "bf16"] = "fp32"  # storage of trainable weights (tracetrain full FT: fp32)
    mode: Literal["full", "lora"] = "full"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_base_dtype: Literal["fp32", "bf16"] = "bf16"
    lora_base_quant: Literal["none", "nf4"] = "none"  # QLoRA: the block projections in NF4 (models/qlora.py)
    lora_dora: bool = False  # DoRA: a magnitude per output row of each adapted projection (models/lora.py, DoRALinear)
    fused_adamw: bool = True  # fused kernel (no full-size temporaries) vs foreach
    # speed path (TrainSection; the defaults here are the eager path, plan_input_from_config resolves
    # the trainer's CUDA defaults)
    compile: bool = False  # train.compile: each block a torch.compile'd graph
    fused_kernels: bool = False  # train.fused_kernels: Triton RMSNorm / RoPE / SwiGLU ops
    attention: Literal["sdpa", "flex"] = "sdpa"  # train.attention (flex: FlexAttention)
    sdpa_kernel: Literal["cudnn", "fa2"] = "cudnn"  # SDPA's kernel on Hopper: cuDNN (torch >= 2.11), FA2 (earlier)
    fused_ce_chunk: int = 0  # train.fused_ce: tokens per chunk of the fused lm_head +
    # cross-entropy, 0 = full logits; like the trainer, only where spec.fused_ce_applies
    load_checkpoint: bool = False  # model.init_from: the weights are read from a Hugging Face checkpoint
    # memory options (MemorySection)
    recompute: Recompute = "none"
    recompute_every: int = 1
    activation_offload: ActOffload = "none"
    activation_offload_fraction: float = 1.0  # streamed: share of blocks offloaded, the first ones
    tiled_mlp_tokens: int = 0  # memory.tiled_mlp: norm + MLP over tiles of this many tokens (0 = off)
    recompute_pointwise: bool = False  # memory.recompute_pointwise: compiled LoRA blocks recompute adapter inputs
    optimizer_offload: bool = False
    unified_memory: Literal["none", "optimizer", "model"] = "none"
    expandable_segments: bool = True
    # parallel layout
    dp_replicate: int = 1
    dp_shard: int = 1
    zero_stage: Literal[1, 2, 3] = 3  # what dp_shard shards: 1 optimizer, 2 + grads, 3 + params
    reshard_after_forward: bool = True  # ZeRO-3: gather weights again in backward
    fsdp_cpu_offload: bool = False  # ZeRO-3 shards (weights, grads, AdamW) live in host memory
    tp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True  # vocabulary-sharded logits and loss with tp > 1
    pp: int = 1
    pp_schedule: Schedule = "1f1b"
    pp_microbatches: int = 0  # 0 = grad_accum
    pp_virtual_stages: int = 1  # model chunks per rank (interleaved_1f1b)
    cp: int = 1
    ep: int = 1
    num_experts: int = 0  # 0 = dense MLP
    top_k: int = 1

    def replace(self, **changes: object) -> PlanInput:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # field names and values checked by PlanInput's own validation

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> bool:
        """parallel/data_parallel.py wraps the model in FSDP units: a data- or context-parallel axis > 1."""
        return self.dp_replicate * self.dp_shard * self.cp > 1

    @property
    def fsdp_mixed_precision(self) -> bool:
        """FSDP gathers copies of the weights in spec.fsdp_param_dtype (bf16 for bf16 compute, FP8 GEMMs
        included: they run inside bf16 autocast); otherwise in their stored dtype, and autocast casts them."""
        compute = "bf16" if self.precision == "fp8" else self.precision
        return self.data_parallel and fsdp_param_dtype_for(compute) is not None

    @property
    def zero3(self) -> bool:
        """Weights resharded after each unit's forward (ZeRO-3); ZeRO-1/2 and pure replication
        (dp_shard * cp = 1) keep every unit's gathered weights from its forward to its last backward."""
        return self.dp_shard * self.cp > 1 and self.zero_stage == 3

    @property
    def defers_reduce_scatter(self) -> bool:
        """ZeRO-1 and pure replication accumulate unsharded gradients and reduce once per step
        (data_parallel.grad_sync_for); ZeRO-2/3 reduce-scatter every micro-batch."""
        return self.data_parallel and (self.dp_shard * self.cp == 1 or self.zero_stage == 1)

    @property
    def gpus_on_node(self) -> int:
        """GPUs of this run sharing one node's CPU memory and bandwidth."""
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def num_microbatches(self) -> int:
        return self.pp_microbatches or self.grad_accum

    @property
    def fused_ce(self) -> bool:
        """The chunked fused lm_head + cross-entropy runs: asked for, and the layout allows it (spec.py
        `fused_ce_applies`; `search` changes the layout of a planned run without resolving it again)."""
        return self.fused_ce_chunk > 0 and fused_ce_applies(self.tp, self.pp)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.micro_batch * self.num_microbatches * self.dp

    def validate(self) -> None:
        """Raise PlanInputError (a ValueError) naming the field, the value and what is allowed."""
        self.validate_numbers()
        m = self.model
        layout = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if layout != self.num_gpus:
            raise PlanInputError(f"layout dp_replicate*dp_shard*tp*pp*cp = {layout} but num_gpus = {self.num_gpus}")
        if m.n_heads % self.tp or m.n_kv_heads % self.tp:
            raise PlanInputError(f"tp = {self.tp} must divide n_heads {m.n_heads} and n_kv_heads {m.n_kv_heads}")
        stages = self.pp * (self.pp_virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1)
        if stages > m.n_layers:  # uneven splits are fine: parallel/pipeline.py puts the extra blocks first
            raise PlanInputError(
                f"pp = {self.pp} x virtual stages {self.pp_virtual_stages} = {stages} pipeline stages need at "
                f"least that many layers (n_layers = {m.n_layers})"
            )
        if self.seq_len % (2 * self.cp) and self.cp > 1:
            raise PlanInputError(
                f"seq_len {self.seq_len} must be divisible by 2*cp = {2 * self.cp} (each rank keeps 2 of "
                "2*cp equal chunks: the load-balanced split)"
            )
        if self.num_experts and (self.num_experts % self.ep or self.top_k > self.num_experts):
            raise PlanInputError(f"ep = {self.ep} must divide num_experts {self.num_experts}, top_k <= num_experts")
        if not self.num_experts and self.ep > 1:
            raise PlanInputError("ep > 1 needs num_experts > 0 (a MoE model)")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise PlanInputError(f"ep = {self.ep} must divide dp_shard*cp = {self.dp_shard * self.cp}")
        if self.fsdp_cpu_offload and (self.zero_stage != 3 or self.optimizer_offload):
            raise PlanInputError("fsdp_cpu_offload needs zero_stage 3 and excludes optimizer_offload")
        if self.fused_ce_chunk < 0:
            raise PlanInputError(f"fused_ce_chunk = {self.fused_ce_chunk} must be >= 0 (0 = off)")
        if self.pp_schedule == "interleaved_1f1b" and self.pp_virtual_stages < 2 and self.pp > 1:
            raise PlanInputError("pp_schedule 'interleaved_1f1b' needs pp_virtual_stages >= 2")
        if self.pp > 1 and self.num_microbatches < self.pp and self.pp_schedule != "gpipe":
            raise PlanInputError(
                f"pipeline micro-batches {self.num_microbatches} < pp {self.pp}: the schedule "
                "cannot fill the pipeline (raise grad_accum or pp_microbatches)"
            )

    def validate_numbers(self) -> None:
        """The checks that do not depend on the layout: counts at least 1, sizes and hardware overrides
        above 0, a GPU the tables know that can run the asked precision, and only what the trainer
        accepts with several ranks (validate.py)."""
        for name in COUNT_FIELDS + LAYOUT_AXES:
            if getattr(self, name) < 1:
                raise PlanInputError(f"{name} = {getattr(self, name)}: must be at least 1")
        for name in POSITIVE_FIELDS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PlanInputError(f"{name} = {value}: must be above 0")
        spec, _ = device_spec(self.gpu)
        if self.precision == "fp8" and not spec.fp8_tflops and not self.peak_tflops:
            raise PlanInputError(
                f"train.fp8 needs FP8 tensor cores (Ada, Hopper); {spec.name} has none: plan it with "
                "train.fp8 = 'none' or on h100-sxm, h200, l40s"
            )
        if self.num_gpus > 1 and (self.optimizer_offload or self.unified_memory == "model"):
            key = "optimizer_offload" if self.optimizer_offload else "unified_memory = 'model'"
            raise PlanInputError(
                f"{key} runs on one GPU only (the trainer refuses it with several ranks); "
                "use fsdp_cpu_offload for sharded CPU offload"
            )

    def hardware(self) -> Hardware:
        spec, links = device_spec(self.gpu)
        peak = (
            self.peak_tflops
            if self.peak_tflops
            else {"fp32": spec.fp32_tflops, "bf16": spec.bf16_tflops, "fp16": spec.bf16_tflops, "fp8": spec.fp8_tflops}[
                self.precision
            ]
        )
        return Hardware(
            name=spec.name,
            memory_bytes=(self.gpu_memory_gib if self.gpu_memory_gib is not None else spec.memory_gib) * 2**30,
            peak_flops=peak * 1e12,
            bf16_flops=(
                self.peak_tflops if self.peak_tflops and self.precision in ("bf16", "fp16") else spec.bf16_tflops
            )
            * 1e12,
            hbm_bytes_s=(self.hbm_tb_s or spec.hbm_tb_s) * 1e12,
            intra_node_bytes_s=(self.intra_node_gb_s or links.intra_node_gb_s) * 1e9,
            inter_node_bytes_s=(self.inter_node_gb_s or links.inter_node_gb_s) * 1e9,
            host_bytes_s=(self.host_gb_s or links.host_gb_s) * 1e9,
            cpu_bytes_s=self.cpu_adam_gb_s * 1e9 / self.gpus_on_node,
            host_memory_bytes=self.host_memory_gib * 2**30,
        )


@dataclass(frozen=True)
class Hardware:
    """Resolved hardware numbers, SI units (bytes, FLOP/s, bytes/s)."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense peak for the GEMMs' precision
    bf16_flops: float  # attention runs in bf16 even under fp8 GEMMs
    hbm_bytes_s: float
    intra_node_bytes_s: float
    inter_node_bytes_s: float
    host_bytes_s: float
    cpu_bytes_s: float  # CPU memory bandwidth per GPU (the node's, shared)
    host_memory_bytes: float  # per node
