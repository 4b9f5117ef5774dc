"""FP8 LoRA keeps the frozen bf16 base weights on the host (kernels/fp8.py): the step reads only the FP8
copies, and merge, re-quantisation after a load and the state dict work from the host copy. CUDA only
(on the CPU nothing moves); run on the GPU machine."""

import pytest
import torch

from tracetrain.kernels.fp8 import Float8FrozenLinear
from tracetrain.kernels.fp8_apply import apply_fp8
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import LoRALinear, apply_lora, merge_lora

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)",
)
ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=128)


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ARGS).cuda()
    model.init_weights()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "v_proj"], base_dtype=torch.bfloat16)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
    return model


@needs_fp8_gpu
def test_frozen_bases_move_to_the_host_and_the_step_still_runs():
    ref, model = _model(), _model()
    before = torch.cuda.memory_allocated()
    count = apply_fp8(model, "rowwise")
    fp8 = [m for m in model.modules() if isinstance(m, Float8FrozenLinear)]
    assert count == len(fp8) == 7 * ARGS.n_layers
    assert all(m.weight.device.type == "cpu" and m.get_buffer("fp8_w").is_cuda for m in fp8)
    # GPU bytes: bf16 (2 per weight) out, two E4M3 copies (1 + 1) in, plus the scales: about even.
    frozen = sum(m.weight.numel() for m in fp8)
    assert abs((torch.cuda.memory_allocated() - before) - 0) < 0.1 * 2 * frozen
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens).float().logsumexp(-1).mean()
        loss_ref = ref(tokens).float().logsumexp(-1).mean()
    loss.backward()
    assert abs(loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters() if p.requires_grad)


@needs_fp8_gpu
def test_merge_and_state_dict_use_the_host_copy_and_a_load_requantises():
    ref, model = _model(), _model()
    apply_fp8(model, "rowwise")
    # merge: W + s * B @ A from the host weight and the GPU adapters, equal to the bf16 model's merge
    lora = [m for m in model.modules() if isinstance(m, LoRALinear)]
    lora_ref = [m for m in ref.modules() if isinstance(m, LoRALinear)]
    for m, r in zip(lora, lora_ref):
        torch.testing.assert_close(m.merged_weight().cpu(), r.merged_weight().cpu(), rtol=0, atol=0)
    # a state dict loaded into the host weights (a resume) makes the next forward re-quantise on the GPU
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for k in state:
        if k.endswith("mlp.up_proj.weight"):
            state[k].mul_(-2.0)
    model.load_state_dict(state)
    up = model.layers[0].mlp.up_proj
    assert isinstance(up, Float8FrozenLinear) and up.weight.device.type == "cpu"
    assert up.refresh_if_stale() and not up.refresh_if_stale()
    assert up.get_buffer("fp8_w").is_cuda
    merge_lora(model)  # the plain linears come back, their weights on the host, merged
    assert model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
