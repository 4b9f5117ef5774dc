"""Preference objectives against TRL: the DPO loss and gradients of tracetrain's real step equal TRL's
DPOTrainer on the same tiny transformers model and pairs (LoRA with the adapters-off reference, and full
fine-tuning with a frozen copy); SimPO and label-smoothed DPO equal TRL's CPO loss on the same log-probs.

TRL's side is its own trainer: `DPOTrainer.compute_loss` on the batch its data loader collates (its
tokenisation, its padding, its reference forward). Ours is that batch's pairs repacked as preference rows
(the packer preference data goes through) and `forward_backward`, the step's own function.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl", reason="the DPO parity tests need trl (pip install 'tracetrain[dpo-check]')")
transformers = pytest.importorskip("transformers", reason="the DPO parity tests need transformers")

from tracetrain.config import load_config  # noqa: E402
from tracetrain.data.packing import compact_document, iter_packed_rows  # noqa: E402
from tracetrain.spec import resolve  # noqa: E402
from tracetrain.train.assemble import assemble, run_step_context  # noqa: E402
from tracetrain.train.preference import PreferenceObjective  # noqa: E402
from tracetrain.train.step import forward_backward  # noqa: E402

VOCAB = 96
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=1,
    tie_word_embeddings=False,
)


def word_tokenizer():
    """A fast tokenizer whose word "tN" is id N: '<pad>' = 0, '<eos>' = 1 (TRL needs a processing class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(2, VOCAB)} | {"<pad>": 0, "<eos>": 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def pairs(n: int) -> list[dict[str, str]]:
    """Pairs of different lengths (TRL pads them; we pack them)."""
    g = torch.Generator().manual_seed(0)
    words = lambda k: " ".join(f"t{i}" for i in torch.randint(2, VOCAB, (k,), generator=g).tolist())  # noqa: E731
    return [
        {"prompt": words(3 + i), "chosen": " " + words(2 + i % 3), "rejected": " " + words(4 - i % 2)} for i in range(n)
    ]


def trl_batch_and_grads(tmp_path: Path, lora: bool) -> tuple[torch.Tensor, dict, dict, dict[str, torch.Tensor]]:
    """(TRL's loss, its collated batch, {its metrics, the policy's trained weights}, the trained parameters'
    gradients by name) for one step."""
    import datasets

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attn_implementation="eager"))
    model.save_pretrained(tmp_path / "hf")
    # fp32 throughout (DPOConfig defaults to bf16, which accelerate would apply to the reference alone here).
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        use_cpu=True,
        beta=0.5,
        bf16=False,
        report_to="none",
        gradient_checkpointing=False,
        max_length=64,
        seed=0,
    )
    peft_config = None
    if lora:
        import peft

        peft_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    # Full fine-tuning: TRL's reference is a frozen copy, as ours (it would load one from the model's hub name).
    ref_model = None if lora else copy.deepcopy(model).eval()
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        processing_class=word_tokenizer(),
        train_dataset=datasets.Dataset.from_list(pairs(4)),
        peft_config=peft_config,
    )
    policy = trainer.model
    # Move the policy away from the reference, as after some training: LoRA's B = 0 at init would make A's
    # gradient 0, and full fine-tuning's policy equals its reference copy at step 0 (loss log 2).
    g = torch.Generator().manual_seed(1)
    moved = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in moved.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 if lora else p + torch.randn(p.shape, generator=g) * 0.05)
    batch = next(iter(trainer.get_train_dataloader()))
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    grads = {_plain_name(n): p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    weights = {_plain_name(n): p.detach().clone() for n, p in moved.items()}
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train" if policy.training else "eval"].items()}
    return loss.detach(), batch, {"metrics": metrics, "weights": weights}, grads


def _plain_name(name: str) -> str:
    """A transformers / PEFT parameter name -> tracetrain's (`layers.0.self_attn.q_proj.lora_A.weight`)."""
    for prefix in ("base_model.model.", "model."):
        name = name.removeprefix(prefix)
    return name.replace(".default.", ".").replace(".base_layer.", ".base.")


def rows_of(batch: dict) -> dict[str, torch.Tensor]:
    """TRL's collated batch ([chosen; rejected], right-padded, completion_mask) -> our preference rows."""
    n = batch["input_ids"].shape[0] // 2
    docs = []
    for i in range(n):
        for j in (i, n + i):  # chosen, then its rejected
            keep = batch["attention_mask"][j].bool()
            ids, completion = batch["input_ids"][j][keep].tolist(), batch["completion_mask"][j][keep].bool().tolist()
            docs.append(compact_document(ids, completion))
    return next(iter_packed_rows(docs, 64, pad_id=0, pack=True, chunk_rows=64, group=2))


def our_loss_and_grads(tmp_path: Path, lora: bool, batch: dict, weights: dict) -> tuple:
    """Our loss, statistics and gradients of the step on TRL's pairs, with TRL's policy weights (the
    reference: the checkpoint's, as TRL's)."""
    mode = "lora" if lora else "full"
    cfg = load_config(
        None,
        [
            f"--model.init_from={tmp_path / 'hf'}",
            f"--train.mode={mode}",
            "--train.objective=dpo",
            "--data.kind=preference",
            "--data.path=unused.jsonl",
            "--data.seq_len=64",
            "--preference.beta=0.5",
            "--lora.rank=4",
            "--lora.alpha=8",
            "--lora.targets=['q_proj', 'v_proj']",
            "--train.attention=sdpa",
        ],
    )
    built = assemble(resolve(cfg, torch.device("cpu")))
    model = built.module
    with torch.no_grad():
        for name, value in weights.items():
            model.get_parameter(name).copy_(value)
    ctx = run_step_context(built)
    stats: dict[str, torch.Tensor] = {}
    loss = forward_backward(model, [rows_of(batch)], ctx, stats)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss, stats, grads, built


@pytest.mark.parametrize("lora", [True, False], ids=["lora-adapters-off", "full-frozen-copy"])
def test_dpo_loss_and_gradients_equal_trl_dpotrainer(tmp_path: Path, lora: bool) -> None:
    trl_loss, batch, extra, trl_grads = trl_batch_and_grads(tmp_path, lora)  # TRL's loss first: it moves the policy
    loss, stats, grads, built = our_loss_and_grads(tmp_path, lora, batch, extra["weights"])
    assert built.spec.reference == ("adapters_off" if lora else "copy")
    assert abs(float(trl_loss) - 0.6931) > 1e-3, "the pairs must move the loss away from log 2, or it proves little"
    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(trl_grads), set(grads) ^ set(trl_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, trl_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    m = extra["metrics"]
    for ours, theirs in (
        ("reward_chosen", "rewards/chosen"),
        ("reward_rejected", "rewards/rejected"),
        ("reward_margin", "rewards/margins"),
        ("reward_accuracy", "rewards/accuracies"),
    ):
        assert abs(float(stats[ours]) - m[theirs]) < 1e-5, (ours, float(stats[ours]), m[theirs])


def trl_cpo_loss(loss_type: str, beta: float, smoothing: float, gamma: float, chosen, rejected):
    """TRL's CPOTrainer.cpo_loss (SimPO and the smoothed sigmoid loss) on given sequence scores."""
    from trl.experimental.cpo import CPOTrainer

    owner = SimpleNamespace(
        alpha=0.0,
        beta=beta,
        label_smoothing=smoothing,
        simpo_gamma=gamma,
        loss_type=loss_type,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    return CPOTrainer.cpo_loss(owner, chosen, rejected)


def sums_of(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """(pairs, 2) summed log-probs and (pairs, 2) token counts -> per-document sums (1, 2 * pairs, 2)."""
    return torch.stack([logps, counts], dim=-1).reshape(1, -1, 2)


def test_simpo_equals_trl_cpo_simpo_loss() -> None:
    g = torch.Generator().manual_seed(0)
    logps, counts = -torch.rand(5, 2, generator=g) * 30, torch.randint(3, 20, (5, 2), generator=g).float()
    objective = PreferenceObjective("simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.7)
    loss, stats = objective.pair_losses(sums_of(logps, counts), None)
    avg = logps / counts
    losses, chosen, rejected = trl_cpo_loss("simpo", 2.0, 0.1, 0.7, avg[:, 0], avg[:, 1])
    torch.testing.assert_close(loss, losses.sum())
    torch.testing.assert_close(stats["reward_margin"], (chosen - rejected).sum())
    torch.testing.assert_close(stats["reward_accuracy"], (chosen > rejected).float().sum())


def test_label_smoothed_dpo_equals_trl_conservative_sigmoid_loss() -> None:
    """cDPO: TRL's smoothed sigmoid loss (CPOTrainer's) on the policy-minus-reference log-ratios."""
    g = torch.Generator().manual_seed(1)
    policy, reference = -torch.rand(6, 2, generator=g) * 30, -torch.rand(6, 2, generator=g) * 30
    counts = torch.full((6, 2), 5.0)
    objective = PreferenceObjective("dpo", beta=0.3, label_smoothing=0.2)
    loss, _ = objective.pair_losses(sums_of(policy, counts), sums_of(reference, counts))
    ratios = policy - reference
    losses, _, _ = trl_cpo_loss("sigmoid", 0.3, 0.2, 0.0, ratios[:, 0], ratios[:, 1])
    torch.testing.assert_close(loss, losses.sum())
