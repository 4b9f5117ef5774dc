"""The architecture's rules, checked on the source (docs/architecture.md): folders import one way and the
modules inside each folder too, each transform is a row of the one table, tests and benchmarks build runs
through that table (`assemble`, `step_context`), decided config keys are read from the spec, one
definition of shared constants, no test helpers in the library."""

import ast
import re
import tokenize
from collections import defaultdict
from pathlib import Path

from helpers import REPO

from tracetrain.train.assemble import TRANSFORMS

PKG = REPO / "tracetrain"
TESTS = PKG.parent / "tests"
BENCHMARKS = PKG.parent / "benchmarks"


def _node(module: str) -> str | None:
    """The folder (or top-level module) a `tracetrain.*` module belongs to."""
    parts = module.split(".")
    if parts[0] != "tracetrain":
        return None
    return parts[1] if len(parts) > 1 else "tracetrain"


def _imports() -> dict[str, dict[str, set[str]]]:
    """folder -> imported folder -> the files that import it."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        src = rel.parts[0] if len(rel.parts) > 1 else rel.parts[0]
        if rel.parts == ("__init__",):
            src = "tracetrain"
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for name in names:
                dst = _node(name)
                if dst and dst != src:
                    edges[src][dst].add(str(rel))
    return edges


def test_no_import_cycle_between_folders():
    edges = _imports()
    cycle = _cycle({a: set(b) for a, b in edges.items()})  # any cycle, not only two-way pairs
    if cycle:
        hops = [f"{a} -> {b} ({', '.join(sorted(edges[a][b]))})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between folders:\n  " + "\n  ".join(hops))


# Calls of a transform outside the table, each with its reason: not a step of assembling a run.
NOT_ASSEMBLY = {
    ("models/hf.py", "apply_lora"): "loading a PEFT adapter folder onto a model for inference or export",
}


def _calls(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def test_every_transform_is_applied_only_from_the_table():
    """The model's `apply_*` transforms are called from train/assemble.py alone."""
    table_calls = {c for c in _calls(PKG / "train" / "assemble.py") if c.startswith("apply_")}
    assert {
        "apply_lora",
        "apply_fp8",
        "apply_recompute",
        "apply_compile",
        "apply_data_parallel",
        "apply_tensor_parallel",
        "apply_activation_offload",
        "apply_fused_ce",
    } <= table_calls
    offenders = sorted(
        f"{rel}: {name}"
        for path in PKG.rglob("*.py")
        if path.name != "assemble.py"
        for rel in [str(path.relative_to(PKG))]
        for name in _calls(path) & table_calls
        if (rel, name) not in NOT_ASSEMBLY
    )
    assert not offenders, f"transforms applied outside the table: {offenders}"
    names = [t.name for t in TRANSFORMS]
    assert len(names) == len(set(names)) and all(t.why for t in TRANSFORMS)
    # The order the docs promise: LoRA before every wrapper, recompute before compile before FSDP.
    assert (
        names.index("lora")
        < names.index("fp8")
        < names.index("tensor_parallel")
        < names.index("recompute")
        < names.index("compile")
        < names.index("data_parallel")
        < names.index("optimizer")
    )


# Tests and benchmarks build runs the way the trainer does: `resolve` + `assemble` (train/assemble.py), the
# step's inputs from `step_context` / `run_step_context`. Calling a row's function, the optimizer builder or
# a layout piece directly assembles (part of) a run by hand. The files below do it on purpose, each for its
# reason; a StepContext is never made by hand. Entries must stay true (a stale one fails too).
BUILDERS = {"build_optimizer", "set_aux_loss_weight", "apply_moe", "split_model", "build_pipeline", "ParallelModel"}
_UNIT = "unit tests of the transform itself on a hand-built model"
_PEFT = "LoRA on a small model compared with transformers + PEFT's own adapters"
_PLAN = "the planner's counts checked on models of ModelArgs the config cannot express (tied embeddings, MHA)"
HAND_ASSEMBLY: dict[str, tuple[set[str], str]] = {
    "tests/models/test_lora.py": ({"apply_lora"}, _UNIT),
    "tests/models/test_dora.py": ({"apply_lora"}, _UNIT + " (DoRA), against PEFT"),
    "tests/models/test_qlora.py": ({"apply_lora"}, _UNIT + " (NF4 bases)"),
    "tests/helpers_memory.py": ({"apply_lora"}, "the memory transforms' tests' tiny model with live adapters"),
    "tests/train/test_recompute.py": ({"apply_recompute"}, _UNIT + ", with adapters inside the blocks"),
    "tests/train/test_activation_offload.py": ({"apply_activation_offload", "apply_recompute"}, _UNIT + " and with recompute"),
    "tests/train/test_tiled_mlp.py": ({"apply_tiled_mlp", "apply_recompute", "apply_lora"}, _UNIT + ", nested in recompute"),
    "tests/models/test_attention_backends.py": ({"apply_attention"}, _UNIT),
    "tests/helpers_fp8.py": ({"apply_lora"}, "the FP8 tests' tiny LoRA model"),
    "tests/train/test_fp8.py": ({"apply_fp8"}, _UNIT + " (frozen LoRA bases quantised)"),
    "tests/train/test_fp8_host_base.py": ({"apply_fp8", "apply_lora"}, _UNIT + " (frozen LoRA bases quantised)"),
    "tests/train/test_fp8_mlp.py": ({"apply_fp8", "apply_lora", "apply_compile"}, _UNIT + " (fused FP8 MLP, compiled)"),
    "tests/train/test_kernels.py": (
        {"apply_compile", "apply_fused_ce", "apply_fused_kernels", "apply_recompute", "apply_lora", "apply_moe"},
        _UNIT + " (each kernel swap and compile, alone and with the transforms it meets)",
    ),
    "tests/train/test_unified_memory.py": ({"apply_unified_memory"}, _UNIT),
    "tests/models/test_model.py": ({"apply_moe"}, "the MoE block's own tests on a dense model made MoE"),
    "tests/parallel/test_parallel_units.py": ({"ParallelModel"}, "the one-process ParallelModel's no-op hooks"),
    "tests/models/test_hf_interop.py": ({"apply_lora"}, _PEFT),
    "tests/models/test_arch_qwen3.py": ({"apply_lora"}, _PEFT),
    "tests/models/test_arch_moe_hf.py": ({"apply_lora"}, _PEFT),
    "tests/plan/test_plan_memory.py": ({"apply_lora", "build_optimizer"}, _PLAN),
    "tests/plan/test_plan_activations.py": ({"apply_lora"}, _PLAN),
    "tests/plan/test_plan_speed_path.py": ({"apply_lora", "apply_compile", "apply_recompute"}, _PLAN + ": eager vs compiled step shapes, a recomputed compiled block's backward"),
    "benchmarks/arch_checks.py": ({"apply_fused_kernels"}, "a GPU check that the kernel swap finds each family's modules"),
    "benchmarks/memory_transforms_check.py": (
        {"apply_recompute", "apply_activation_offload"},
        "a GPU check of the memory transforms' hooks, one at a time and together",
    ),
    "benchmarks/offload_check.py": ({"apply_unified_memory"}, "a GPU self-test of managed memory on a tiny model"),
}


def _hand_assembly(root: Path, table_calls: set[str]) -> dict[str, set[str]]:
    """file -> the assembly functions it calls by hand (StepContext included)."""
    names = table_calls | BUILDERS | {"StepContext"}
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = f"{root.name}/{path.relative_to(root).as_posix()}"
        if rel != "tests/house/test_architecture.py" and (hits := _calls(path) & names):
            found[rel] = hits
    return found


def test_tests_and_benchmarks_assemble_through_the_table():
    table_calls = {c for c in _calls(PKG / "train" / "assemble.py") if c.startswith("apply_")}
    found = {**_hand_assembly(TESTS, table_calls), **_hand_assembly(BENCHMARKS, table_calls)}
    made = sorted(f for f, hits in found.items() if "StepContext" in hits)
    assert not made, f"StepContext made by hand (use step_context / run_step_context): {made}"
    bad = [
        f"{f}: {sorted(hits - HAND_ASSEMBLY.get(f, (set(), ''))[0])}"
        for f, hits in sorted(found.items())
        if hits - HAND_ASSEMBLY.get(f, (set(), ""))[0]
    ]
    assert not bad, "assembled by hand (use resolve + assemble, or add a reasoned HAND_ASSEMBLY entry):\n" + "\n".join(bad)
    stale = [f"{f}: {sorted(allowed - found.get(f, set()))}" for f, (allowed, _) in HAND_ASSEMBLY.items()
             if allowed - found.get(f, set())]
    assert not stale, f"HAND_ASSEMBLY entries no longer true: {stale}"
    assert all(why for _, why in HAND_ASSEMBLY.values())


def test_shared_constants_and_step_context_have_one_home():
    defs = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if re.search(r"^IGNORE_INDEX\s*=", p.read_text(), re.M)]
    assert defs == ["labels.py"]
    builders = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if re.search(r"(?<![\w.])StepContext\(", p.read_text()) and p.name != "step.py"
    ]
    assert builders == ["train/assemble.py"], builders


def test_no_test_helpers_in_the_library():
    assert not (PKG / "parallel" / "testing.py").exists()
    for path in PKG.rglob("*.py"):
        assert "import pytest" not in path.read_text(), path


# Config keys whose value `resolve` decides (tracetrain/spec.py): a consumer reads the spec's field, never
# the key. Validation of what the user wrote (config.py, validate.py, parallel/mesh.py's layout checks)
# reads the raw key on purpose: it judges the config, not the run.
DECIDED_KEYS = {
    ("train", "precision"),
    ("train", "attention"),
    ("train", "compile"),
    ("train", "fused_kernels"),
    ("train", "fused_ce"),
    ("train", "fused_ce_chunk"),
    ("optim", "fused"),
    ("lora", "base_dtype"),
    ("memory", "recompute_pointwise"),
}
VALIDATORS = {"spec.py", "config.py", "config_sections.py", "validate.py", "parallel/mesh.py"}


def _decided_key_reads(source: str) -> list[str]:
    """`X.train.precision`-shaped reads (any object, any depth) of a decided key, as 'line: section.key'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if (node.value.attr, node.attr) in DECIDED_KEYS:
                found.append(f"{node.lineno}: {node.value.attr}.{node.attr}")
    return found


# Test and benchmark files that read a decided key from a config, each with its reason (none today: tests
# and benchmarks read the spec's fields, e.g. `resolve(cfg, device).optimizer_fused`, or set the key).
READS_DECIDED_KEY: dict[str, str] = {}


def test_decided_config_keys_are_read_only_through_the_spec():
    bad = []
    for root in (PKG, TESTS, BENCHMARKS):
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            where = f"{root.name}/{rel}"
            if (root == PKG and rel in VALIDATORS) or where in READS_DECIDED_KEY:
                continue
            bad += [f"{where}:{hit}" for hit in _decided_key_reads(path.read_text())]
    assert not bad, "read the spec's decided value instead (tracetrain/spec.py):\n" + "\n".join(bad)


def test_the_decided_key_scan_sees_a_read():
    source = "def f(cfg, spec):\n    return cfg.optim.fused, spec.optimizer_fused, cfg.train.steps\n"
    assert _decided_key_reads(source) == ["2: optim.fused"]


def test_tune_sits_above_train_plan_and_profile():
    """tune/ runs training in child processes and reads the planner and the profile's advice; of the
    folders and modules, only the command's handlers import it (and the package's top, for the
    `tracetrain.tune(...)` call, which this walk does not count as a folder)."""
    edges = _imports()
    importers = sorted(src for src, dsts in edges.items() if "tune" in dsts)
    assert importers == ["cli_commands"], importers
    assert {"plan", "train", "profile"} <= set(edges["tune"]), dict(edges["tune"])


# A `type: ignore` names the error codes it silences and says, after two spaces and `#`, why the checker
# is wrong there (`# type: ignore[arg-type]  # torch's stubs type X as Y`); a bare one hides every error.
_IGNORE = re.compile(r"#\s*type:\s*ignore\b")
_IGNORE_WITH_REASON = re.compile(r"# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # (?P<reason>\S.*)")
_GENERIC_REASONS = {"filled before use", "buffer", "see above", "mypy", "false positive", "todo", "fixme"}


def _ignore_problem(comment: str) -> str | None:
    """Why the comment's `type: ignore` breaks the rule above, or None when it follows it."""
    if not _IGNORE.search(comment):
        return None
    match = _IGNORE_WITH_REASON.search(comment)
    if match is None:
        return "needs an error code and a reason: '# type: ignore[code]  # why'"
    reason = match["reason"].strip()
    if reason.lower().rstrip(".") in _GENERIC_REASONS or len(reason.split()) < 3:
        return f"reason {reason!r} is too generic: say why the checker is wrong here"
    return None


def test_type_ignore_rule_can_fail():
    assert _ignore_problem("# type: ignore") is not None
    assert _ignore_problem("# type: ignore[arg-type]") is not None
    assert _ignore_problem("# type: ignore[arg-type] # one space") is not None
    assert _ignore_problem("# type: ignore[arg-type]  # buffer") is not None
    assert _ignore_problem("# type: ignore[arg-type]  # filled before use") is not None
    assert _ignore_problem("# type: ignore[arg-type, union-attr]  # torch's stubs type it as Module") is None
    assert _ignore_problem("# noqa: E501") is None


def test_every_type_ignore_names_its_code_and_reason():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        with path.open() as f:
            for tok in tokenize.generate_tokens(f.readline):
                problem = _ignore_problem(tok.string) if tok.type == tokenize.COMMENT else None
                if problem:
                    bad.append(f"{path.relative_to(PKG.parent)}:{tok.start[0]}: {problem}")
    assert not bad, "\n".join(bad)


def _runtime_imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs: at module level, in functions and classes; not the type-only
    ones under `if TYPE_CHECKING:`, which never execute."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
        return [i for child in node.orelse for i in _runtime_imports(child)]
    return [i for child in ast.iter_child_nodes(node) for i in _runtime_imports(child)]


def _module_graph(folder: str) -> dict[str, set[str]]:
    """module -> the modules of the same folder it imports, e.g. {"fp8_mlp": {"fp8", "fp8_triton"}}."""
    root = PKG / folder
    package = "tracetrain." + folder.replace("/", ".")
    modules = {p.relative_to(root).with_suffix("").as_posix().replace("/", "."): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif node.module and node.level == 0:  # `from pkg import sub` imports the submodule `sub`
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        inside = {n.removeprefix(package + ".") for n in names if n.startswith(package + ".")}
        graph[module] = {m for m in inside if m in modules and m != module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in colour and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    return next((c for start in sorted(graph) if start not in colour and (c := visit(start))), None)


def test_no_import_cycle_between_modules_of_any_folder():
    """Inside every package folder modules import one way, function-level imports included (a benchmark
    self-check in a kernel module, a reader dispatch in a reader, hf.py and export.py calling each other,
    the attention cores and the model, LoRA and DoRA tied them in loops)."""
    folders = sorted(p.parent.relative_to(PKG).as_posix() for p in PKG.rglob("__init__.py") if p.parent != PKG)
    assert {"kernels", "models", "profile/analyze", "train", "data"} <= set(folders)
    for folder in folders:
        cycle = _cycle(_module_graph(folder))
        assert cycle is None, f"import cycle in tracetrain/{folder}: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_function_level_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"] and _cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("if TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    assert [n.names[0].name for n in _runtime_imports(tree)] == ["y"]


def test_models_do_not_import_data():
    """models/ holds plain modules and their generation; reading prompts, chat templates and tokenizer files
    belongs to data/ or the caller, which pass plain values in."""
    edges = _imports()
    assert "data" not in edges["models"], f"models/ imports data/: {sorted(edges['models']['data'])}"
