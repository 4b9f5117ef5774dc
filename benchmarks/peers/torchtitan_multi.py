#!/usr/bin/env python3
# Launch (GPU machine, checkout root), e.g. the 8B with FSDP over 2 GPUs:
#   PYTHONPATH=$PEERSITE HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 \
#       benchmarks/peers/torchtitan_multi.py --flavour 8B --batch 2 --ac full --dp-shard 2 --data <text file> --no-cudagraphs
"""Peer benchmark: torchtitan (0.3.0) pre-training steps on one or several GPUs of one host, offline,
Llama-3.2-1B shape (torchtitan's own llama3 "1B" flavour: dim 2048, 16 layers, 32/8 heads, ffn 8192,
vocab 128256, rope theta 5e5, tied embeddings) or its "8B" flavour; FSDP over --dp-shard ranks, tensor
parallelism over --tp (the product is the world size).

A copy of ../shared/peers/torchtitan_peer.py (one GPU) made to run on several ranks. torchtitan 0.3.0 is
released against torch 2.14, whose `fully_shard` takes a `dp_mesh_dims=DataParallelMeshDims(...)`
argument; its default SPMD backend ("spmd_types") builds one on every mesh of more than one rank, and
torch 2.11 has neither the class nor the argument (the one-GPU script's empty stand-in class fails with
"DataParallelMeshDims() takes no arguments" on 2 ranks). This script runs torchtitan's other supported
backend, "partial_dtensor" (--spmd-backend; DTensor for the model-parallel axes only, FSDP2 over the
"fsdp" mesh of dp_shard * cp, its mesh built with DeviceMesh._unflatten / _flatten, both in torch 2.11),
which never builds or passes DataParallelMeshDims; the stand-in class is now a dataclass with the
fields of torch 2.14's (shard, replicate) so that any construction still succeeds. Not yet run on a GPU
when written (2026-11-28); run on the CPU (--cpu-test, gloo, torch 2.13, the "debugmodel" flavour, with
torchtitan's expert-parallel Triton kernel module stubbed since that machine has no triton): FSDP over
2 ranks and TP 2 (with --ac full) both train 4 steps and print their JSON line. torch 2.11's own
DeviceMesh and fully_shard were not run: what it needs was read in torchtitan 0.3.0's parallel_dims.py,
full_dtensor.py, fsdp.py, llama3/parallelize.py and loss.py (the one-GPU script runs the same mesh
code on 2.11).

The Trainer.Config is built in code, following torchtitan's llama3 config registry: FSDP2 over the
data-parallel ranks (bf16 params / fp32 reduce, fp32 master weights), per-TransformerBlock torch.compile +
compiled cross-entropy (chunked on torch>=2.13, plain on 2.11: see --loss), FlexAttention,
CUDA-graphed fwd+bwd (torchtitan's default), fused AdamW; no checkpoint, validation or profiling.
Tokenizer: a byte-level HF tokenizer padded to the model vocab is written to --workdir.
Data: the --data text file, cut into documents of seq-1 bytes (= exactly one training sequence
each, so torchtitan's block-causal mask is the plain causal mask), registered in its dataset registry.
tokens/s, MFU and memory come from torchtitan's own MetricsProcessor (its metric logger is swapped
for a recorder; log_freq=1 and every logged step ends with a host sync, so per-step tps is
wall-clock; tokens/s is per GPU: torchtitan divides by the non-data-parallel size). Printed at the end
by rank 0 as ONE JSON line: medians over steps after --skip; "mfu" is a fraction (torchtitan:
6*N_params + 6*L*H*2*head_dim*seq flops/token over the GPU's peak; None under float8); "peak_gib" = max
torch.cuda.max_memory_allocated over those steps and over the ranks.
Runs under torchrun or plain `python3` (a 1-rank env:// group is then set up). --cpu-test: CPU/gloo.
"""
import argparse
import inspect
import json
import os
import socket
import statistics
import types

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--data", default="shared/data/tinyshakespeare.txt", help="local UTF-8 text file")
ap.add_argument("--flavour", default="1B", choices=["1B", "8B", "debugmodel"])
ap.add_argument("--layers", type=int, default=0, help="keep only the first N blocks (0: all)")
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--skip", type=int, default=10, help="first steps left out of the median")
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--lr", type=float, default=3e-4)
ap.add_argument("--ac", default="none", choices=["none", "selective", "full"])
ap.add_argument("--no-compile", action="store_true")
ap.add_argument("--no-cudagraphs", action="store_true", help="eager fwd+bwd instead of a CUDA graph")
ap.add_argument("--float8", action="store_true", help="torchtitan Float8LinearConverter (torchao)")
ap.add_argument("--float8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
ap.add_argument("--loss", default="auto", choices=["auto", "chunked", "ce"],
                help="chunked CE (torchtitan recipe) breaks FSDP backward on torch<2.13; auto: ce there")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                help="param/grad/optimizer-state dtype (float32 = mixed precision with fp32 master weights)")
ap.add_argument("--cpu-offload", action="store_true", help="FSDP CPU offload of params/grads/optimizer")
ap.add_argument("--dp-shard", type=int, default=-1, help="FSDP degree (-1: the ranks --tp leaves)")
ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
ap.add_argument("--spmd-backend", default="partial_dtensor", choices=["partial_dtensor", "spmd_types"],
                help="spmd_types (torchtitan's default) needs torch >= 2.14 on more than one rank")
ap.add_argument("--workdir", default="/tmp/torchtitan_peer")
ap.add_argument("--cpu-test", action="store_true", help="run on CPU with gloo (tiny configs only)")
args = ap.parse_args()

if "RANK" not in os.environ:  # plain `python3`: be a 1-rank torchrun job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
for k, v in dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false").items():
    os.environ.setdefault(k, v)

import torch  # noqa: E402

if args.cpu_test:  # torchtitan falls back to "cuda" without an accelerator: make the CPU the device
    import torch._utils
    torch._utils._get_available_device_type = lambda: "cpu"
    for _n, _f in dict(get_device_name=lambda *a: "cpu", memory_stats=lambda *a: {},
                       get_device_properties=lambda *a: types.SimpleNamespace(total_memory=2**34),
                       reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None).items():
        if not hasattr(torch.cpu, _n):
            setattr(torch.cpu, _n, _f)
    torch.cpu.current_device = lambda: 0  # "cpu" breaks barrier(device_ids=[...])
# torchtitan 0.3.0 is released against torch 2.14. Three shims let it run on older torch (2.11):
import torch.distributed.distributed_c10d as _c10d  # noqa: E402
import torch.distributed.fsdp as _fsdp  # noqa: E402
import torch.nn.attention.flex_attention as _flex  # noqa: E402

if not hasattr(_fsdp, "DataParallelMeshDims"):
    # Imported at module level by torchtitan; built by resolve_fsdp_mesh under the spmd_types and
    # full_dtensor backends only (not run here: --spmd-backend partial_dtensor), and then passed to
    # torch 2.14's fully_shard(dp_mesh_dims=...), which torch 2.11 cannot take. The fields are torch
    # 2.14's: the mesh axis name(s) FSDP shards over and the one it replicates over.
    import dataclasses as _dc

    @_dc.dataclass(frozen=True)
    class DataParallelMeshDims:
        shard: "str | tuple[str, ...] | None" = None
        replicate: "str | tuple[str, ...] | None" = None

    _fsdp.DataParallelMeshDims = DataParallelMeshDims
if not hasattr(torch.distributed, "set_timeout"):  # called after step 1 to shorten PG timeouts
    torch.distributed.set_timeout = _c10d._set_pg_timeout
if "separate_full_blocks" not in inspect.signature(_flex.create_block_mask).parameters:
    _cbm = _flex.create_block_mask  # older torch always separates full blocks (= the new default True)

    def _create_block_mask(*a, separate_full_blocks=True, **kw):
        assert separate_full_blocks, "this torch always separates full blocks"
        return _cbm(*a, **kw)
    _flex.create_block_mask = _create_block_mask

import torchtitan  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import BaseLogger, MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw  # noqa: E402
from torchtitan.components.quantization import Float8LinearConverter  # noqa: E402
from torchtitan.components.tokenizer import HuggingFaceTokenizer  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.hf_datasets import DatasetConfig  # noqa: E402
from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.observability import structured_logger as sl  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.tools.profiler import Profiler  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def build_tokenizer(d: str, vocab: int) -> None:
    """Byte-level BPE without merges (1 byte = 1 token), padded to `vocab` ids; BOS/EOS sit at
    vocab-256 / vocab-255 (128000 / 128001 for the Llama-3 vocab, as in the real tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(d, exist_ok=True)
    v = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    specials = {vocab - 256: BOS, vocab - 255: EOS}
    v.update({specials.get(i, f"<|reserved_{i}|>"): i for i in range(len(v), vocab)})
    tok = Tokenizer(models.BPE(vocab=v, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(d, "tokenizer.json"))
    added = {str(i): dict(content=s, lstrip=False, rstrip=False, normalized=False, single_word=False,
                          special=True) for i, s in specials.items()}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(dict(bos_token=BOS, eos_token=EOS, add_bos_token=True, add_eos_token=False,
                       added_tokens_decoder=added, model_max_length=131072,
                       tokenizer_class="PreTrainedTokenizerFast"), f)


def load_docs(path: str):
    """Documents of seq-1 ASCII bytes: BOS + doc = exactly one seq-token training sample."""
    from datasets import Dataset
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().encode("ascii", "replace").decode()
    n = args.seq - 1
    docs = [text[i:i + n] for i in range(0, len(text) - n + 1, n)]
    assert docs, f"{path}: fewer than {n} characters"
    return Dataset.from_dict({"text": docs})


class Recorder(BaseLogger):
    """Stands in for torchtitan's TensorBoard/W&B logger: keeps each step's metrics dict."""

    def __init__(self):
        self.rows = []

    def log(self, metrics, step):
        row = dict(metrics, step=step)
        if torch.cuda.is_available():  # read before torchtitan resets the peak stats after logging
            row["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self.rows.append(row)


def cpu_causal_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """--cpu-test only: FlexAttention has no CPU backward, so use causal SDPA (same mask here)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None


def main() -> None:
    init_logger()
    if args.cpu_test:
        from torchtitan.models.common.attention import FlexAttention
        FlexAttention._compiled_flex_attn = cpu_causal_attn
    sl.init_structured_logger(source="training", output_dir=args.workdir, enable=False)
    compile_on = not args.no_compile
    converters = None
    if args.float8:  # as torchtitan's llama3_405b recipe: every Linear but lm_head (tied in 1B)
        converters = [Float8LinearConverter.Config(recipe_name=args.float8_recipe, filter_fqns=["lm_head"],
                                                   model_compile_enabled=compile_on, emulate=args.cpu_test)]
    spec = model_registry(args.flavour, converters=converters)
    mc, vocab = spec.model, decoder_vocab_size(spec)
    if args.layers:
        mc.layers = mc.layers[:args.layers]
    att = mc.layers[0].attention
    shape = dict(dim=mc.dim, n_layers=len(mc.layers), n_heads=att.n_heads, n_kv_heads=att.n_kv_heads,
                 ffn=mc.layers[0].feed_forward.w1.out_features, vocab=vocab, rope_theta=att.rope.theta,
                 tied=mc.enable_weight_tying)
    if args.flavour == "1B" and not args.layers:  # Llama-3.2-1B
        assert shape == dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192, vocab=128256,
                             rope_theta=500000, tied=True), shape
    logger.info(f"peer model shape: {shape}")

    tok_dir = os.path.join(args.workdir, f"tokenizer_{vocab}")
    build_tokenizer(tok_dir, vocab)
    tok = HuggingFaceTokenizer(HuggingFaceTokenizer.Config(), tokenizer_path=tok_dir)
    assert (tok.bos_id, tok.eos_id) == (vocab - 256, vocab - 255), (tok.bos_id, tok.eos_id)
    assert len(tok.encode("ab c\n", add_bos=True, add_eos=True)) == 7
    DATASETS["peer_local_text"] = DatasetConfig(path=args.data, loader=load_docs,
                                                sample_processor=lambda s: s["text"])

    # ChunkedLossWrapper reshards the [norm, lm_head] FSDP group before the decoder backward needs
    # norm.weight; torch 2.11's FSDP does not re-unshard it ("data is not allocated yet").
    loss_kind = args.loss if args.loss != "auto" else (
        "chunked" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13) else "ce")
    ce = CrossEntropyLoss.Config(global_vocab_size=vocab)
    cfg = Trainer.Config(
        model_spec=spec,
        hf_assets_path=tok_dir,
        dump_folder=os.path.join(args.workdir, "dump"),
        loss=ChunkedLossWrapper.Config(loss_fn=ce) if loss_kind == "chunked" else ce,
        optimizer=default_adamw(lr=args.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=min(10, args.steps)),
        training=TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, steps=args.steps,
                                disable_cuda_graphs=args.no_cudagraphs or args.cpu_test,
                                enable_cpu_offload=args.cpu_offload, dtype=args.dtype),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="peer_local_text", dataset_path=args.data),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        profiler=Profiler.Config(enable_profiling=False),
        activation_checkpoint=dict(none=None, selective=SelectiveAC.Config(), full=FullAC.Config())[args.ac],
        compile=CompileConfig(enable=compile_on, components=["model", "loss"]),
        parallelism=ParallelismConfig(data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp,
                                      spmd_backend=args.spmd_backend),
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.spmd_backend == "spmd_types" and world > 1 and (
            "dp_mesh_dims" not in inspect.signature(_fsdp.fully_shard).parameters):
        raise SystemExit(f"--spmd-backend spmd_types on {world} ranks needs fully_shard(dp_mesh_dims=...) "
                         f"(torch >= 2.14); torch {torch.__version__}: use --spmd-backend partial_dtensor")
    if args.cpu_test and world > 1:
        # --cpu-test only: gloo has no ReduceOp.PREMUL_SUM, which FSDP's reduce-scatter uses once
        # torchtitan sets its gradient divide factor to 1; FSDP's own averaging scales the (test)
        # gradients by 1/world instead. Never on GPUs.
        import torchtitan.distributed.fsdp as _tt_fsdp
        _tt_fsdp.disable_fsdp_gradient_division = lambda model: None
    trainer = cfg.build()
    rec = Recorder()
    trainer.metrics_processor.logger = rec
    try:
        trainer.train()
        flops_per_token = trainer.metrics_processor.num_flops_per_token
        rows = [r for r in rec.rows if r["step"] > args.skip] or rec.rows[-1:]
        # The peak over the ranks (every rank records its own steps), before the process group goes.
        peak = torch.tensor(max(r.get("peak_alloc_gib", r["memory/max_active(GiB)"]) for r in rows))
        reserved = torch.tensor(max(r["memory/max_reserved(GiB)"] for r in rows))
        if torch.distributed.is_initialized():
            both = torch.stack([peak, reserved]).to("cpu" if args.cpu_test else torch.device("cuda"))
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX)
            peak, reserved = both.cpu()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    tps = statistics.median(r["throughput(tps)"] for r in rows)
    mfu = [r["mfu(%)"] for r in rows if "mfu(%)" in r]  # torchtitan omits MFU when quantised
    name = args.flavour + (f"-{args.layers}L" if args.layers else "")
    out = {"peer": "torchtitan", "flavour": name, "batch": args.batch, "seq": args.seq,
           "tokens_per_s": round(tps), "mfu": round(statistics.median(mfu) / 100, 4) if mfu else None,
           "tflops": round(statistics.median(r["tflops"] for r in rows), 1), "peak_gib": round(float(peak), 2),
           "peak_reserved_gib": round(float(reserved), 2), "world_size": world, "dp_shard": args.dp_shard,
           "tp": args.tp, "spmd_backend": args.spmd_backend, "tokens_per_s_is_per_gpu": True,
           "torchtitan": torchtitan.__version__, "torch": torch.__version__, "compile": compile_on,
           "ac": args.ac, "float8": args.float8, "float8_recipe": args.float8 and args.float8_recipe,
           "loss": loss_kind, "dtype": args.dtype, "cudagraphs": not (args.no_cudagraphs or args.cpu_test),
           "n_steps_median": len(rows), "tps_all": [round(r["throughput(tps)"]) for r in rec.rows],
           "loss_last": round(rec.rows[-1]["loss_metrics/global_avg_loss"], 4),
           "flops_per_token": flops_per_token,
           "device": "cpu" if args.cpu_test else torch.cuda.get_device_name(),
           "timing": "torchtitan MetricsProcessor tps (wall clock between per-step logs)"}
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
