"""Mixture-of-experts feed-forward (Mixtral-style) and the transform that puts it into a dense model.

`MoEFeedForward` replaces a block's SwiGLU `mlp`:
- router: a bias-free linear layer (dim -> num_experts); softmax in float32; each token goes to its
  top-k experts, weighted by their renormalised probabilities (Mixtral), or by the probabilities as
  they are (`norm_topk` False: Qwen3-MoE checkpoints with norm_topk_prob false).
- experts: `GroupedExperts` holds all experts' SwiGLU weights as batched tensors
  (num_experts, ffn_dim, dim) / (num_experts, dim, ffn_dim); there is no token dropping (no capacity
  limit): each expert runs on exactly the tokens routed to it.
- the dispatcher moves tokens to their experts and back. `LocalDispatcher` (default) sorts the
  token-expert pairs by expert; expert parallelism swaps in an all-to-all dispatcher
  (tracetrain/parallel/expert_parallel.py). The block never knows which one it has.
- load balancing (Switch Transformer): aux = num_experts * sum_e f_e * P_e, with f_e the share of
  token-expert assignments that went to expert e and P_e the mean router probability of e, per
  micro-batch and rank. Its gradient, times `aux_loss_weight`, is injected into the backward pass
  (as Megatron's aux-loss scaler does), so the training step's loss function is unchanged;
  `last_aux_loss` keeps the value for logging. Set the weight with `set_aux_loss_weight` to
  moe_aux_loss_coef / (forward passes per step * ranks with different tokens (dp * cp)); forward
  passes are grad_accum_steps, or pp_microbatches under pipeline parallelism. The injected gradients
  are then the mean of the per-micro-batch, per-rank losses, as gradients are summed over ranks.

Parameter names: `layers.N.mlp.router.weight`, `layers.N.mlp.experts.{gate,up,down}_proj`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """SwiGLU experts with batched weights; `forward` runs expert e on its contiguous group of rows."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down) for the experts this module computes (all of them here; EP overrides)."""
        return self.gate_proj, self.up_proj, self.down_proj

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (num_rows, dim) grouped by expert, `counts[e]` rows for expert e -> (num_rows, dim)."""
        gate, up, down = self.weights()
        outs = []
        for e, rows in enumerate(x.split(counts)):
            h = F.silu(rows @ gate[e].t()) * (rows @ up[e].t())  # (rows, ffn_dim)
            outs.append(h @ down[e].t())
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.gate_proj, std=std)
        nn.init.normal_(self.up_proj, std=std)
        nn.init.normal_(self.down_proj, std=out_std)


class LocalDispatcher:
    """All experts on this rank: sort token-expert pairs by expert, run, weight and sum back."""

    def __call__(
        self, tokens: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor:
        # tokens (T, dim); expert_idx, weights (T, top_k)
        top_k = expert_idx.shape[1]
        flat = expert_idx.flatten()  # (T * top_k,)
        order = flat.argsort(stable=True)
        token_of = order // top_k  # source token of each sorted pair
        # Host sync: group sizes decide the split (a grouped-GEMM kernel would avoid it on GPUs).
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
        y = experts(tokens[token_of], counts)  # (T * top_k, dim)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(tokens).index_add_(0, token_of, y.to(tokens.dtype))


class _InjectAuxLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, gives `aux` the gradient `weight` (d(weight * aux) / d aux)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux_meta = weight, (aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        dtype, device = ctx.aux_meta
        return grad_out, torch.tensor(ctx.weight, dtype=dtype, device=device), None


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss; probs (T, E) float32, expert_idx (T, top_k). 1.0 = balanced."""
    num_experts = probs.shape[1]
    counts = torch.bincount(expert_idx.flatten(), minlength=num_experts).to(probs.dtype)
    share = counts / expert_idx.numel()  # f_e (no gradient)
    return num_experts * (share * probs.mean(0)).sum()


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts in place of a dense MLP: (batch, seq, dim) -> (batch, seq, dim)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk: bool = True,
        aux_loss_weight: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in 1..num_experts ({num_experts})")
        self.num_experts, self.top_k, self.aux_loss_weight = num_experts, top_k, aux_loss_weight
        self.norm_topk = norm_topk  # Mixtral renormalises the top-k probabilities; Qwen3-MoE may not
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, ffn_dim)
        self.dispatcher = LocalDispatcher()
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(b * s, d)  # (T, dim)
        probs = self.router(tokens).float().softmax(dim=-1)  # (T, num_experts)
        top_p, expert_idx = probs.topk(self.top_k, dim=-1)  # (T, top_k)
        weights = top_p / top_p.sum(dim=-1, keepdim=True) if self.norm_topk else top_p
        out = self.dispatcher(tokens, expert_idx, weights, self.experts)
        if self.training and torch.is_grad_enabled():
            aux = load_balancing_loss(probs, expert_idx)
            self.last_aux_loss = aux.detach()
            if self.aux_loss_weight > 0:
                out = _InjectAuxLossGrad.apply(out, aux, self.aux_loss_weight)
        return out.view(b, s, d)


def apply_moe(model: nn.Module, num_experts: int, top_k: int, aux_loss_weight: float = 0.0) -> int:
    """Replace every block's dense `mlp` by a freshly initialised `MoEFeedForward`, in place.

    Experts keep the dense MLP's ffn_dim. Weights are drawn from the global RNG (seed it first):
    router and gate/up with `model.args.init_std`, down_proj scaled by 1 / sqrt(2 * n_layers) like
    the dense output projections. Returns the number of blocks converted.
    """
    args = model.args
    std = args.init_std  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    out_std = std / math.sqrt(2 * args.n_layers)  # type: ignore[operator, union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    for block in model.layers:  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        dense = block.mlp
        ref = dense.gate_proj.weight
        moe = MoEFeedForward(args.dim, args.ffn_dim, num_experts, top_k, aux_loss_weight=aux_loss_weight)  # type: ignore[arg-type, union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        moe.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            nn.init.normal_(moe.router.weight, std=std)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        moe.experts.init_weights(std, out_std)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        block.mlp = moe
    return len(model.layers)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs


def set_aux_loss_weight(model: nn.Module, weight: float) -> None:
    """Set the injected load-balancing gradient weight of every MoE block (see module docstring)."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.aux_loss_weight = weight


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum over blocks of the last forward's load-balancing losses (detached), for logging."""
    values = [m.last_aux_loss for m in model.modules() if isinstance(m, MoEFeedForward) and m.last_aux_loss is not None]
    return torch.stack(values).sum() if values else None
