"""Saved activations of one micro-batch, derived op by op from `tracetrain/models/llama.py` and
`models/lora.py`, as bytes per token (multiply by T = micro_batch * seq_len / cp tokens).

Notation: d = dim, kv = n_kv_heads * head_dim, f = ffn_dim, h = n_heads, V = vocab_size, r = LoRA rank,
and four dtype widths in bytes (`Numerics`):
  c  compute: 2 under bf16/fp16/fp8 autocast, else the weights' width
  w  weights as the forward reads them: 4 for tracetrain's fp32 full-FT params, 2 for a bf16 LoRA base
     or for bf16 copies made by FSDP mixed precision / optimizer offload
  x  residual stream: max(w, c) under autocast (fp32 weights give an fp32 embedding output, and
     fp32 + bf16 residual adds stay fp32), w without autocast
  a  LoRA adapter input: c under autocast, else 4 (LoRALinear casts x to its fp32 adapters)

Three autograd facts decide what is kept (all checked against the real model in tests/plan/test_plan_activations.py):
  * an operand is saved only if the *other* operand needs a gradient (mul, mm): a frozen matmul keeps
    its weight but not its input; `x.float() * cos` keeps only cos (so RoPE keeps nothing per layer);
  * autocast caches its bf16 cast of a weight that requires grad, but casts an activation anew for
    each linear: q, k and v each keep their own bf16 copy of an fp32 norm output;
  * SDPA (flash, CUDA and CPU) keeps q, k, v, its output and an fp32 logsumexp (b, h, s); o_proj's
    input is a view of that output. With GQA, k and v are kept at n_kv_heads.

Per block, bytes per token (full fine-tuning; [LoRA]):
  RMSNorm x 2        2 * (4d + 4)             fp32 copy of the input (kept by pow) and rstd
                     2 * x*d                  normalised input kept by `weight * h` [0: weight frozen]
  q/k/v input        3*c*d if x != c else c*d [adapters' input: n_adapted*a*d if x != a else a*d]
  q, k after RoPE    c*(d + kv);  v: c*kv
  attention          c*d + 4h                 output, logsumexp
  gate/up input      as q/k/v with 2 linears
  SwiGLU             3*c*f                    gate (silu input), silu output, up
  down input         c*f                      [only if down_proj is adapted]
  LoRA               n_adapted * a*r          lora_A output, kept by lora_B
The first block of a LoRA model gets an input that needs no gradient, so its first RMSNorm keeps nothing.
Outside the blocks: cos/sin 8*head_dim, token ids 8 [0], final norm 4d+4+x*d [4d+4], lm_head input c*d [0].

Loss (`F.cross_entropy(logits.float())` in train/step.py), per token, in V units: the bf16 logits (c),
their fp32 copy (4) and log_softmax's saved fp32 output (4) coexist at the end of the forward (the copy
dies with cross_entropy, the logits when loss_sum returns); the backward then starts with the saved
log-probs (4), nll_loss's fp32 gradient (4) and log_softmax's fp32 input gradient (4): 12V, before the
cast back to bf16. So the largest loss buffer is 12*V bytes per token, at the start of the backward.

Compared with Megatron-LM's 34*s*b*h bytes per layer (bf16, MHA, f = 4d, dropout masks, unfused
softmax term 5*a*s^2*b dropped by flash attention): tracetrain's fp32-weight path keeps ~63d for a
Llama-3.2-1B block (fp32 norms 16d, per-linear casts 10d, SwiGLU 4*(f=4d) = 32d), about 1.85x; a bf16
LoRA base with q/k/v/o adapters keeps 18d + 6f, close to 34d at f = 2.7d.

Speed paths (`PlanInput.compile`, `fused_kernels`, `attention`):
  compile        each block is one Inductor graph whose min-cut partitioner saves matmul and attention
                 inputs/outputs once (no per-linear autocast copies) and recomputes norms, casts and
                 pointwise work from the block input. Saved tensors of a compiled block, read off its
                 autograd graph on CPU with saved-tensor hooks (tests/plan/test_plan_activations.py checks them):
                   full FT: block input x*d, the two norms' bf16 outputs 2*c*d, q/k/v c*(d + 2kv),
                            attention out c*d + 4h and o_proj's contiguous copy of it c*d, gate and up 2*c*f,
                            down input c*f, rstd 8
                   LoRA:    block input and mid residual 2*x*d, attention as above, gate and up 2*c*f,
                            lora_A outputs, rstd 8; the adapters' pointwise inputs (o_proj's copy of the
                            attention out, the gate/up input, the down input) are recomputed in backward
                            with `recompute_pointwise` (memory.recompute_pointwise, kernels/apply.py
                            `apply_compile`); without it (the default) each is kept when adapted
  fused_kernels  the Triton RMSNorm keeps its input and rstd (x*d + 4 per norm, no fp32 copy and no
                 normalised copy), SwiGLU keeps gate and up (2*c*f), RoPE only cos/sin; the linears
                 (and their autocast input casts) stay eager.
  flex           FlexAttention keeps what flash SDPA keeps (q, k, v, output, logsumexp).

Tiled norm + MLP (`PlanInput.tiled_mlp_tokens`, memory/tiled_mlp.py): the items of the feed-forward half
(post-attention norm, gate/up input, SwiGLU, down input) are held for one tile of `tiled_mlp_tokens`
tokens at a time, a constant; the block keeps its mid residual (the tiles' input) instead.

A block's backward (`attention_backward_items`, `mlp_backward_items`): besides the saved tensors, the
residual-stream gradient (x*d), at the SwiGLU backward its output's gradient and gate's and up's (3*c*f;
a compiled block under full recomputation also holds each adapted gate/up's base and adapter outputs
apart, a scaled gradient copy for its adapter and down's adapter input gradient:
`compiled_recomputed_mlp_backward_items`; 11 ffn-wide tensors live in all for an all-linear LoRA block),
at the attention backward the output's gradient, dq/dk/dv and the kernel's own buffers (flash: a float32
dq accumulator 4*q_dim and, with GQA, dk/dv for every query head 2*c*q_dim). For Llama 3.1 8B that is
61,568 bytes per token at the attention backward, which a bf16 LoRA step's allocator peak shows exactly
(benchmarks/results/long_context_peak_NVIDIA-H200.json: 131k to 1M tokens).

Recomputation (tracetrain.memory, planned): "full" keeps only each checkpointed block's input (x*d),
"selective" keeps the block input plus the outputs of every matmul and of SDPA (c*(3d + 2kv + 2f) +
c*d + 4h, all else recomputed); either way one block's full set is live again while it is recomputed
(less what is the kept input itself: `block_input_alias`).
Each item carries how tensor parallelism divides it: "tp" (heads / ffn sharded), "sp" (sequence-sharded
only with sequence parallelism) or "rep" (whole on every rank: a column-parallel linear keeps its
all-gathered input under DTensor SP, where Megatron keeps the shard and gathers again in backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.models.llama import ModelArgs
from tracetrain.plan.inputs import PlanInput

Split = Literal["tp", "sp", "rep"]
Backend = Literal["flash", "efficient", "math"]
Path = Literal["eager", "kernels", "compile"]
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Numerics:
    """Dtype widths in bytes and what trains (see the module docstring)."""

    full: bool
    autocast: bool
    c: int
    w: int
    x: int
    a: int
    targets: frozenset[str]
    rank: int
    dora: bool = False  # DoRA adapters (lora.dora): two more outputs per adapted projection
    recompute_pointwise: bool = False  # compiled blocks recompute pointwise matmul inputs (kernels/apply.py)


def numerics(inp: PlanInput) -> Numerics:
    full = inp.mode == "full"
    autocast = inp.precision != "fp32"
    if full:
        # FSDP mixed precision (any data-parallel layout, every ZeRO stage) and optimizer offload hand
        # the forward bf16 weights; else fp32 params.
        low = inp.fsdp_mixed_precision or (autocast and inp.optimizer_offload)
        w = 2 if low or inp.param_dtype == "bf16" else 4
    else:
        w = 2 if inp.lora_base_dtype == "bf16" else 4
    c = 2 if autocast else w
    x = max(w, c) if autocast else w
    a = c if autocast else 4
    targets = frozenset(() if full else inp.lora_targets)
    return Numerics(
        full,
        autocast,
        c,
        w,
        x,
        a,
        targets,
        inp.lora_rank,
        inp.lora_dora and not full,
        inp.recompute_pointwise and not full,
    )


def dora_items(args: ModelArgs, nm: Numerics) -> list[Item]:
    """DoRA (models/lora.py, DoRALinear) keeps, per adapted projection, its base output and its adapter output (the
    magnitude's gradient reads both), out_features wide each, in the adapters' compute width."""
    if not nm.dora:
        return []
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    width = {"q_proj": d, "k_proj": kv, "v_proj": kv, "o_proj": d, "gate_proj": f, "up_proj": f, "down_proj": d}
    return [Item("DoRA: base + adapter outputs", 2 * nm.a * sum(width[t] for t in nm.targets))]


@dataclass(frozen=True)
class Affine:
    """`const + tokens * (per_token + per_token_seq * seq)` bytes. Every memory item has this form:
    linear in the tokens of a micro-batch, and in the sequence length only for the math attention
    path's score matrix. The HTML page's slider model relies on it."""

    const: float = 0.0
    per_token: float = 0.0
    per_token_seq: float = 0.0

    def at(self, tokens: float, seq: float) -> float:
        return self.const + tokens * (self.per_token + self.per_token_seq * seq)

    def __add__(self, o: Affine) -> Affine:
        return Affine(self.const + o.const, self.per_token + o.per_token, self.per_token_seq + o.per_token_seq)

    def __sub__(self, o: Affine) -> Affine:
        return self + o * -1.0

    def __mul__(self, k: float) -> Affine:
        return Affine(self.const * k, self.per_token * k, self.per_token_seq * k)


@dataclass(frozen=True)
class Item:
    """`per_token` (+ `per_token_seq` x seq) bytes of one kind of saved tensor; `split` says how tensor
    parallelism divides it."""

    name: str
    per_token: float
    split: Split = "rep"
    per_token_seq: float = 0.0
    mlp: bool = False  # of the feed-forward half (post-attention norm + MLP): what the tiled MLP tiles
    loss_side: bool = False  # outside the blocks, freed by the loss's backward before any block's backward
    # The separate tensors behind `per_token` (bytes per token each; they sum to it), where known: the
    # streamed offload's pinned pool rounds each one (plan/memory.py `pinned_pool_rounding`). () = unknown.
    tensors: tuple[float, ...] = ()
    tile_tokens: int = 0  # each tensor covers at most this many tokens (the tiled MLP's input slices)

    def at(self, seq: float) -> float:
        return self.per_token + self.per_token_seq * seq


def _input_copies(nm: Numerics, linears: tuple[str, ...], width: int) -> float:
    """Bytes per token kept for the shared input of `linears` (see the module docstring)."""
    return sum(_input_copy_tensors(nm, linears, width))


def _input_copy_tensors(nm: Numerics, linears: tuple[str, ...], width: int) -> tuple[float, ...]:
    """The tensors behind `_input_copies`: one cast per linear where the input is cast, else the shared one."""
    if nm.full:
        return (nm.c * width,) * len(linears) if nm.x != nm.c else (nm.c * width,)
    adapted = sum(n in nm.targets for n in linears)
    if not adapted:
        return ()
    return (nm.a * width,) * adapted if nm.x != nm.a else (nm.a * width,)


def block_path(inp: PlanInput) -> Path:
    """The speed path a block runs: compiled, eager with the fused Triton ops, or plain eager."""
    return "compile" if inp.compile else "kernels" if inp.fused_kernels else "eager"


def attention_backend(args: ModelArgs, nm: Numerics, attention: str = "sdpa") -> Backend:
    """The SDPA kernel CUDA picks for this model (no mask, is_causal): flash for bf16/fp16; fp32 is
    not flash's: memory-efficient attention takes it, but not with GQA (`enable_gqa`), where SDPA
    falls back to the math path, which materialises the fp32 score matrix. (The CPU flash kernel
    takes every case.) FlexAttention keeps flash's tensors at any dtype."""
    if args.attn_logit_softcap:  # Gemma 2's soft-capped scores run eagerly (models/arch_gemma.py)
        return "math"
    if nm.c == 2 or attention == "flex":
        return "flash"
    return "efficient" if args.n_kv_heads == args.n_heads else "math"


def _attention_items(args: ModelArgs, nm: Numerics, backend: Backend) -> list[Item]:
    d, kv, h = args.q_dim, args.n_kv_heads * args.head_dim, args.n_heads  # d: query heads' width
    items = []
    if args.qk_norm:  # Gemma 3's per-head q/k RMSNorm: an fp32 copy of its input and rstd, as the block norms
        items.append(Item("q/k norms: fp32 input + rstd", 4 * (d + kv) + 4 * (h + args.n_kv_heads), "tp"))
    if backend == "math":  # q * scale, k and v repeated to n_heads, softmax output (b, h, s, s), output
        return items + [
            Item("q, k, v (k/v repeated to all heads)", 3 * nm.c * d, "tp"),
            Item("attention probabilities (math SDPA)", 0.0, "tp", per_token_seq=4 * h),
            Item("attention out", nm.c * d, "tp"),
        ]
    return items + [
        Item("q, k after RoPE", nm.c * (d + kv), "tp", tensors=(nm.c * d, nm.c * kv)),
        Item("v", nm.c * kv, "tp", tensors=(nm.c * kv,)),
        Item("attention out + logsumexp", nm.c * d + 4 * h, "tp", tensors=(nm.c * d, 4 * h)),
    ]


def block_items(
    args: ModelArgs,
    nm: Numerics,
    *,
    first_lora_block: bool = False,
    moe_factor: float = 1.0,
    backend: Backend = "flash",
    path: Path = "eager",
) -> list[Item]:
    """Saved tensors of one transformer block with no recomputation, bytes per token.
    `moe_factor` scales the MLP items (top_k for a MoE block: every token visits top_k experts);
    `path` is the block's speed path (module docstring)."""
    if path == "compile" and backend != "math":
        return compiled_block_items(args, nm, moe_factor)
    d, f = args.dim, args.ffn_dim
    half = 2 if args.family.startswith("gemma") else 1  # norms per sub-layer: Gemma's before and after each
    items = []
    for mlp_half in (False, True):
        norms = half - (1 if first_lora_block and not mlp_half else 0)  # block 0 of LoRA: its first norm keeps nothing
        if path == "kernels":  # the fused RMSNorm keeps its input (as is) and rstd
            kept = (nm.x * d, 4.0) * norms
            items.append(Item("norm: input + rstd (fused)", norms * (nm.x * d + 4), "sp", mlp=mlp_half, tensors=kept))
        else:
            kept = (4.0 * d, 4.0) * norms
            items.append(Item("norm: fp32 input + rstd", norms * (4 * d + 4), "sp", mlp=mlp_half, tensors=kept))
            if nm.full:
                normalised = (float(nm.x * d),) * half
                items.append(
                    Item("norm: normalised (weight grad)", half * nm.x * d, "sp", mlp=mlp_half, tensors=normalised)
                )
    qkv_in = _input_copy_tensors(nm, QKV, d)
    items.append(Item("q/k/v input", sum(qkv_in), tensors=qkv_in))
    items += _attention_items(args, nm, backend)
    if "o_proj" in nm.targets and nm.a != nm.c:
        items.append(Item("o_proj adapter input copy", nm.a * d, "tp", tensors=(nm.a * d,)))
    swiglu = 2 if path == "kernels" else 3  # the fused SwiGLU recomputes silu in backward
    gate_up_in = _input_copy_tensors(nm, GATE_UP, d)
    ffn = nm.c * f * moe_factor
    items += [
        Item("gate/up input", sum(gate_up_in), mlp=True, tensors=gate_up_in),
        Item("SwiGLU gate, silu, up", swiglu * ffn, "tp", mlp=True, tensors=(ffn,) * swiglu),
    ]
    if nm.full or "down_proj" in nm.targets:
        down = (nm.c if nm.full else nm.a) * f * moe_factor
        items.append(Item("down input", down, "tp", mlp=True, tensors=(down,)))
    if nm.targets:
        lora_a = (float(nm.a * nm.rank),) * len(nm.targets)
        items.append(Item("LoRA A outputs", len(nm.targets) * nm.a * nm.rank, tensors=lora_a))
    items += dora_items(args, nm)
    return [i for i in items if i.per_token or i.per_token_seq]


def tiled_block_items(
    items: list[Item], args: ModelArgs, nm: Numerics, tile_tokens: int = 0
) -> tuple[list[Item], list[Item]]:
    """A block with the tiled norm + MLP (memory/tiled_mlp.py): (what it keeps per token of the whole
    sequence, what one tile keeps per token of the tile). The feed-forward half keeps only its input, a
    view of the mid residual (a slice of `tile_tokens` per tile); its own items exist for one tile at a
    time, in its backward."""
    width = float(nm.x * args.dim)
    tiles = Item("tile inputs (mid residual)", width, "sp", tensors=(width,), tile_tokens=tile_tokens)
    kept = [i for i in items if not i.mlp] + [tiles]
    return kept, [i for i in items if i.mlp]


def compiled_block_items(args: ModelArgs, nm: Numerics, moe_factor: float = 1.0) -> list[Item]:
    """Saved tensors of one torch.compile'd block (module docstring), bytes per token."""
    d, kv, f, h = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    trains = (lambda name: True) if nm.full else (lambda name: name in nm.targets)
    width = nm.c if nm.full else nm.a
    items = [
        Item("block input" + ("" if nm.full else " + mid residual"), (1 if nm.full else 2) * nm.x * d, "sp"),
        Item("norms: rstd", 8, "sp"),
    ]

    # With `recompute_pointwise` the adapters' inputs that are pointwise results (the post-attention norm's
    # output, o_proj's contiguous copy of the attention output, SwiGLU's output) are recomputed in backward.
    def kept(name: str) -> bool:
        return trains(name) and not nm.recompute_pointwise

    if nm.full:
        items.append(Item("norm outputs (compute dtype)", 2 * nm.c * d))
    elif any(kept(n) for n in GATE_UP):
        items.append(Item("gate/up input", width * d, mlp=True))
    items += [
        Item("q, k, v after RoPE", nm.c * (d + 2 * kv), "tp"),
        Item("attention out + logsumexp", nm.c * d + 4 * h, "tp"),
    ]
    if kept("o_proj"):
        items.append(Item("o_proj input (contiguous copy)", width * d, "tp"))
    items.append(Item("SwiGLU gate, up", 2 * nm.c * f * moe_factor, "tp", mlp=True))
    if kept("down_proj"):
        items.append(Item("down input", width * f * moe_factor, "tp", mlp=True))
    if nm.targets:
        items.append(Item("LoRA A outputs", len(nm.targets) * nm.a * nm.rank))
    return items + dora_items(args, nm)


def block_input_alias(args: ModelArgs, nm: Numerics, path: Path) -> float:
    """Bytes per token of a block's saved tensors that are its input itself, not a copy: the fused RMSNorm
    keeps its input as is, a compiled block saves its input, and the eager RMSNorm's `x.float()` is x
    when the residual stream is already float32. Under full recomputation that input is the checkpoint's
    kept tensor, so the recomputed block must not count it twice."""
    if path in ("kernels", "compile") or (path == "eager" and nm.x == 4):
        return nm.x * args.dim
    return 0.0


def residual_gradient(args: ModelArgs, nm: Numerics) -> Item:
    """d loss / d residual stream, alive through a block's whole backward (the residual add hands the
    same gradient to the branch and to the skip path, summed at the block's input)."""
    return Item("residual-stream gradient", nm.x * args.dim, "sp")


def attention_backward_items(args: ModelArgs, nm: Numerics, backend: Backend) -> list[Item]:
    """Buffers of one block's attention backward beyond its saved tensors, bytes per token, at the
    attention kernel's backward (the largest moment of a block whose MLP is tiled or already done).

    Flash (PyTorch's FlashAttention-2 `mha_bwd`): the output's gradient (from o_proj's backward), the
    gradients dq, dk, dv it returns, its float32 dq accumulator (heads x head_dim per token) and the
    row statistic softmax_d (float32, per head); with grouped-query attention it computes dk and dv for
    every query head and sums them per group afterwards (two more query-width buffers). Memory-efficient
    and FlexAttention: the output's gradient, dq, dk, dv and the row statistic. Math: those and the
    gradient of the (b, h, s, s) probabilities in float32. Plus the residual-stream gradient."""
    q, kv, h = args.q_dim, args.n_kv_heads * args.head_dim, args.n_heads
    items = [
        residual_gradient(args, nm),
        Item("attention output gradient", nm.c * q, "tp"),
        Item("dq, dk, dv", nm.c * (q + 2 * kv), "tp"),
        Item("softmax_d (float32 row statistic)", 4 * h, "tp"),
    ]
    if backend == "flash":
        items.append(Item("flash dq accumulator (float32)", 4 * q, "tp"))
        if kv < q:
            items.append(Item("dk, dv for every query head (GQA)", 2 * nm.c * q, "tp"))
    if backend == "math":
        items.append(Item("probabilities gradient (math SDPA)", 0.0, "tp", per_token_seq=4 * h))
    return items


def mlp_backward_items(args: ModelArgs, nm: Numerics, moe_factor: float = 1.0) -> list[Item]:
    """Buffers of one block's SwiGLU backward beyond its saved tensors, bytes per token: the gradient
    of its output (down_proj's input gradient) and of gate and up, alive together at the SwiGLU
    backward (the residual-stream gradient comes on top: `residual_gradient`)."""
    f = args.ffn_dim * moe_factor
    return [
        Item("SwiGLU output gradient", nm.c * f, "tp", mlp=True),
        Item("gate, up gradients", 2 * nm.c * f, "tp", mlp=True),
    ]


def compiled_recomputed_mlp_backward_items(args: ModelArgs, nm: Numerics, moe_factor: float = 1.0) -> list[Item]:
    """Buffers of a compiled block's SwiGLU backward under full recomputation, beyond the block's saved
    tensors (`compiled_block_items`, rematerialised), bytes per token.

    The compiled backward reruns the block's forward inside its own graph, and Inductor fuses the LoRA
    adds (base output + scaled adapter output) of gate and up into the SwiGLU backward kernel: the base
    and adapter matmul outputs of each adapted projection are that kernel's separate inputs, beside the
    two parts of the SwiGLU output's gradient (down_proj's base and adapter input gradients). Its outputs:
    the gate and up gradients for the base matmuls, one more of each, scaled, for the adapted ones' LoRA
    matmuls, and SwiGLU's output when down_proj's adapter needs it (the "down input" of the saved set;
    a tensor of its own here when `recompute_pointwise` left it out of the saved set). All are live at
    the kernel: 11 ffn-wide tensors with every MLP projection adapted, as the compiled block's backward
    allocates them on the CPU (tests/plan/test_plan_speed_path.py) and the H200 allocator's history
    shows them (benchmarks/results/long_context_peak_NVIDIA-H200.json, the compiled rows). Where
    down_proj has no adapter Inductor writes one gradient over a dead input, not counted here (one
    ffn-wide tensor high). Without adapters in the MLP this is `mlp_backward_items`."""
    f = args.ffn_dim * moe_factor
    adapted = sum(n in nm.targets for n in GATE_UP)
    down = "down_proj" in nm.targets
    items = [
        Item("SwiGLU output gradient (base + adapter parts)", (nm.c + (nm.a if down else 0)) * f, "tp", mlp=True),
        Item("gate, up gradients", 2 * nm.c * f, "tp", mlp=True),
        Item("gate/up adapter outputs (apart from the base outputs)", adapted * nm.a * f, "tp", mlp=True),
        Item("gate/up gradients scaled for their adapters", adapted * nm.a * f, "tp", mlp=True),
    ]
    if down and nm.recompute_pointwise:
        items.append(Item("SwiGLU output (down adapter's input)", nm.a * f, "tp", mlp=True))
    return [i for i in items if i.per_token]


def selective_items(args: ModelArgs, nm: Numerics, moe_factor: float = 1.0) -> list[Item]:
    """Selective recomputation keeps the block input and every matmul / SDPA output."""
    d, kv, f, h = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    items = [
        Item("block input", nm.x * d, "sp"),
        Item("q/k/v outputs", nm.c * (d + 2 * kv), "tp"),
        Item("attention out + logsumexp", nm.c * d + 4 * h, "tp"),
        Item("o/down outputs (partial sums)", 2 * nm.c * d),
        Item("gate/up outputs", 2 * nm.c * f * moe_factor, "tp"),
    ]
    if nm.targets:
        outs = {"q_proj": d, "k_proj": kv, "v_proj": kv, "o_proj": d, "gate_proj": f, "up_proj": f, "down_proj": d}
        items.append(Item("LoRA A/B outputs", sum(nm.a * (nm.rank + outs[t]) for t in nm.targets)))
    return items


def full_recompute_items(args: ModelArgs, nm: Numerics) -> list[Item]:
    return [Item("block input", nm.x * args.dim, "sp", tensors=(float(nm.x * args.dim),))]


def outside_items(
    args: ModelArgs, nm: Numerics, *, first_stage: bool, last_stage: bool, fused_ce: bool = False
) -> list[Item]:
    """Saved tensors outside the blocks: rotary tables, token ids, final norm, lm_head input (the fused
    cross-entropy keeps its input gradient instead: `fused_ce_items`)."""
    d = args.dim
    items = [Item("RoPE cos/sin", 2 * 4 * args.head_dim)]
    if first_stage and nm.full:
        items.append(Item("token ids", 8))
    if last_stage:
        items.append(Item("final norm", 4 * d + 4 + (nm.x * d if nm.full else 0), "sp", loss_side=True))
        if nm.full and not fused_ce:
            items.append(Item("lm_head input", nm.c * d, loss_side=True))
    return items


def fused_ce_items(args: ModelArgs, nm: Numerics, chunk_tokens: float) -> tuple[Affine, Affine]:
    """(forward, backward start) buffers of kernels/fused_ce.py at its peak, as Affine (bytes).

    Forward, while a chunk runs: the final norm's output (x*d per token) and its compute-dtype cast
    (c*d, when x != c), the per-token losses (4), d loss / d hidden (c*d, computed in the forward and
    saved), one chunk's bf16 logits (2V x chunk rows), the head weight cast to the compute dtype (c*V*d,
    when the weight is wider), and with a trained head its float32 gradient (4Vd) and one chunk's bf16
    partial of it (2Vd). Backward start: the saved c*d and 4Vd, the scaled input gradient (c*d, then
    x*d in the hidden's dtype) and the scaled weight gradient (4Vd)."""
    d, v = args.dim, args.vocab_size
    head_trains = nm.full
    fwd_token = nm.x * d + (nm.c * d if nm.x != nm.c else 0) + 4 + nm.c * d
    fwd_const = 2 * v * chunk_tokens + (nm.c * v * d if nm.w != nm.c else 0) + (6 * v * d if head_trains else 0)
    bwd_token = 2 * nm.c * d + nm.x * d
    bwd_const = 8 * v * d if head_trains else 0.0
    return Affine(fwd_const, fwd_token), Affine(bwd_const, bwd_token)


def loss_forward_per_token(args: ModelArgs, nm: Numerics) -> float:
    """Logits, their fp32 copy and the saved log-probs, alive together during cross_entropy."""
    return args.vocab_size * (nm.c + (4 if nm.c != 4 else 0) + 4)


def loss_backward_per_token(args: ModelArgs) -> float:
    """Saved log-probs + nll_loss's gradient + log_softmax's input gradient, all fp32."""
    return 12.0 * args.vocab_size


def loss_saved_per_token(args: ModelArgs) -> float:
    """What a micro-batch keeps between its forward and backward: the fp32 log-probs."""
    return 4.0 * args.vocab_size


def shard(items: list[Item], tp: int, sequence_parallel: bool) -> Affine:
    """Sum of `items` on one tensor-parallel rank, as bytes per token (const = 0)."""
    total = Affine()
    for i in items:
        div = tp if i.split == "tp" or (i.split == "sp" and sequence_parallel) else 1
        total += Affine(0.0, i.per_token / div, i.per_token_seq / div)
    return total
