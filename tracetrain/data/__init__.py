"""Data pipeline: tokenizers, instruction/synthetic/text datasets, packing, and a resumable loader.

    tok = load_tokenizer(cfg.data.tokenizer, cfg.model.init_from)  # 'auto': the checkpoint's own tokenizer
    check_vocab(tok, model_args.vocab_size)
    train_ds, eval_ds, stats = build_datasets(cfg.data, tok)  # memory-mapped rows (reused: cache_dir=...)
    loader = build_loader(train_ds, cfg.train.micro_batch_size, cfg.data, seed=cfg.data.seed)
    batch = next(loader)  # input_ids, labels (already shifted), position_ids, document_ids: (B, S) int64
    state = loader.state_dict()  # save with the checkpoint; loader.load_state_dict(state) to resume

To inspect what is trained: `tokenize_rows(cfg.data, tok)` yields each example's text, ids and per-token
trained mask (`TokenizedExample`). Chat: `resolve_chat_template` / `render_generation_prompt`.

For evaluation: `iter_batches(eval_ds, batch_size)` for the loss, and `eval_ds.examples` with
`encode_prompt` / `exact_match` for greedy-generation accuracy.
"""

from tracetrain.data.chat import render_generation_prompt, resolve_chat_template
from tracetrain.data.instruction import encode_prompt, exact_match, format_prompt
from tracetrain.data.loader import (
    StatefulLoader,
    build_datasets,
    build_loader,
    check_data_files,
    iter_batches,
    tokenize_rows,
)
from tracetrain.data.packing import IGNORE_INDEX, PAD_DOCUMENT, DataStats, PackedDataset, TokenizedExample
from tracetrain.data.synthetic import generate_examples
from tracetrain.data.token_cache import DATA_CACHE_DIR
from tracetrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, check_vocab, load_tokenizer

__all__ = [
    "DATA_CACHE_DIR",
    "IGNORE_INDEX",
    "PAD_DOCUMENT",
    "ByteTokenizer",
    "DataStats",
    "HFTokenizer",
    "PackedDataset",
    "StatefulLoader",
    "TokenizedExample",
    "Tokenizer",
    "build_datasets",
    "build_loader",
    "check_data_files",
    "check_vocab",
    "encode_prompt",
    "exact_match",
    "format_prompt",
    "generate_examples",
    "iter_batches",
    "load_tokenizer",
    "render_generation_prompt",
    "resolve_chat_template",
    "tokenize_rows",
]
