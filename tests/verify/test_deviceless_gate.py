"""tests/conftest.py's gate for deviceless tests: skip without the extra, fail when broken.

Each case runs this repository's conftest in a pytester session, with the
toolchain check and the plugin lookup replaced, on one ``deviceless`` test
and one plain test.
"""

import pathlib

import pytest

from fp8jax.verify import toolchain

CONFTEST = (pathlib.Path(__file__).parents[1] / "conftest.py").read_text()
TESTS = """
import pytest

@pytest.mark.deviceless
def test_compiles():
    pass

def test_plain():
    pass
"""


def _broken():
    raise ImportError("ptxas was not found (planted)")


def _run(pytester, monkeypatch, *, check, plugin_version, ci=False):
    monkeypatch.setattr(toolchain, "check_deviceless", check)
    real_version = toolchain.distribution_version
    monkeypatch.setattr(
        toolchain,
        "distribution_version",
        lambda name: plugin_version if name == toolchain.PLUGIN else real_version(name),
    )
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("FP8JAX_TEST_GPU", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    deviceless: d\n    gpu: g\n")
    pytester.makepyfile(TESTS)
    return pytester.runpytest_inprocess("-rsf", "-p", "no:randomly")


def test_installed_but_broken_fails_the_deviceless_tests_loudly(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, check=_broken, plugin_version="0.10.2")
    # The failure is raised in setup, so pytest counts it as an error: the run fails.
    result.assert_outcomes(passed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*fp8jax?verify? is installed but broken: ptxas was not found*"])


def test_not_installed_skips_them_with_the_reason(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, check=_broken, plugin_version=None)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*fp8jax?verify? is not installed: ptxas was not found*"])


def test_not_installed_under_ci_fails(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, check=_broken, plugin_version=None, ci=True)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*not installed, and CI is set*"])


@pytest.mark.parametrize("plugin_version", ["0.10.2", None])
def test_a_working_toolchain_runs_them(pytester, monkeypatch, plugin_version):
    result = _run(pytester, monkeypatch, check=lambda: None, plugin_version=plugin_version)
    result.assert_outcomes(passed=2)
