"""Shared fixtures. Tests build their own data (tests/fixtures_gen.py: a text corpus, a BPE tokenizer
trained on it, a chat tokenizer folder, instruction rows): a fresh clone needs no download. With CI=true
the session fails if a test skipped for a reason other than hardware or a missing optional extra."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import warnings
from pathlib import Path


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker (and each process it starts) gets cores // workers OpenMP threads.
    torch's pool takes every core by default and its idle threads spin: on 2 cores, 2 workers that each spin
    2 threads (plus the CLI processes the tests start) ran the README tour in 638 s inside the suite against
    38 s alone. Set before torch is imported (OpenMP reads it once); an explicit OMP_NUM_THREADS is kept.
    Thread count does not change the tests' numbers (the golden losses hold with 1 and 2 threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


_share_the_cores()

import fixtures_gen  # noqa: E402  # after the thread count: it imports torch
import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cli_here(*args: str, cwd: str | Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`tracetrain ARGS` through the command's own `main` in this process, returned as `run_cli` returns a
    subprocess: the same parsing, checks and library calls, without the seconds a fresh interpreter spends
    importing torch. stdout and stderr are captured; warnings, filtered as a fresh interpreter filters
    them, are written at the start of stderr as it would print them; an argparse exit is the return code.
    Tests that need a process of their own (signals, a lock held by another PID, torchrun, a fresh
    interpreter) use helpers.run_cli, and every subcommand keeps at least one real subprocess test."""
    from tracetrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.chdir(cwd or os.getcwd()))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        _default_warning_filters()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: usage errors (2) and --help (0)
            code = e.code if isinstance(e.code, int) else 2
    stderr = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    proc = subprocess.CompletedProcess(["tracetrain", *args], code, out.getvalue(), stderr + err.getvalue())
    if check and code != 0:
        raise AssertionError(f"tracetrain {' '.join(args)} failed ({code}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def model_and_optimizer(cfg) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and optimizer of `cfg`'s run on the CPU, built as the trainer builds them (`resolve`, then
    `assemble`: every transform row, the optimizer the spec decides)."""
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble

    built = assemble(resolve(cfg, torch.device("cpu")))
    assert built.optimizer is not None
    return built.module, built.optimizer


def _default_warning_filters() -> None:
    """The warning filters of a fresh interpreter (no -W, no PYTHONWARNINGS): pytest's own are replaced."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


@pytest.fixture(scope="session")
def corpus_txt() -> Path:
    """An English-like play text of 1.1 MB (the size of tinyshakespeare)."""
    return fixtures_gen.bpe_json_path().parent / "corpus.txt"


@pytest.fixture(scope="session")
def bpe_json() -> Path:
    """A bare tokenizer.json: byte-level BPE as GPT-2's, trained on the corpus, <|endoftext|> its one special."""
    return fixtures_gen.bpe_json_path()


@pytest.fixture(scope="session")
def chat_tokenizer(bpe_json: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer folder with ChatML specials, a chat template and two stop ids."""
    return fixtures_gen.chat_tokenizer_folder(tmp_path_factory.mktemp("chat_tokenizer"), bpe_json)


@pytest.fixture(scope="session")
def gsm8k_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixtures_gen.gsm8k_like(tmp_path_factory.mktemp("gsm8k") / "train.jsonl")


@pytest.fixture(scope="session")
def dolly_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixtures_gen.dolly_like(tmp_path_factory.mktemp("dolly") / "dolly_train20.jsonl")


@pytest.fixture(scope="module")
def one_thread_torch():
    """Tiny matmuls gain nothing from a second thread, and on a busy machine its spin-waits cost seconds."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# The tiny GQA model the generation and KV-offload tests decode with (3 layers, 2 KV heads for 4 query heads).
GEN_ARGS_KW = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97)


@pytest.fixture(scope="module")
def gen_model(one_thread_torch):
    """That model in eval mode, seeded, with torch on one thread for the whole module."""
    from tracetrain.models.llama import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(**GEN_ARGS_KW)).eval()


def _modules_with_module_fixtures() -> set[str]:
    """Test files (paths as in node ids) that define a module-scoped fixture: its tests share what it builds."""
    tests = Path(__file__).resolve().parent
    found = {p for p in tests.rglob("test_*.py") if 'scope="module"' in p.read_text(encoding="utf-8")}
    return {p.relative_to(tests.parent).as_posix() for p in found}


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under pytest-xdist's default distribution (`-n N` alone), each test file that defines a module-scoped
    fixture goes to one worker as a whole, and every other test is handed out on its own (xdist's loadscope
    scheduler: units of more tests first). xdist's `load` sends runs of consecutive tests and can split such a
    file between workers, which then both build its fixture: in two runs of tests/cli, tests/parallel and
    tests/reliability on 2 workers it built the HTA cross-check of the 7B trace (24-53 s) and the failure
    drills (18-29 s) twice each. (`xdist_group` marks would say this per file, but pytest 9 no longer reads the
    node ids xdist rewrites for them.) `load` is what `-n` alone means; any other `--dist` keeps its scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    grouped = _modules_with_module_fixtures()

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in grouped else nodeid

    return ModuleFixtureScheduling(config, log)


# Skips a fresh clone may show: hardware or a build this machine lacks, or an optional extra (pyproject's
# extras, by import name) not installed. Anything else (data missing, a feature not written yet) fails
# the session under CI=true, so that "every feature is tested on a fresh clone" stays true.
HARDWARE_SKIP = re.compile(
    r"CUDA|GPU|Chromium|node is not installed|compiler|g\+\+|c\+\+|tmpfs|\broot\b|/proc|on CPU|CPU build|"
    r"golden losses recorded with torch"
)
EXTRA_SKIP = re.compile(
    r"\b(transformers|peft|mlflow|orjson|pyarrow|datasets|tensorboard|wandb|torchao|gguf|HolisticTraceAnalysis|trl)\b"
)


def skip_reason_allowed(reason: str) -> bool:
    return any(p.search(reason) for p in (HARDWARE_SKIP, EXTRA_SKIP))


def _disallowed_skips(session: pytest.Session) -> list[str]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    reports = reporter.stats.get("skipped", []) if reporter is not None else []
    found = []
    for report in reports:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not skip_reason_allowed(reason):
            found.append(f"{report.nodeid}: {reason}")
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI", "").lower() not in ("1", "true"):
        return
    session.config._disallowed_skips = bad = _disallowed_skips(session)  # type: ignore[attr-defined]
    if bad and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    bad = getattr(config, "_disallowed_skips", [])
    if bad:
        terminalreporter.section("skips that are neither hardware nor an optional extra (CI=true fails)")
        for line in bad:
            terminalreporter.write_line(line)
