"""A small parser for optimized HLO text: instructions, types, calls, metadata.

It reads only what the GEMM report needs, and it reads it from the text XLA
prints after optimization (``compiled.as_text()``), because that is the only
form in which the chosen GEMM backend (cuBLASLt, Triton, cuDNN) is visible.
"""

from __future__ import annotations

import dataclasses
import functools
import re

_NAME = r"[A-Za-z0-9_.\-$]+"
_ARRAY_TYPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_INSTRUCTION_HEAD = re.compile(rf"\s*(ROOT\s+)?%?({_NAME})\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(rf"%({_NAME})")
_COMPUTATION_HEAD = re.compile(rf"(ENTRY\s+)?%?({_NAME})\s*(\(.*\)\s*->.*)?\{{\s*$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation"
    rf"|false_computation)=(\{{[^}}]*\}}|%{_NAME})"
)
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r"\bkind=(k[A-Za-z]+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_QUOTED_FIELD = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_INT_FIELD = re.compile(r"(\w+)=(-?\d+)")

# Bytes per element; the sub-byte types round up because no collective moves
# half a byte per element in practice.
_DTYPE_BYTES = {"pred": 1, "token": 0, "tuple": 0, "opaque": 0, "c64": 8, "c128": 16}


@dataclasses.dataclass(frozen=True)
class TensorType:
    """One array type of an HLO value, e.g. ``f8e4m3fn[64,1024]``."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("f8")

    @property
    def nbytes(self) -> int:
        size = 1
        for dim in self.shape:
            size *= dim
        if self.dtype in _DTYPE_BYTES:
            return size * _DTYPE_BYTES[self.dtype]
        bits = re.search(r"\d+", self.dtype)
        return size * max(1, int(bits.group()) // 8) if bits else 0

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction; ``types`` is its result type with tuples flattened."""

    name: str
    opcode: str
    types: tuple[TensorType, ...]
    operands: tuple[str, ...]
    attrs: str
    is_root: bool = False
    args_text: str = ""  # the raw text inside the parentheses, e.g. a parameter number

    @functools.cached_property
    def metadata(self) -> dict[str, str]:
        start = self.attrs.find("metadata={")
        if start < 0:
            return {}
        body = self.attrs[start + len("metadata={") : _closing(self.attrs, start + 9, "{", "}")]
        fields = {k: _unescape(v) for k, v in _QUOTED_FIELD.findall(body)}
        fields.update((k, v) for k, v in _INT_FIELD.findall(body) if k not in fields)
        return fields

    @functools.cached_property
    def called(self) -> tuple[str, ...]:
        head = self.attrs.split("metadata={", 1)[0]
        return tuple(name for group in _CALLED.findall(head) for name in _OPERAND.findall(group))

    @property
    def custom_call_target(self) -> str | None:
        match = _CUSTOM_CALL_TARGET.search(self.attrs)
        return match.group(1) if match else None

    @property
    def fusion_kind(self) -> str | None:
        match = _FUSION_KIND.search(self.attrs)
        return match.group(1) if match else None

    @property
    def backend_kind(self) -> str | None:
        """The ``"kind"`` of a fusion's backend config, e.g. ``__triton_gemm``."""
        match = _BACKEND_KIND.search(self.attrs)
        return match.group(1) if match else None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: dict[str, Instruction]
    is_entry: bool

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.is_root)

    @functools.cached_property
    def users(self) -> dict[str, list[Instruction]]:
        """The instructions that read each value, by the value's name."""
        users: dict[str, list[Instruction]] = {}
        for inst in self.instructions.values():
            for operand in inst.operands:
                users.setdefault(operand, []).append(inst)
        return users

    def parameter(self, index: int) -> Instruction | None:
        for inst in self.instructions.values():
            if inst.opcode == "parameter" and inst.args_text.strip() == str(index):
                return inst
        return None


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module: computations by name plus the stack-frame tables."""

    name: str
    computations: dict[str, Computation]
    num_partitions: int
    _frames: dict[int, tuple[int, int]]  # frame id -> (location id, parent frame id)
    _locations: dict[int, Frame]

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.is_entry)

    def stack(self, frame_id: int) -> tuple[Frame, ...]:
        """The call stack of ``stack_frame_id``, innermost frame first."""
        stack, seen = [], set()
        while frame_id in self._frames and frame_id not in seen:
            seen.add(frame_id)
            location_id, frame_id = self._frames[frame_id]
            if location_id in self._locations:
                stack.append(self._locations[location_id])
        return tuple(stack)


def parse_module(text: str) -> Module:
    """Parses the text of one optimized HLO module."""
    if not isinstance(text, str):
        raise TypeError(f"hlo_text must be a str of HLO text; got {type(text).__name__}.")
    lines = text.splitlines()
    header = next((line for line in lines if line.startswith("HloModule ")), "")
    name = header.split()[1].rstrip(",") if header else ""
    partitions = re.search(r"num_partitions=(\d+)", header)
    tables = _parse_tables(lines)
    computations: dict[str, Computation] = {}
    current: tuple[str, bool, dict[str, Instruction]] | None = None
    for line in lines:
        if current is None:
            match = _COMPUTATION_HEAD.match(line)
            if match and not line.startswith("HloModule"):
                current = (match.group(2), bool(match.group(1)), {})
        elif line.strip() == "}":
            computations[current[0]] = Computation(current[0], current[2], current[1])
            current = None
        elif line.strip():
            inst = parse_instruction(line)
            if inst is not None:
                current[2][inst.name] = inst
    if not computations:
        raise ValueError(
            "hlo_text holds no HLO computation; expected the text of "
            "jax.jit(f).lower(...).compile().as_text() or fp8jax.verify.compile_for()."
        )
    return Module(name, computations, int(partitions.group(1)) if partitions else 1, *tables)


def parse_instruction(line: str) -> Instruction | None:
    """Parses one ``[ROOT] %name = type opcode(operands), attrs`` line."""
    head = _INSTRUCTION_HEAD.match(line)
    if head is None:
        return None
    types, pos = parse_type(line, head.end())
    opcode = _OPCODE.match(line, pos)
    if opcode is None:
        return None
    close = _closing(line, opcode.end() - 1, "(", ")")
    args_text = line[opcode.end() : close]
    attrs = line[close + 1 :].lstrip(", ")
    return Instruction(
        head.group(2),
        opcode.group(1),
        types,
        tuple(_OPERAND.findall(args_text)),
        attrs,
        bool(head.group(1)),
        args_text,
    )


def parse_type(text: str, pos: int = 0) -> tuple[tuple[TensorType, ...], int]:
    """Parses an HLO type at ``pos``; returns its array leaves and the end position."""
    if text.startswith("(", pos):
        leaves: list[TensorType] = []
        pos = _skip_separators(text, pos + 1)
        while pos < len(text) and text[pos] != ")":
            element, pos = parse_type(text, pos)
            leaves.extend(element)
            pos = _skip_separators(text, pos)
        return tuple(leaves), pos + 1
    match = _ARRAY_TYPE.match(text, pos)
    if match is None:
        raise ValueError(f"expected an HLO type at {text[pos : pos + 40]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in match.group(2).split(",") if d.strip())
    return (TensorType(match.group(1), dims),), match.end()


def _skip_separators(text: str, pos: int) -> int:
    """Skips commas, spaces and the ``/*index=5*/`` comments XLA puts in long tuples."""
    while pos < len(text):
        if text[pos] in ", ":
            pos += 1
        elif text.startswith("/*", pos):
            end = text.find("*/", pos)
            pos = len(text) if end < 0 else end + 2
        else:
            break
    return pos


def _parse_tables(lines: list[str]) -> tuple[dict[int, tuple[int, int]], dict[int, Frame]]:
    """Reads the FileNames/FunctionNames/FileLocations/StackFrames tables."""
    sections: dict[str, list[str]] = {}
    section = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            sections[section] = []
        elif section and re.match(r"\d+ ", line):
            sections[section].append(line)
        else:
            section = None
    files = _string_table(sections.get("FileNames", []))
    functions = _string_table(sections.get("FunctionNames", []))
    locations = {}
    for line in sections.get("FileLocations", []):
        fields = dict(_INT_FIELD.findall(line))
        location_id = int(line.split()[0])
        locations[location_id] = Frame(
            files.get(int(fields.get("file_name_id", 0)), "?"),
            int(fields.get("line", 0)),
            functions.get(int(fields.get("function_name_id", 0)), "?"),
        )
    raw = {}
    for line in sections.get("StackFrames", []):
        fields = dict(_INT_FIELD.findall(line))
        raw[int(line.split()[0])] = (
            int(fields["file_location_id"]),
            int(fields["parent_frame_id"]),
        )
    # XLA (at least up to 0.11) prints parent_frame_id one higher than the id
    # of the parent frame, so a root frame shows its own id. Detect that rather
    # than assume it, in case the printer is fixed.
    shifted = any(parent == frame for frame, (_, parent) in raw.items())
    frames = {
        frame: (loc, parent - 1 if shifted else parent) for frame, (loc, parent) in raw.items()
    }
    return frames, locations


def _string_table(lines: list[str]) -> dict[int, str]:
    table = {}
    for line in lines:
        number, _, rest = line.partition(" ")
        table[int(number)] = _unescape(rest.strip().removeprefix('"').removesuffix('"'))
    return table


def _unescape(text: str) -> str:
    return text.replace('\\"', '"').replace("\\\\", "\\")


def _closing(text: str, start: int, open_char: str, close_char: str) -> int:
    """Index of the bracket closing the one at ``start``, skipping quoted text."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        char = text[i]
        if quoted:
            if char == "\\":
                i += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == open_char:
            depth += 1
        elif char == close_char:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return len(text)
