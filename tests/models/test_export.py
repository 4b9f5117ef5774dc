"""`tracetrain export`: it never deletes what the user did not name, and what it writes transformers (and PEFT)
runs as is: token ids, generation config with every stop id, tokenizer files, dtype, file modes, model card.

Tiny runs are trained through the real CLI (a few seconds each); transformers is the reference."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixtures_gen import bpe_json_path, bpe_token_id, bpe_vocab_size
from helpers import TINY_MODEL, run_cli, train_run
from safetensors import safe_open

transformers = pytest.importorskip("transformers", reason="export tests load the exports with transformers")

pytestmark = pytest.mark.usefixtures("one_thread_torch")

# <|endoftext|> and "\n" (our test's end-of-turn id) in the byte-level BPE trained for the tests (tests/fixtures_gen.py)
BPE_EOS, BPE_NEWLINE = bpe_token_id("<|endoftext|>"), bpe_token_id("\u010a")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return train_run(tmp_path_factory.mktemp("runs"), "r", *TINY_MODEL)


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def export(capsys):
    """`tracetrain export ARGS` through the CLI's own `main` in this process (a subprocess costs seconds of
    imports per call; the subprocess form is checked once, in the first test)."""
    from tracetrain.cli import main

    def call(*args: str) -> Outcome:
        capsys.readouterr()
        code = main(["export", *args])
        out, err = capsys.readouterr()
        return Outcome(code, out, err)

    return call


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` -> a hash of its bytes ('dir' for folders): a tree compares equal only if
    nothing was added, removed or changed."""
    return {
        p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def assert_refused(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


# ----------------------------------------------------------------------------------------------------
# Nothing deleted that the user did not name


def test_non_empty_folder_is_refused_and_kept(run: Path, tmp_path: Path, export) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_bytes(b"my own notes\n")
    before = tree_digest(tmp_path)
    assert_refused(run_cli("export", str(run), "--hf", str(out), check=False), str(out), "--overwrite")
    assert_refused(export(str(run), "--hf", str(out), "--overwrite"), str(out), "not a tracetrain export")
    assert_refused(export(str(run), "--peft", str(out), "--overwrite"), str(out))
    assert tree_digest(tmp_path) == before


def test_run_and_checkpoints_are_refused_and_intact(run: Path, export) -> None:
    before = tree_digest(run)
    ckpt = next((run / "checkpoints").iterdir())
    assert_refused(export(str(run), "--hf", str(run)), str(run), "run directory")
    assert_refused(export(str(run), "--hf", str(run), "--overwrite"), str(run), "run directory")
    assert_refused(export(str(run), "--hf", str(run / "checkpoints"), "--overwrite"), "checkpoints folder")
    assert_refused(export(str(run), "--hf", str(ckpt), "--overwrite"), str(ckpt))
    assert tree_digest(run) == before


def test_file_targets_and_unwritable_places_are_refused(run: Path, tmp_path: Path, export) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"\x00\x01 keep me")
    assert_refused(export(str(run), "--hf", str(file)), str(file), "is an existing file")
    assert_refused(export(str(run), "--hf", str(file / "out")), str(file), "is a file, not a folder")
    assert file.read_bytes() == b"\x00\x01 keep me"
    if Path("/sys").is_dir():  # a place even root cannot create folders in
        assert_refused(export(str(run), "--hf", "/sys/tracetrain-export"), "/sys/tracetrain-export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 folder anyway (the /sys case covers root)")
def test_read_only_folder_is_refused(run: Path, tmp_path: Path, export) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    assert_refused(export(str(run), "--hf", str(ro / "out")), str(ro), "not writable")


def test_overwrite_replaces_only_an_earlier_export(run: Path, tmp_path: Path, export) -> None:
    out = tmp_path / "hf"
    assert export(str(run), "--hf", str(out), "--dtype", "fp32").returncode == 0
    assert_refused(export(str(run), "--hf", str(out)), "earlier tracetrain export", "--overwrite")
    proc = export(str(run), "--hf", str(out), "--overwrite", "--dtype", "fp16", "--max-shard-size", "100KB")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or set-aside folder left
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()  # the fp32 single file is gone
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118 (safe_open has keys(), no iteration)
    manifest = json.loads((out / "tracetrain_export.json").read_text())
    assert set(manifest["files"]) | {"tracetrain_export.json"} == {p.name for p in out.iterdir()}
    assert manifest["source_checkpoint"] == str(next((run / "checkpoints").iterdir()).resolve())
    (out / "extra.txt").write_text("added by hand")
    assert_refused(export(str(run), "--hf", str(out), "--overwrite"), "extra.txt")
    assert (out / "extra.txt").read_text() == "added by hand"


# ----------------------------------------------------------------------------------------------------
# What is written


def test_modes_follow_the_umask(run: Path, tmp_path: Path, export) -> None:
    old = os.umask(0o027)  # the export subprocess inherits it
    try:
        assert export(str(run), "--hf", str(tmp_path / "a" / "hf")).returncode == 0
    finally:
        os.umask(old)
    out = tmp_path / "a" / "hf"
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o640"}  # safetensors alone writes 0600
    assert oct(out.stat().st_mode & 0o777) == oct((tmp_path / "a").stat().st_mode & 0o777) == "0o750"
    old = os.umask(0o022)
    try:
        assert export(str(run), "--hf", str(tmp_path / "b")).returncode == 0
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "b").iterdir()} == {"0o644"}
    assert oct((tmp_path / "b").stat().st_mode & 0o777) == "0o755"


def rig_to_emit(hf_model: torch.nn.Module, token: int) -> None:
    """Make `token` the greedy choice at every position: the blocks add nothing (o_proj, down_proj zero),
    so the final hidden state is the normalised embedding; every embedding gets a positive first
    coordinate, the final norm keeps only that coordinate, and only `token`'s output row reads it."""
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf_model.model.embed_tokens.weight[:, 0] = 1.0
        hf_model.model.norm.weight.zero_()
        hf_model.model.norm.weight[0] = 1.0
        hf_model.lm_head.weight.zero_()
        hf_model.lm_head.weight[token, 0] = 100.0


def test_byte_run_loads_in_transformers_and_stops_at_eos(run: Path, tmp_path: Path, export) -> None:
    out = tmp_path / "hf"
    proc = export(str(run), "--hf", str(out), "--dtype", "fp32")
    assert proc.returncode == 0 and "no tokenizer files" in proc.stdout  # the byte tokenizer: one note line
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (256, 257, 258)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == 257 and gen.bos_token_id == 256
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float32 and hf.generation_config.eos_token_id == 257
    from tracetrain.inference import load_trained

    ours = load_trained(run, "cpu").model
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=0)
    rig_to_emit(hf, 257)
    prompt = torch.tensor([[256, 104, 105]])
    stopped = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    assert stopped[0, 3:].tolist() == [257]  # the exported generation config stops it at EOS
    unstopped = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert unstopped.shape[1] == 3 + 12  # ... which is what stopped it
    card = (out / "README.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert str(next((run / "checkpoints").iterdir()).resolve()) in card and "tracetrain" in card
    assert f"{summary['eval_loss']:.4f}" in card and "synthetic" in card


def stored_dtypes(folder: Path) -> set[torch.dtype]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open has keys(), no iteration)


@pytest.mark.parametrize(
    "flag, dtype",
    [((), torch.float32), (("--dtype", "bf16"), torch.bfloat16), (("--dtype", "fp16"), torch.float16)],
    ids=["auto", "bf16", "fp16"],
)
def test_dtype_auto_is_the_runs_weights_and_others_convert(run: Path, tmp_path: Path, export, flag, dtype) -> None:
    """The tiny run trained on the CPU in fp32: `auto` writes fp32 (it wrote bf16 before, silently); a named
    dtype converts. transformers loads each in that dtype, and its logits are ours with the weights
    rounded to that dtype."""
    from tracetrain.inference import load_trained

    out = tmp_path / "hf"
    proc = export(str(run), "--hf", str(out), *flag)
    assert proc.returncode == 0, proc.stderr
    name = str(dtype).removeprefix("torch.")
    said = f"weights: {name}, as the run stores them (the checkpoint's weights)"
    assert (said in proc.stdout) == (not flag), proc.stdout  # auto says what it chose; an explicit dtype does not
    assert stored_dtypes(out) == {dtype}
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == name
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == dtype  # as config.json says
    ours = load_trained(run, "cpu").model
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(p.to(dtype).float())  # what the export rounded
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-4, rtol=0)
        if flag:  # ... and they differ from the fp32 run's: the test can tell the dtypes apart
            assert (load_trained(run, "cpu").model(ids) - ours(ids)).abs().max() > 1e-4


def test_export_help_names_the_dtype_choices(capsys) -> None:
    from tracetrain.cli import main

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {auto,bf16,fp16,fp32}" in text and "auto (default) = the run's weights dtype" in text


def bpe_tokenizer_folder(tmp_path: Path) -> Path:
    """The test BPE's tokenizer.json (GPT-2's design) with a tokenizer_config.json (and a chat template) and a generation config
    naming a second stop id, as a Hugging Face tokenizer folder."""
    folder = tmp_path / "bpe-tok"
    folder.mkdir()
    shutil.copy(bpe_json_path(), folder / "tokenizer.json")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2TokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "add_bos_token": False,
                "model_max_length": 1024,
                "chat_template": template,
            }
        )
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [BPE_EOS, BPE_NEWLINE]}))
    return folder


@pytest.mark.slow  # trains its own run (> 10 s on a busy 2-core machine)
def test_hf_tokenizer_run_exports_tokenizer_and_every_stop_id(tmp_path: Path, export) -> None:
    from tracetrain.data.tokenizer import load_tokenizer

    tok_dir = bpe_tokenizer_folder(tmp_path)
    ours = load_tokenizer(str(tok_dir))
    if not hasattr(ours, "save_hf_files"):
        pytest.fail("HFTokenizer.save_hf_files (the chat-data side of the contract) is missing")
    run = train_run(
        tmp_path / "runs", "g", *TINY_MODEL, f"--data.tokenizer={tok_dir}", f"--model.vocab_size={bpe_vocab_size()}"
    )
    out = tmp_path / "hf"
    proc = export(str(run), "--hf", str(out), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "Hello world, export me!"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert hf_tok.eos_token_id == BPE_EOS and hf_tok.chat_template == ours.chat_template
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [BPE_EOS, BPE_NEWLINE]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [BPE_EOS, BPE_NEWLINE]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    rig_to_emit(hf, BPE_NEWLINE)  # the end-of-turn id, not EOS, must stop transformers' generate
    prompt = torch.tensor([ours.encode("Hi")])
    assert hf.generate(prompt, max_new_tokens=8, do_sample=False)[0, prompt.shape[1] :].tolist() == [BPE_NEWLINE]
    manifest = json.loads((out / "tracetrain_export.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(manifest["files"])


@pytest.mark.slow  # trains its own run (> 10 s on a busy 2-core machine)
def test_lora_run_peft_and_merged_exports(tmp_path: Path, export) -> None:
    """A LoRA run on a transformers base: the PEFT adapter names the base by absolute path and carries no
    surprises; the merged export keeps the base's generation defaults and adds the tokenizer's EOS."""
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    base_model = transformers.AutoModelForCausalLM.from_config(cfg)
    base_model.generation_config = transformers.GenerationConfig(
        bos_token_id=256, eos_token_id=[257, 10], do_sample=True, temperature=0.6
    )
    base = tmp_path / "base"
    base_model.save_pretrained(base)
    run = train_run(tmp_path / "runs", "l", f"--model.init_from={base}", "--train.mode=lora")
    proc = export(str(run), "--peft", str(tmp_path / "peft"), "--hf", str(tmp_path / "hf"), "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    if Path("/sys").is_dir():  # a place even root cannot create folders in
        assert_refused(export(str(run), "--peft", "/sys/tracetrain-export"), "/sys/tracetrain-export")
    adapter_cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(base.resolve())
    # --dtype auto for adapters-only checkpoints: the frozen base's dtype (its files, or lora.base_dtype).
    from tracetrain.inference import load_trained
    from tracetrain.models.export import run_weights_dtype

    assert run_weights_dtype(load_trained(run, "cpu")) == (torch.float32, f"the frozen base's files ({base})")
    set_bf16 = load_trained(run, "cpu", ["--lora.base_dtype=bf16"])
    assert run_weights_dtype(set_bf16) == (torch.bfloat16, "lora.base_dtype")
    assert json.loads((tmp_path / "peft" / "tracetrain_export.json").read_text())["tracetrain_export"] == "peft"
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert gen.eos_token_id == [257, 10] and gen.temperature == 0.6 and gen.do_sample
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(adapter_cfg["base_model_name_or_path"]), tmp_path / "peft"
    ).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=1e-4, rtol=0)
