"""Every ```python block of README.md and docs/*.md runs as written.

A block runs in one namespace with the blocks before it in the same file, as a
reader pastes them. An HTML comment right above a block says when it cannot
run on a CPU-only test machine:

- ``<!-- snippet: deviceless -->``: compiles for an H100/H200, so it needs
  fp8jax[verify]; marked ``deviceless`` (tests/conftest.py skips or fails it).
- ``<!-- snippet: gpu -->``: needs a GPU; skipped here.
- ``<!-- snippet: fragment -->``: part of a program shown elsewhere; not run.

Three documents have their own tests with stronger assertions (losses that
fall, shardings, GEMM counts); this file does not run their blocks again, but
checks that those tests cover every block (a new block fails until its
document's test runs it).
"""

import contextlib
import io
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!--\s*snippet:\s*(\w+)[^>]*-->\s*)?```python\n(.*?)```", re.S)
KINDS = ("run", "deviceless", "gpu", "fragment")

# Documents whose blocks other tests run, with how many blocks those tests run.
COVERED_ELSEWHERE = {
    "README.md": (
        4,
        "tests/test_repository.py (usage, train step, verify), "
        "tests/sharding/test_sharding_docs.py (sharding)",
    ),
    "docs/flax.md": (5, "tests/flax/test_flax_docs.py"),
    "docs/sharding.md": (3, "tests/sharding/test_sharding_docs.py"),
}


def snippets(path: pathlib.Path) -> list[tuple[str, str]]:
    """``(kind, code)`` of every python block in ``path``."""
    return [(kind or "run", code) for kind, code in BLOCK.findall(path.read_text())]


def name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def run_blocks(path: pathlib.Path, kinds: tuple[str, ...]) -> tuple[dict, str]:
    """Runs the blocks of ``kinds`` in order in one namespace; returns it and the output."""
    namespace: dict = {"__name__": "__snippet__"}
    output = io.StringIO()
    # Users run with JAX's standard promotion; optax mixes its int32 step count with floats,
    # which the suite's strict mode rejects.
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(output):
        for kind, code in snippets(path):
            if kind in kinds:
                exec(compile(code, name(path), "exec"), namespace)
    return namespace, output.getvalue()


def test_every_block_is_marked_with_a_known_kind():
    for path in DOCUMENTS:
        for kind, code in snippets(path):
            assert kind in KINDS, f"{name(path)}: unknown snippet kind {kind!r} above {code[:60]!r}"


def test_documents_with_their_own_tests_have_the_blocks_those_tests_run():
    for document, (count, owner) in COVERED_ELSEWHERE.items():
        found = len(snippets(ROOT / document))
        assert found == count, (
            f"{document} has {found} python blocks; {owner} runs {count}. Run the new block "
            "there and update the count here."
        )


RUN_HERE = [p for p in DOCUMENTS if name(p) not in COVERED_ELSEWHERE and snippets(p)]


@pytest.fixture(scope="module")
def blocks_run(tmp_path_factory):
    """``blocks_run(path, kinds)``: ``(cwd, namespace, output)`` of run_blocks, once per module.

    Each run gets a fresh working directory (blocks may write run directories
    relative to the cwd). Two tests run docs/verify.md's blocks (a deviceless
    compile); on one worker they read one run instead of making their own.
    """
    runs: dict = {}

    def run(path: pathlib.Path, kinds: tuple[str, ...]):
        if (path, kinds) not in runs:
            cwd = tmp_path_factory.mktemp("blocks")
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(cwd)
                runs[path, kinds] = (cwd, *run_blocks(path, kinds))
        return runs[path, kinds]

    return run


@pytest.mark.parametrize("path", RUN_HERE, ids=name)
def test_the_cpu_blocks_run(path, blocks_run):
    if not any(kind == "run" for kind, _ in snippets(path)):
        pytest.skip(f"{name(path)} has no block that runs on a CPU alone")
    cwd, namespace, output = blocks_run(path, ("run",))
    if name(path) == "docs/train.md":
        # Its Python API block trains the tiny preset (checked here, not in a test
        # of its own: under pytest-xdist another worker would run the 20 steps again).
        result = namespace["result"]
        assert result.status == "completed" and result.step == 20
        assert (cwd / "runs" / "api" / "summary.json").is_file()
        assert output.splitlines()[-1].startswith("completed ")  # the block's own print


@pytest.mark.deviceless
@pytest.mark.parametrize(
    "path", [p for p in RUN_HERE if any(k == "deviceless" for k, _ in snippets(p))], ids=name
)
def test_the_deviceless_blocks_run(path, blocks_run):
    blocks_run(path, ("run", "deviceless"))


@pytest.mark.deviceless
def test_verify_md_first_block_finds_the_fp8_gemms(blocks_run):
    _, namespace, output = blocks_run(ROOT / "docs" / "verify.md", ("run", "deviceless"))
    assert namespace["report"].fp8_gemms and not namespace["report"].non_fp8_gemms
    assert "('float8_e4m3fn', 'float8_e4m3fn')" in output
    # It says it checks FSDP (issue 56, item 7): a sharded program, the weight
    # all-gathered in E4M3 and its gradient reduce-scattered, not a replicated one.
    report = namespace["verify"].gemm_report(namespace["hlo"])
    assert len(report.fp8_gemms) == 2
    kinds = {(c.kind.split()[0], c.dtype) for c in report.collectives}
    assert {("all-gather", "f8e4m3fn"), ("reduce-scatter", "bf16")} <= kinds


def test_jaxpr_dots_is_the_function_the_readme_names():
    """``fp8jax.verify.jaxpr_dots`` was the module, which shadowed the function."""
    import jax.numpy as jnp

    import fp8jax
    import fp8jax.verify
    from fp8jax.verify.jaxpr_dots import jaxpr_dots

    assert fp8jax.verify.jaxpr_dots is jaxpr_dots
    x, w = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 4), jnp.float32)
    dots = fp8jax.verify.jaxpr_dots(lambda x, w: fp8jax.dense(x, w), x, w)
    assert [d.operand_formats for d in dots] == [("float8_e4m3fn", "float8_e4m3fn")]


def test_the_drop_in_examples_comment_gives_the_error_it_prints():
    """docs/flax.md's drop-in example prints FP8's relative error against BF16: "~0.06".

    CurrentScaling rounds each operand to E4M3 (3 mantissa bits, a relative
    spacing of 2**-3 between neighbours, so up to 2**-4 = 0.0625 rounding
    error per element, about 0.036 RMS for uniformly spread mantissas) and the
    two layers compound it; 0.04 to 0.09 is what "~0.06" claims.
    """
    text = (ROOT / "docs" / "flax.md").read_text()
    (code,) = [c for _, c in snippets(ROOT / "docs" / "flax.md") if "fp8_dot_general" in c]
    assert "# ~0.06" in code and "# ~0.06" in text
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as output:
        exec(compile(code, "docs/flax.md", "exec"), namespace)
    assert 0.04 < float(output.getvalue().split()[-1]) < 0.09
