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
    "fp8jax.ops.einsum",
    "fp8jax.ops.norm",
    "fp8jax.ops.fused",
    "fp8jax.verify",
    "fp8jax.verify.compilation",
    "fp8jax.verify.jaxpr_dots",
    "fp8jax.verify.relayouts",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no runnable example"
    assert result.failed == 0
