"""The MoE presets of fp8jax train: a short run, the active-parameter FLOPs count, the options.

The runs use the toy presets (mixtral-tiny, deepseek-tiny) at a few steps on
the CPU: they check the wiring (the aux loss in the loss, the routing
statistics on the progress line and in summary.json), not convergence.
"""

import json

import jax
import numpy as np
import pytest

from fp8jax.models import GptConfig
from fp8jax.training import TrainOptions, mfu, train
from fp8jax.training.config import PRESETS, resolve
from fp8jax.training.errors import ConfigError

pytestmark = pytest.mark.usefixtures("shared_compile_cache")

FAST = {"steps": 2, "log_every": 2, "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2}


def test_the_presets_have_the_shapes_they_are_named_after():
    mixtral, deepseek = PRESETS["mixtral"].model, PRESETS["deepseek"].model
    assert (mixtral.experts, mixtral.top_k, mixtral.shared_experts) == (8, 2, 0)
    assert (deepseek.experts, deepseek.top_k, deepseek.shared_experts) == (64, 6, 2)
    assert deepseek.dense_layers == 1 and mixtral.dense_layers == 0
    for name in ("mixtral", "deepseek", "mixtral-tiny", "deepseek-tiny"):
        model = PRESETS[name].model
        assert PRESETS[name].model.experts == PRESETS[f"{name.split('-')[0]}"].model.experts
        assert model.num_params(active=True) < model.num_params()


def test_the_h200_presets_have_the_layers_of_their_models():
    # Mixtral-8x7B's layer and DeepSeek-V2-Lite's (bench/moe.py's SHAPES, where FP8's
    # grouped GEMMs were measured), over 4096 bytes, at the depth and batch that
    # bench/moe_memory.py fits in an H200 (docs/train.md#moe-presets).
    mixtral, deepseek = PRESETS["mixtral"], PRESETS["deepseek"]
    m, d = mixtral.model, deepseek.model
    assert (m.hidden, m.heads, m.kv_heads, m.ffn, m.expert_ffn) == (4096, 32, 8, 14336, None)
    assert (d.hidden, d.heads, d.kv_heads, d.expert_ffn) == (2048, 16, None, 1408)
    assert mixtral.seq_len == deepseek.seq_len == 4096
    assert m.layers >= 4 and d.layers >= 8 and mixtral.batch_size >= 4 and deepseek.batch_size >= 8
    for model in (m, d):
        # Every GEMM width a multiple of 128, as the BF16 grouped kernels need.
        widths = (model.hidden, model.ffn, model.expert_ffn or model.ffn)
        assert all(w % 128 == 0 for w in widths), widths
    # A token's GEMMs are mostly its experts': 85.7% of mixtral's FLOPs, 64.2% of deepseek's.
    for model, share in ((m, 0.857), (d, 0.642)):
        experts = model.moe_layers * (model.top_k + model.shared_experts) * 3 * model.hidden
        experts *= model.expert_ffn or model.ffn
        assert 6 * experts / mfu.flops_per_token(model, 4096) == pytest.approx(share, abs=1e-3)


def test_flops_per_token_counts_the_active_experts_only():
    model = GptConfig(hidden=64, layers=3, heads=4, ffn=128, experts=8, top_k=2, expert_ffn=32,
                      shared_experts=1, dense_layers=1)  # fmt: skip
    # Attention per layer: QKV 64 x 12 x 16 = 12288, output 4096: 16384. The
    # dense layer's SwiGLU: 3 x 64 x 128 = 24576. Each MoE layer: its router
    # 64 x 8 = 512 and 2 routed + 1 shared experts of 3 x 64 x 32 = 6144:
    # 18944. Weights: 3 x 16384 + 24576 + 2 x 18944 + LM head 16384 = 128000.
    # Attention at seq 16: 3 layers x 6528 (test_mfu's per-layer count).
    assert mfu.flops_per_token(model, 16) == 6 * 128000 + 3 * 6528


def test_a_short_moe_run_reports_its_load_balance(tmp_path):
    # DeepSeek's shape: a dense first layer, then shared and 64 fine-grained experts.
    # Two sequences a batch, not the preset's 8: the wiring does not depend on the batch,
    # and on a CPU each step of 64 experts takes seconds, about half as long at 2.
    messages = []
    options = TrainOptions(out=str(tmp_path), config="deepseek-tiny", batch_size=2, **FAST)
    result = train(options, progress=False, say=messages.append)
    assert result.status == "completed"
    lines = [m for m in messages if m.startswith("step ")]
    assert lines and all("balance" in m for m in lines), messages
    summary = json.loads((tmp_path / "summary.json").read_text())
    moe = summary["moe"]
    assert 1 <= moe["load_balance"] <= 64  # max share over the mean
    assert moe["dropped"] is None and "active parameters" in moe["mfu_counts"]
    assert moe["active_params"] < summary["params"]
    assert any("MoE: load balance" in m for m in messages), messages


def test_the_bf16_moe_model_has_the_fp8_models_parameters_and_bf16_experts():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8jax.models import Gpt

    model, tokens = PRESETS["deepseek-tiny"].model, jnp.zeros((2, 16), jnp.int32)
    init = {p: jax.jit(Gpt(config=model, precision=p).init)(jax.random.key(0), tokens)["params"]
            for p in ("fp8", "bf16")}  # fmt: skip

    # The same initializers, compiled in two programs: XLA's CPU loop emitters round
    # a few leaves' truncated-normal math differently (at most 3 f32 spacings of the
    # leaf's largest value, measured), so equal up to 4 spacings, not bit for bit.
    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        spacing = np.spacing(np.abs(a).max()) if a.size else 0
        return a.shape == b.shape and bool((np.abs(a - b) <= 4 * spacing).all())

    assert jax.tree.all(jax.tree.map(same, init["fp8"], init["bf16"]))
    jaxpr = str(jax.make_jaxpr(Gpt(config=model, precision="bf16").apply)({"params": init["bf16"]},
                                                                          tokens))  # fmt: skip
    assert "ragged_dot" in jaxpr and "f8" not in jaxpr


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"recipe": "delayed"}, r"--recipe delayed: the MoE preset 'mixtral-tiny' .*current"),
        ({"recipe": "block"}, r"--recipe block: the MoE preset"),
        ({"moe_aux_weight": -1.0}, r"--moe-aux-weight must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_moe_options_name_the_option(overrides, match):
    with pytest.raises(ConfigError, match=match):
        resolve(TrainOptions(out="unused", config="mixtral-tiny", **overrides))


def test_the_aux_weight_is_refused_for_a_dense_preset_which_has_no_aux_loss():
    with pytest.raises(ConfigError, match=r"--moe-aux-weight .* dense preset 'tiny' .* got 0.1"):
        resolve(TrainOptions(out="unused", config="tiny", moe_aux_weight=0.1))
    # A dense run's config.json records the default, which its resume passes back.
    assert resolve(TrainOptions(out="x", config="tiny", moe_aux_weight=0.01)).moe_aux_weight == 0.01


def test_the_aux_weight_is_an_option_recorded_in_the_run():
    assert resolve(TrainOptions(out="x", config="deepseek-tiny")).moe_aux_weight == 0.01
    config = resolve(TrainOptions(out="x", config="deepseek-tiny", moe_aux_weight=0.1))
    assert config.to_dict()["moe_aux_weight"] == 0.1
    assert config.to_dict()["model"]["experts"] == 64
    # A dense preset's config.json keeps its model fields as before the MoE ones.
    assert "experts" not in resolve(TrainOptions(out="x", config="tiny")).to_dict()["model"]


def _expert_updates(run) -> dict:
    """The experts' parameter change over step 2, from the checkpoints of steps 1 and 2."""
    import orbax.checkpoint as ocp

    def experts(step):
        path = (run / "checkpoints" / str(step) / "default").absolute()
        leaves = jax.tree_util.tree_leaves_with_path(ocp.StandardCheckpointer().restore(path))
        names = {jax.tree_util.keystr(k): v for k, v in leaves}
        return {k: np.asarray(v, np.float64) for k, v in names.items()
                if k.startswith("['params']") and ("['wi']" in k or "['wo']" in k)}  # fmt: skip

    before, after = experts(1), experts(2)
    return {k: after[k] - before[k] for k in before}


def test_expert_parallel_training_matches_one_device(tmp_path):
    # --mesh ep=8 on 8 CPU devices: each device holds one of mixtral-tiny's 8
    # experts and exchanges its tokens' rows; dropless, the same sums as one
    # device. Each device quantizes the rows it holds with their own scale, so
    # the FP8 roundings (E4M3: 2^-4 relative) differ row by row; averaged over
    # the batch's 512 tokens the losses moved by 4e-4 at most (step 2's val).
    fast = FAST | {"log_every": 1, "checkpoint_every": 1}
    runs, updates = {}, {}
    for mesh in (None, "ep=8"):
        out = tmp_path / str(mesh)
        options = TrainOptions(out=str(out), config="mixtral-tiny", mesh=mesh, **fast)
        assert train(options, progress=False, say=print).status == "completed"
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mesh] = [m["loss"] for m in lines] + [lines[-1]["val_loss"]]
        updates[mesh] = _expert_updates(out)
    assert len(runs[None]) == 3
    assert runs["ep=8"] == pytest.approx(runs[None], rel=2e-3)
    # The experts' own update, which the losses average away: AdamW's first
    # update is about the learning rate times the gradient's sign, which the
    # per-device FP8 roundings flip where a gradient is near 0: the two runs'
    # updates differed by 0.25-0.27 of their norm. Experts that got no rows (or
    # no gradient) through the exchange move by weight decay only, 1.0 off;
    # rows sent to the wrong experts give uncorrelated updates, sqrt(2) off.
    assert updates["ep=8"].keys() == updates[None].keys() and len(updates[None]) == 2
    for name, want in updates[None].items():
        got = updates["ep=8"][name]
        assert np.linalg.norm(got - want) < 0.5 * np.linalg.norm(want), name
    summary = json.loads((tmp_path / "ep=8" / "summary.json").read_text())
    assert summary["mesh"] == {"dp": 1, "fsdp": 1, "ep": 8}
    # The experts (and their AdamW moments) are split over ep: one per device.
    import jax
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager((tmp_path / "ep=8" / "checkpoints").absolute(),
                                    item_handlers=ocp.StandardCheckpointHandler())  # fmt: skip
    saved = manager.item_metadata(2).tree
    experts = {jax.tree_util.keystr(path): tuple(leaf.sharding.partition_spec)
               for path, leaf in jax.tree_util.tree_leaves_with_path(saved)
               if "'wi'" in jax.tree_util.keystr(path)}  # fmt: skip
    manager.close()
    assert len(experts) == 3 and all(spec[:2] == (None, "ep") for spec in experts.values()), experts


@pytest.mark.parametrize(
    ("config", "mesh", "match"),
    [
        ("tiny", "ep=2", r"--mesh ep=2 splits .* but the model has no MoE layer"),
        ("mixtral-tiny", "ep=4,dp=2", None),
        ("deepseek-tiny", "ep=8", None),
        ("mixtral-tiny", "dp=1,ep=3", r"--mesh ep=3 .* but the model has 8; use an ep"),
    ],
)
def test_the_ep_axis_must_split_the_experts(config, mesh, match):
    from fp8jax.training import mesh as mesh_lib

    model = PRESETS[config].model
    axes = mesh_lib.parse_mesh(mesh)
    build = lambda: mesh_lib.build_mesh(axes, batch_size=24, hidden=model.hidden,  # noqa: E731
                                        experts=model.experts)  # fmt: skip
    if match is None:
        assert "ep" in build().axis_names
    else:
        with pytest.raises(ConfigError, match=match):
            build()
