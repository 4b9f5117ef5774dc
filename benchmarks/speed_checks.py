"""The GPU checks of benchmarks/speed.py (`--checks`, `--attention`) and the batches and helpers the
script's runs share with them: each Triton kernel against a float32 reference and timed against the eager
ops it replaces, the attention backends on packed 7B shapes, and whether cuBLAS accumulates a bf16
product into float32 (`torch.addmm(..., out_dtype=float32)`).
"""

from __future__ import annotations

import gc
import random
import time

import torch

from tracetrain.data.packing import pack_documents, shift_labels

FUSED_CE_CHUNK = 4096


def packed_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`batch` rows packed greedily (tracetrain.data.packing) from documents of seq/32..seq/2 tokens
    (64..1024 at seq 2048: about four documents per row)."""
    rng = random.Random(seed)
    docs = []
    while len(docs) < 2 * batch * 32:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(seq // 32, seq // 2))]
        docs.append((ids, shift_labels(ids, [True] * len(ids))))
    rows = pack_documents(docs, seq, 0, pack=True)
    return {k: v[:batch].contiguous() for k, v in rows.items()}


def unpacked_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(batch, -1).contiguous(),
            "document_ids": torch.zeros(batch, seq, dtype=torch.long)}


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _bench_ms(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _fwd_bwd(fn, inputs, grad):
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(grad)
    return out


def eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`models.llama.RMSNorm.forward`'s ops, on a given weight tensor."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_kernels() -> list[dict]:
    """Each Triton kernel vs a float32 reference (rel error) and vs the eager ops (time fwd+bwd)."""
    from tracetrain.kernels.fused_ce import fused_linear_cross_entropy
    from tracetrain.kernels.rmsnorm import rms_norm
    from tracetrain.kernels.rope import fused_rope_qk
    from tracetrain.kernels.swiglu import swiglu
    from tracetrain.models.llama import apply_rope_qk
    import torch.nn.functional as F
    dev, bf = torch.device("cuda"), torch.bfloat16
    rows = []

    def record(name, out, ref, grads, ref_grads, fused_fn, eager_fn, inputs, g):
        errs = {"out": _rel(out, ref), **{f"grad_{i}": _rel(a, b) for i, (a, b) in enumerate(zip(grads, ref_grads))}}
        eager_out = _fwd_bwd(eager_fn, inputs, g)  # the eager path's own error, for scale
        eager_errs = {"out": _rel(eager_out.reshape(out.shape), ref),
                      **{f"grad_{i}": _rel(t.grad, b) for i, (t, b) in enumerate(zip(inputs, ref_grads))}}
        t_fused = _bench_ms(lambda: _fwd_bwd(fused_fn, inputs, g))
        t_eager = _bench_ms(lambda: _fwd_bwd(eager_fn, inputs, g))
        rows.append({"kernel": name, "rel_err": errs, "max_rel_err": max(errs.values()), "eager_rel_err": eager_errs,
                     "fused_ms": t_fused, "eager_ms": t_eager})
        print(f"check {name:<28} max rel err {max(errs.values()):.2e}  fused {t_fused:.3f} ms  "
              f"eager {t_eager:.3f} ms  {errs}  eager {eager_errs}", flush=True)

    # RMSNorm, 7B shape; weight in float32 (full training) and bf16 (LoRA base).
    for wdt in (torch.float32, bf):
        x = torch.randn(8192, 4096, device=dev, dtype=bf, requires_grad=True)
        w = (1 + 0.1 * torch.randn(4096, device=dev)).to(wdt).requires_grad_()
        g = torch.randn(8192, 4096, device=dev, dtype=torch.promote_types(bf, wdt))
        out = _fwd_bwd(lambda: rms_norm(x, w, 1e-5), [x, w], g)
        grads = [x.grad.clone(), w.grad.clone()]
        xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        ref = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5))
        ref.backward(g.float())
        record(f"rmsnorm(w {str(wdt)[6:]})", out, ref, grads, [xr.grad, wr.grad],
               lambda: rms_norm(x, w, 1e-5), lambda: eager_rms_norm(x, w), [x, w], g)

    # RoPE on q and k as the model lays them out: (b, s, h, d) projections viewed as (b, h, s, d),
    # cos/sin from packed position ids (restarting per document) as Transformer.rope makes them.
    from tracetrain.models.llama import ModelArgs, rope_inv_freq
    inv_freq = rope_inv_freq(ModelArgs(dim=4096, n_heads=32, n_kv_heads=8)).to(dev)
    freqs = packed_batch(4, 2048, 100)["position_ids"].to(dev).float().unsqueeze(-1) * inv_freq
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q = torch.randn(4, 2048, 32, 128, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
    k = torch.randn(4, 2048, 8, 128, device=dev, dtype=bf).transpose(1, 2).requires_grad_()
    gq, gk = torch.randn_like(q), torch.randn_like(k)

    def rope_step(fn, qq=q, kk=k):
        qq.grad = kk.grad = None
        a, b = fn(qq, kk, cos, sin)
        torch.autograd.backward([a, b], [gq.to(a.dtype), gk.to(b.dtype)])
        return a, b

    qo, ko = rope_step(fused_rope_qk)
    grads = [q.grad.clone(), k.grad.clone()]
    qr, kr = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    qro, kro = rope_step(apply_rope_qk, qr, kr)
    errs = {"out": _rel(torch.cat([qo.flatten(), ko.flatten()]), torch.cat([qro.flatten(), kro.flatten()])),
            "grad_0": _rel(grads[0], qr.grad), "grad_1": _rel(grads[1], kr.grad)}
    qe, ke = rope_step(apply_rope_qk)
    eager_errs = {"out": _rel(torch.cat([qe.flatten(), ke.flatten()]), torch.cat([qro.flatten(), kro.flatten()])),
                  "grad_0": _rel(q.grad, qr.grad), "grad_1": _rel(k.grad, kr.grad)}
    t_fused, t_eager = _bench_ms(lambda: rope_step(fused_rope_qk)), _bench_ms(lambda: rope_step(apply_rope_qk))
    rows.append({"kernel": "rope(q,k)", "rel_err": errs, "max_rel_err": max(errs.values()),
                 "eager_rel_err": eager_errs, "fused_ms": t_fused, "eager_ms": t_eager})
    print(f"check {'rope(q,k)':<28} max rel err {max(errs.values()):.2e}  fused {t_fused:.3f} ms  "
          f"eager {t_eager:.3f} ms  {errs}  eager {eager_errs}", flush=True)

    # SwiGLU, 7B MLP shape.
    gate = torch.randn(8192, 11008, device=dev, dtype=bf, requires_grad=True)
    up = torch.randn(8192, 11008, device=dev, dtype=bf, requires_grad=True)
    g = torch.randn(8192, 11008, device=dev, dtype=bf)
    out = _fwd_bwd(lambda: swiglu(gate, up), [gate, up], g)
    grads = [gate.grad.clone(), up.grad.clone()]
    gr, ur = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    ref = F.silu(gr) * ur
    ref.backward(g.float())
    record("swiglu", out, ref, grads, [gr.grad, ur.grad], lambda: swiglu(gate, up),
           lambda: F.silu(gate) * up, [gate, up], g)

    # Fused linear + CE, llama3.2-1b head (vocab 128,256), 8192 tokens, trained float32 weight, autocast.
    h = torch.randn(8192, 2048, device=dev, requires_grad=True)
    w = (0.02 * torch.randn(128256, 2048, device=dev)).requires_grad_()
    y = torch.randint(0, 128256, (8192,), device=dev)
    y[::5] = -100

    def fused():
        with torch.autocast("cuda", bf):
            return fused_linear_cross_entropy(h, w, y, FUSED_CE_CHUNK)

    def eager():
        with torch.autocast("cuda", bf):
            logits = h @ w.t()
        return F.cross_entropy(logits.float(), y, ignore_index=-100, reduction="sum")

    out = _fwd_bwd(fused, [h, w], None)
    grads = [h.grad.clone(), w.grad.clone()]
    hr, wr = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy(hr @ wr.t(), y, ignore_index=-100, reduction="sum")  # float32 (tf32 off)
    ref.backward()
    record("fused_linear_ce(1b head)", out.reshape(1), ref.reshape(1), grads, [hr.grad, wr.grad],
           fused, eager, [h, w], None)
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd(fused, [h, w], None)
    fused_peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    _fwd_bwd(eager, [h, w], None)
    rows[-1].update(fused_peak_gib=fused_peak, eager_peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    print(f"  fused CE peak {fused_peak:.2f} GiB vs eager {rows[-1]['eager_peak_gib']:.2f} GiB", flush=True)
    del h, w, y, gate, up, g, q, k, hr, wr
    free()
    return rows


def check_attention() -> list[dict]:
    """fwd+bwd time and agreement of the attention backends, llama2-7b shapes, packed documents."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from tracetrain.models.attention import FlexCore, document_causal_block_mask, sdpa_attention
    from tracetrain.models.attention import document_causal_mask
    dev, bf = torch.device("cuda"), torch.bfloat16
    doc = packed_batch(4, 2048, 100)["document_ids"].to(dev)
    q, k, v = (torch.randn(4, 32, 2048, 128, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    dense = document_causal_mask(doc)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        block = document_causal_block_mask(doc)
    torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t) * 100
    flex = FlexCore()
    variants = {
        "sdpa dense doc mask": lambda: sdpa_attention(q, k, v, dense),
        "flex doc mask": lambda: flex(q, k, v, block),
        "sdpa is_causal (no docs)": lambda: sdpa_attention(q, k, v, None),
    }

    def cudnn_causal():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa_attention(q, k, v, None)

    variants["sdpa cudnn is_causal (no docs)"] = cudnn_causal
    from torch.nn.attention.flex_attention import create_block_mask
    causal_block = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 2048, 2048, device=dev)
    variants["flex causal (no docs)"] = lambda: flex(q, k, v, causal_block)
    rows, outs = [], {}
    for name, fn in variants.items():
        out = _fwd_bwd(fn, [q, k, v], g)
        outs[name] = (out.detach(), q.grad.clone())
        ms = _bench_ms(lambda: _fwd_bwd(fn, [q, k, v], g))
        fwd_ms = _bench_ms(lambda: fn())
        rows.append({"attention": name, "fwd_bwd_ms": ms, "fwd_ms": fwd_ms})
        print(f"attention {name:<32} fwd+bwd {ms:7.3f} ms   fwd {fwd_ms:7.3f} ms", flush=True)
    a, b = outs["flex doc mask"], outs["sdpa dense doc mask"]
    c, d = outs["flex causal (no docs)"], outs["sdpa is_causal (no docs)"]
    agree = {"flex_vs_sdpa_doc_out": _rel(a[0], b[0]), "flex_vs_sdpa_doc_dq": _rel(a[1], b[1]),
             "flex_vs_sdpa_causal_out": _rel(c[0], d[0]), "block_mask_build_ms": build_ms,
             "block_mask_sparsity": float(block.sparsity())}
    print(f"attention agreement {agree}", flush=True)
    rows.append(agree)
    del q, k, v, g, dense
    free()
    return rows


def probe_addmm_out_dtype() -> dict:
    """Can cuBLAS accumulate a bf16 product straight into a float32 tensor (for the fused CE's dW)?"""
    dev = torch.device("cuda")
    a = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    acc = torch.randn(2048, 1024, device=dev)
    try:
        out = torch.addmm(acc, a, b, out_dtype=torch.float32)
        err = _rel(out, acc + a.float() @ b.float())
        ms = _bench_ms(lambda: torch.addmm(acc, a, b, out_dtype=torch.float32))
        ms_add = _bench_ms(lambda: acc.add_(a @ b))
        return {"ok": True, "rel_err": err, "addmm_out_dtype_ms": ms, "mm_then_add_ms": ms_add}
    except Exception as e:  # reported, not hidden: it decides a follow-up
        return {"ok": False, "error": str(e)[:300]}
