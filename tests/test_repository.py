"""Repository rules: the README's commands, CI running them verbatim, ruff, doctests."""

import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_setup_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in first_block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < text.index("\n## "), "the commands must open the README"
    commands = _readme_setup_commands()
    assert len(commands) == 2
    assert "pip install" in commands[0] and "fp8jax" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_setup_commands()[1] in ci


def test_readme_train_step_example_runs_and_learns():
    text = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "train_step" in b)
    namespace: dict = {}
    # Users run with JAX's standard promotion; optax's bias correction mixes an
    # int32 step count with floats, which the suite's strict mode rejects.
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(example, "README.md", "exec"), namespace)
    losses = namespace["losses"]
    assert losses[-1] < 0.5 * losses[0]
    state = namespace["fp8_state"]
    assert float(state.x.scale) != 1.0  # the state was swapped in, not left at init


def test_readme_usage_example_runs():
    text = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "qkv" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["qkv"].shape == (8, 128, 8, 128)


@pytest.mark.deviceless
def test_readme_verify_example_runs():
    text = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "verify" in b)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert len(namespace["report"].fp8_gemms) == 3


def test_ruff_is_clean():
    # ruff comes with the test extra, so it is run from this interpreter.
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "src", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


MODULES = [
    "fp8jax.formats",
    "fp8jax.recipes",
    "fp8jax.scaling",
    "fp8jax.quantize",
    "fp8jax.ops.dense",
    "fp8jax.ops.dot_general",
    "fp8jax.ops.einsum",
    "fp8jax.ops.norm",
    "fp8jax.ops.layernorm_dense",
    "fp8jax.ops.layernorm_mlp",
    "fp8jax.ops.ragged_dot",
    "fp8jax.ops.moe",
    # These compile for an H100 without a GPU, or check the toolchain that does.
    pytest.param("fp8jax.verify", marks=pytest.mark.deviceless),
    pytest.param("fp8jax.verify.compilation", marks=pytest.mark.deviceless),
    pytest.param("fp8jax.verify.assertions", marks=pytest.mark.deviceless),
    pytest.param("fp8jax.verify.toolchain", marks=pytest.mark.deviceless),
    "fp8jax.verify.report",  # compiles for the CPU
    "fp8jax.verify.jaxpr_dots",
    "fp8jax.verify.relayouts",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no runnable example"
    assert result.failed == 0


# The repository stands alone, and its text reads as a library's: the strings
# below are assembled so that this file does not match its own patterns.
OUTSIDE_REFERENCES = ("../" + "shared", "DESIGN" + ".md")
# A results path or a benchmark run's name ("run K7", "runs N1-N8", "(9C)"
# after "run") cited in library code; docs/design.md holds the figures instead.
RUN_CITATION = re.compile(
    "bench/" + "results" + r"|\b(?:runs?|calls?) (?:[A-Z][0-9]+[a-z]?|[0-9]+[A-Z][a-z]?)\b"
)
DESIGN_LINK = re.compile(r"design\.md#([\w-]+)")
# docs/design.md holds decision records, bench/results the evidence behind them
# and behind BENCHMARKS.md's rows (issue 58): these bound both.
DESIGN_MAX_LINES = 420
RESULTS_MAX_FILES = 42
RESULTS_PATH = re.compile(r"bench/results/[\w./-]*[\w/]")


def _tracked_files() -> list[pathlib.Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    # A tracked file deleted in the working tree (a change in progress) has nothing to read.
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


def outside_references(text: str) -> list[str]:
    """The references in ``text`` to files that live outside the repository."""
    return [ref for ref in OUTSIDE_REFERENCES if ref in text]


def run_citations(text: str) -> list[str]:
    """The results paths and benchmark run names cited in ``text``."""
    return [m.group(0) for m in RUN_CITATION.finditer(text)]


def test_reference_patterns_catch_what_they_are_for():
    old_dense = "simplifies the round trip away (" + "DESIGN" + ".md measured zero FP8 GEMMs)"
    old_harness = '# "mean", as in ' + "../" + "shared" + "/anchors, makes the gradient constant"
    assert outside_references(old_dense) == ["DESIGN" + ".md"]
    assert outside_references(old_harness) == ["../" + "shared"]
    assert outside_references("the measured reasons are in docs/design.md") == []
    cited = "0.63 ms (" + "bench/" + "results/h200-2026-11-30-e, run L); runs N1, 9C and call K7"
    assert run_citations(cited) == ["bench/" + "results", "runs N1", "call K7"]
    assert run_citations("(run 10C's trace), runs L2, L2b") == ["run 10C", "runs L2"]
    assert run_citations("the run takes 2 steps; runs on the CPU") == []


def test_no_tracked_file_refers_outside_the_repository():
    offenders = []
    for path in _tracked_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{path.relative_to(ROOT)}: {ref}" for ref in outside_references(text)]
    assert not offenders, "cite docs/design.md instead:\n" + "\n".join(offenders)


def test_library_code_cites_the_design_not_benchmark_runs():
    offenders = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            offenders += [
                f"{path.relative_to(ROOT)}:{number}: {hit}" for hit in run_citations(line)
            ]
    assert not offenders, "cite a docs/design.md section instead:\n" + "\n".join(offenders)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_design_links_name_sections_that_exist():
    design = (ROOT / "docs" / "design.md").read_text()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", design, re.M)}
    assert _anchor("Why FP8 operands go straight into dot_general") in anchors
    missing = []
    for path in _tracked_files():
        if path.suffix not in (".py", ".md"):
            continue
        for anchor in DESIGN_LINK.findall(path.read_text()):
            if anchor not in anchors:
                missing.append(f"{path.relative_to(ROOT)}: #{anchor}")
    assert not missing, "no such section in docs/design.md:\n" + "\n".join(missing)


def test_design_is_decision_records_not_a_notebook():
    lines = (ROOT / "docs" / "design.md").read_text().splitlines()
    assert len(lines) <= DESIGN_MAX_LINES, (
        f"docs/design.md has {len(lines)} lines (at most {DESIGN_MAX_LINES}): a record states the "
        "decision, why, what was rejected and one measured line; the narrative goes to "
        "bench/results/LOG.md"
    )


# A path the design cites as evidence or as the code that embodies a decision:
# a repository path (`tests/...py`, `bench/results/...`), a test (`...py::test_x`)
# or a module under src/fp8jax (`ops/gemm.py`).
CITED_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|log|json|md))(?:::(\w+))?`")


def test_paths_cited_in_the_design_exist():
    design = (ROOT / "docs" / "design.md").read_text()
    missing = []
    for path, test in CITED_PATH.findall(design):
        found = next(
            (c for c in (ROOT / path, ROOT / "src" / "fp8jax" / path) if c.is_file()), None
        )
        if found is None:
            missing.append(path)
        elif test and not re.search(rf"^def {test}\(", found.read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert not missing, "docs/design.md cites what does not exist:\n" + "\n".join(missing)


def test_design_path_pattern_finds_what_it_is_for():
    text = "`ops/gemm.py`, `tests/ops/test_dense.py::test_x` and `bench/results/a/b.log`, not `x`"
    assert CITED_PATH.findall(text) == [
        ("ops/gemm.py", ""),
        ("tests/ops/test_dense.py", "test_x"),
        ("bench/results/a/b.log", ""),
    ]


def test_results_keep_only_evidence():
    results = ROOT / "bench" / "results"
    tracked = [p for p in _tracked_files() if results in p.parents]
    assert len(tracked) <= RESULTS_MAX_FILES, (
        f"bench/results holds {len(tracked)} files (at most {RESULTS_MAX_FILES}): keep only the "
        "evidence of published rows and design records; git history keeps the rest"
    )
    # Scripts live in bench/ and use the public API; none sits beside the results.
    scripts = [str(p.relative_to(ROOT)) for p in tracked if p.suffix in (".py", ".sh", ".patch")]
    assert not scripts, f"move to bench/ (public API only) or delete: {scripts}"
    assert (results / "LOG.md").is_file()
    folders = {p.relative_to(results).parts[0] for p in tracked if p.parent != results}
    without_readme = sorted(f for f in folders if not (results / f / "README.md").is_file())
    assert not without_readme, f"a results folder without a README: {without_readme}"


def test_results_paths_in_the_documents_exist():
    documents = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    documents += sorted((ROOT / "bench" / "results").rglob("README.md"))
    missing = [
        f"{doc.relative_to(ROOT)}: {found}"
        for doc in documents
        for found in RESULTS_PATH.findall(doc.read_text())
        if not (ROOT / found).exists()
    ]
    assert not missing, "\n".join(missing)


def test_benchmarks_is_a_summary_not_a_diary():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 300, f"BENCHMARKS.md has {len(lines)} lines; history belongs in git"
