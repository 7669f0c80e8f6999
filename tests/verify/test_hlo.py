"""The HLO text parser: types, instructions, metadata, stack frames."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8jax.verify import _hlo

DTYPES = ["f8e4m3fn", "f8e5m2", "bf16", "f32", "s8", "pred", "u32"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("f32[]", [("f32", ())]),
        ("bf16[64,1024]{1,0}", [("bf16", (64, 1024))]),
        ("f8e4m3fn[256,2048,4]{1,0,2}", [("f8e4m3fn", (256, 2048, 4))]),
        ("f32[<=8,4]{1,0}", [("f32", (8, 4))]),
        ("bf16[8,128]{1,0:T(8,128)(2,1)}", [("bf16", (8, 128))]),
        (
            "(f8e4m3fn[64,1024]{1,0}, f8e4m3fn[512,1024]{1,0})",
            [("f8e4m3fn", (64, 1024)), ("f8e4m3fn", (512, 1024))],
        ),
        (
            "((f32[1024,2048]{1,0}), f32[128,2048]{1,0})",
            [("f32", (1024, 2048)), ("f32", (128, 2048))],
        ),
        ("(s32[], bf16[2]{0}, /*index=2*/f32[3]{0})", [("s32", ()), ("bf16", (2,)), ("f32", (3,))]),
    ],
)
def test_parse_type(text, expected):
    leaves, end = _hlo.parse_type(text)
    assert [(t.dtype, t.shape) for t in leaves] == expected
    assert end == len(text)


@st.composite
def _types(draw, depth=0):
    if depth < 2 and draw(st.booleans()):
        elements = draw(st.lists(_types(depth + 1), min_size=0, max_size=6))
        text = "(" + ", ".join(f"/*index={i}*/{e[0]}" if i == 5 else e[0]
                               for i, e in enumerate(elements)) + ")"  # fmt: skip
        return text, [leaf for e in elements for leaf in e[1]]
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 4096), max_size=4)))
    layout = "{" + ",".join(map(str, reversed(range(len(shape))))) + "}" if shape else ""
    return f"{dtype}[{','.join(map(str, shape))}]{layout}", [(dtype, shape)]


@given(_types())
def test_parse_type_reads_every_leaf_of_nested_tuples(case):
    text, leaves = case
    parsed, end = _hlo.parse_type(text + " all-gather-start(%x)")
    assert [(t.dtype, t.shape) for t in parsed] == leaves
    assert end == len(text)


def test_parse_instruction_with_tuple_result_and_dotted_names():
    line = (
        "  %all-gather-start.1 = (f8e5m2[64,2048]{1,0}, f8e5m2[512,2048]{1,0}) "
        "all-gather-start(%loop_convert_fusion.2), channel_id=3, dimensions={0}, "
        'metadata={op_name="jit(f)/dot_general" stack_frame_id=5}'
    )
    inst = _hlo.parse_instruction(line)
    assert inst.name == "all-gather-start.1"
    assert inst.opcode == "all-gather-start"
    assert [str(t) for t in inst.types] == ["f8e5m2[64,2048]", "f8e5m2[512,2048]"]
    assert inst.operands == ("loop_convert_fusion.2",)
    assert inst.metadata == {"op_name": "jit(f)/dot_general", "stack_frame_id": "5"}
    assert not inst.is_root


def test_parse_custom_call_and_fusion_attributes():
    cublas = _hlo.parse_instruction(
        '  %cublas-gemm.3 = (bf16[1024,2048]{1,0}, s8[4194304]{0}) custom-call(%bitcast.9.0, '
        '%all-gather-done, %constant_8_0), custom_call_target="__cublas$lt$matmul$f8", '
        'backend_config={"gemm_backend_config":{"alpha_real":1}}'
    )  # fmt: skip
    assert cublas.custom_call_target == "__cublas$lt$matmul$f8"
    assert cublas.operands == ("bitcast.9.0", "all-gather-done", "constant_8_0")
    assert cublas.types[0].dtype == "bf16"
    fusion = _hlo.parse_instruction(
        "  ROOT %gemm_fusion_dot.1 = f32[4,64,2048]{2,1,0} fusion(%bitcast.3.0, %bitcast.9.0), "
        "kind=kCustom, calls=%gemm_fusion_dot.1_computation, "
        'metadata={op_name="a \\"quoted\\" {name}"}, '
        'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}'
    )
    assert fusion.is_root
    assert fusion.fusion_kind == "kCustom"
    assert fusion.backend_kind == "__triton_nested_gemm_fusion"
    assert fusion.called == ("gemm_fusion_dot.1_computation",)
    assert fusion.metadata["op_name"] == 'a "quoted" {name}'


def test_parse_instruction_skips_non_instruction_lines():
    assert _hlo.parse_instruction("FileNames") is None
    assert _hlo.parse_instruction("1 {file_location_id=1 parent_frame_id=1}") is None


MODULE = """\
HloModule jit_f, entry_computation_layout={(bf16[8]{0})->bf16[8]{0}}, num_partitions=4

FileNames
1 "/home/me/train.py"
2 "/site-packages/jax/_src/numpy/lax_numpy.py"

FunctionNames
1 "<module>"
2 "step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=40 end_line=40 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=1 end_column=2}
3 {file_name_id=2 function_name_id=2 line=99 end_line=99 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}


%inner (p: bf16[8]) -> bf16[8] {
  ROOT %p = bf16[8]{0} parameter(0)
}

ENTRY %main (a: bf16[8]) -> bf16[8] {
  %a = bf16[8]{0} parameter(0), metadata={op_name="a"}
  ROOT %f = bf16[8]{0} fusion(%a), kind=kLoop, calls=%inner, metadata={stack_frame_id=3}
}
"""


def test_parse_module_computations_and_stack():
    module = _hlo.parse_module(MODULE)
    assert module.name == "jit_f"
    assert module.num_partitions == 4
    assert set(module.computations) == {"inner", "main"}
    assert module.entry.name == "main"
    assert module.entry.root.name == "f"
    assert module.computations["inner"].parameter(0).name == "p"
    # XLA prints parent_frame_id one past the parent's id: frame 3's parent is 2.
    assert [str(f) for f in module.stack(3)] == [
        "/site-packages/jax/_src/numpy/lax_numpy.py:99",
        "/home/me/train.py:12",
        "/home/me/train.py:40",
    ]


def test_parse_module_rejects_what_is_not_hlo():
    with pytest.raises(TypeError, match="hlo_text must be a str"):
        _hlo.parse_module(b"HloModule m")
    with pytest.raises(ValueError, match="no HLO computation"):
        _hlo.parse_module("hello")


def test_tensor_type_bytes():
    assert _hlo.TensorType("f8e4m3fn", (1024, 2048)).nbytes == 2 * 1024 * 1024
    assert _hlo.TensorType("bf16", (4,)).nbytes == 8
    assert _hlo.TensorType("pred", ()).nbytes == 1
