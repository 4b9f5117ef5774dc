"""Memory of the build and load phases: what one GPU holds before the first step.

The trainer builds the model on the meta device, lays out the shards (FSDP, TP, PP, EP), and only then
materialises each rank's own part, in its final dtype (models/build.py). Initial values are drawn in
dim-0 chunks of at most 16 Mi elements, each from its own seeded generator, in fp32 (models/init.py), so
every layout holds the same numbers: the peak of the build is the rank's shard of the weights plus one
fp32 chunk (with FP8, whose row quantises real values before the layout's rows, the whole model).
Loading a Hugging Face checkpoint (`model.init_from`, models/hf_load.py) reads from the
safetensors files only the rows and columns each rank owns, at most 64 MiB at a time: the GPU holds its
shard and one read in transit, the host one read.

Both phases are phases of the memory plan (memory.py): the verdict is the largest of the build, the
load and the step, so a run whose step fits but whose weights cannot be materialised does not "fit".
"""

from __future__ import annotations

from tracetrain.models.qlora import NF4_QUANTISE_BYTES_PER_PARAM
from tracetrain.plan.activations import Affine
from tracetrain.plan.inputs import PlanInput
from tracetrain.plan.params import StageParams, frozen_bytes, largest_projection, nf4_params

# The trainer's own bounds (models/init.py CHUNK_ELEMENTS, models/hf_load.py _READ_BYTES), restated
# here until the planner can import them from the models it plans (they land in the same change).
INIT_CHUNK_ELEMENTS = 1 << 24  # values are drawn in fp32 chunks of at most this many elements
INIT_BYTES_PER_ELEMENT = 4
CHECKPOINT_READ_BYTES = 64 * 2**20  # one read of a checkpoint's tensor rows
CHECKPOINT_BYTES_PER_PARAM = 2  # Hugging Face Llama checkpoints are stored in bf16

BUILD_PHASE = "build (materialise)"
LOAD_PHASE = "load (checkpoint)"
SHARD_ITEM = "weights (materialised shard)"
INIT_ITEM = "one init chunk (fp32)"
LOAD_ITEM = "one checkpoint read in transit"
STAGING_ITEM = "checkpoint staging (one read)"
BUILD_PHASES = (BUILD_PHASE, LOAD_PHASE)


def largest_param(inp: PlanInput, sp: StageParams) -> int:
    """Elements of the largest single parameter on this stage, whole (before any slicing): the
    embedding or lm_head on the first/last stage, else a feed-forward matrix (all experts of a MoE
    block: models/moe.py stacks them in one parameter)."""
    a = inp.model
    mlp = a.dim * a.ffn_dim * max(1, inp.num_experts)
    vocab = a.vocab_size * a.dim if (sp.embedding or sp.head > a.dim) else 0
    return max(vocab, mlp, a.dim * a.n_heads * a.head_dim)


def shard_bytes(inp: PlanInput, sp: StageParams, base_bytes: float) -> float:
    """Bytes of this rank's weights in their final dtype (spec.weights_dtype): a LoRA base at its dtype
    (`base_bytes`) + fp32 adapters; full fine-tuning fp32, or bf16 when the optimizer offload keeps the
    fp32 master on the host. Sharded over dp_shard * cp (and tp/pp/ep, already in `sp`)."""
    full = inp.mode == "full"
    trainable = sp.total if full else sp.adapters
    train_bytes = 2 if (full and (inp.optimizer_offload or inp.param_dtype == "bf16")) else 4
    # FP8 quantises real values: its row runs before the layout's, so the whole model is materialised
    # first on every rank (FP8 composes with data parallelism only: no tp/pp to divide by).
    fsdp = 1 if inp.precision == "fp8" else inp.dp_shard * inp.cp
    return (frozen_bytes(inp, sp, base_bytes) + trainable * train_bytes) / fsdp


def build_items(inp: PlanInput, sp: StageParams, base_bytes: float) -> tuple[dict[str, Affine], dict[str, Affine]]:
    """GPU items of the build and load phases, and the host staging of a checkpoint load."""
    largest = largest_param(inp, sp)
    chunk = float(min(largest, INIT_CHUNK_ELEMENTS) * INIT_BYTES_PER_ELEMENT)
    if nf4_params(inp, sp):  # QLoRA: one whole projection filled (2 bytes each), then quantised (models/build.py)
        proj = largest_projection(inp)
        chunk = max(chunk + 2 * proj, proj * NF4_QUANTISE_BYTES_PER_PARAM)
    read = min(largest * CHECKPOINT_BYTES_PER_PARAM, CHECKPOINT_READ_BYTES) if inp.load_checkpoint else 0.0
    items = {
        SHARD_ITEM: Affine(shard_bytes(inp, sp, base_bytes)),
        INIT_ITEM: Affine(chunk),
        LOAD_ITEM: Affine(read),
    }
    cpu = {STAGING_ITEM: Affine(read)} if inp.load_checkpoint else {}
    return items, cpu


def build_phases(inp: PlanInput) -> dict[str, list[str]]:
    """The build phase always; the load phase with a checkpoint to read."""
    phases = {BUILD_PHASE: [SHARD_ITEM, INIT_ITEM]}
    if inp.load_checkpoint:
        phases[LOAD_PHASE] = [SHARD_ITEM, LOAD_ITEM]
    return phases
