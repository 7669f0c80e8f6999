"""What a deviceless compile needs installed: each missing piece is named with its fix."""

import jax
import jax.numpy as jnp
import pytest

from fp8jax.verify import compile_for, toolchain

X = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)


def _versions(**overrides):
    installed = {"jaxlib": "0.10.2", toolchain.PLUGIN: "0.10.2", toolchain.PJRT: "0.10.2"}
    installed.update(overrides)
    return lambda name: installed.get(name)


def test_missing_plugin_says_to_install_the_extra(monkeypatch):
    monkeypatch.setattr(toolchain, "distribution_version", _versions(**{toolchain.PLUGIN: None}))
    with pytest.raises(ImportError, match=r"jax-cuda13-plugin is not installed.*fp8jax\[verify\]"):
        compile_for(jnp.dot, X, X, target="h100")


def test_plugin_version_mismatch_names_both_versions_and_the_fix(monkeypatch):
    monkeypatch.setattr(
        toolchain,
        "distribution_version",
        _versions(**{toolchain.PLUGIN: "0.10.1", toolchain.PJRT: "0.10.1"}),
    )
    with pytest.raises(ImportError) as info:
        compile_for(jnp.dot, X, X, target="h200")
    message = str(info.value)
    assert "jax-cuda13-plugin 0.10.1" in message and "jaxlib 0.10.2" in message
    assert "pip install jax-cuda13-plugin==0.10.2" in message


def test_missing_ptxas_names_nvidia_cuda_nvcc(monkeypatch, tmp_path):
    monkeypatch.setattr(toolchain, "distribution_version", _versions())
    monkeypatch.setattr(toolchain, "cuda_roots", lambda: [tmp_path])
    with pytest.raises(ImportError, match="ptxas was not found.*nvidia-cuda-nvcc"):
        toolchain.check_deviceless()


def test_missing_libdevice_names_nvidia_nvvm(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ptxas").write_text("")
    monkeypatch.setattr(toolchain, "distribution_version", _versions())
    monkeypatch.setattr(toolchain, "cuda_roots", lambda: [tmp_path])
    with pytest.raises(ImportError, match="libdevice.*nvidia-nvvm"):
        toolchain.check_deviceless()


def test_live_target_needs_no_plugin(monkeypatch):
    # target="live" compiles in-process; only the GPU backend matters.
    monkeypatch.setattr(toolchain, "distribution_version", lambda name: None)
    with pytest.raises(RuntimeError, match="default_backend"):
        compile_for(jnp.dot, X, X, target="live")


@pytest.mark.parametrize("name", toolchain.TARGET_NAMES)
def test_shipped_target_configs(name):
    text = toolchain.target_config(name)
    assert toolchain.validate_target_config(text, name) == text
    # JAX 0.10.2 rejects this field of newer spec files (the comments name it).
    fields = [line for line in text.splitlines() if not line.startswith("#")]
    assert not any("collective_memory_granularity" in line for line in fields)
    major = 10 if name == "b200" else 9  # Blackwell; Hopper
    assert f"cuda_compute_capability {{ major: {major} }}" in text


def _changed_lines(old: str, new: str) -> set[tuple[str, str]]:
    """The device-description lines that differ between two shipped targets, as (old, new)."""
    old_lines, new_lines = (
        toolchain.target_config(n).split("gpu_device_info", 1)[1].splitlines() for n in (old, new)
    )
    return {(a.strip(), b.strip()) for a, b in zip(old_lines, new_lines, strict=True) if a != b}


def test_b200_is_the_h200_with_blackwells_capability_and_sms():
    """The b200 target is structural: only what decides XLA's GEMMs differs from the H200's."""
    assert _changed_lines("h200", "b200") == {
        ("core_count: 132", "core_count: 148"),
        ("cuda_compute_capability { major: 9 }", "cuda_compute_capability { major: 10 }"),
        ('device_description_str: "NVIDIA H200"', 'device_description_str: "NVIDIA B200"'),
    }


def test_h200_differs_from_h100_in_memory_and_l2():
    changed = {a.split(":")[0] for a, _ in _changed_lines("h100", "h200")}
    assert changed == {
        "memory_bandwidth",
        "l2_cache_size",
        "device_memory_size",
        "device_description_str",
    }
    h200 = toolchain.target_config("h200")
    assert "device_memory_size: 150109880320" in h200  # CUDA totalGlobalMem on the H200
    assert "l2_cache_size: 62914560" in h200


def test_unknown_target_name():
    with pytest.raises(ValueError, match="target must be one of"):
        toolchain.target_config("a100")
