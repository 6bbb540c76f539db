"""Enough of the protobuf wire format to read and write the ONNX messages of the graph the service makes at load
from an artifact's own (fold.py: the fold graph).

The service installs ONNX Runtime, not the `onnx` package (docs/decisions.md): these functions copy the bytes of
the artifact's graphs and write the few messages around them. `read_fields` walks one message's fields; the others
write one field or one message; `open_made` opens and checks a graph made so.
"""

from collections.abc import Callable, Iterator
from pathlib import Path

import onnxruntime as ort


class WireError(ValueError):
    """A graph file that is not a readable ONNX protobuf message."""


# field numbers (onnx.proto): ModelProto ir_version 1, opset_import 8, graph 7, functions 25; GraphProto node 1, name 2,
# initializer 5, input 11, output 12; NodeProto input 1, output 2, name 3, op_type 4, attribute 5; AttributeProto
# name 1, i 3, g 6, ints 8, type 20 (INT 2, GRAPH 5, INTS 7); ValueInfoProto name 1, type 2; TypeProto tensor_type 1;
# TypeProto.Tensor elem_type 1, shape 2; TensorShapeProto dim 1; Dimension dim_value 1, dim_param 2; TensorProto name 8;
# OperatorSetIdProto domain 1, version 2.

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # (negative int64 values: ten bytes, as protobuf writes them)
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("the step graph's file is truncated")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7


def read_fields(buf: bytes) -> Iterator[tuple[int, int | bytes, bytes]]:
    """(field number, value: an int or the bytes of a length-delimited field, the field's own bytes as written)."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = read_varint(buf, pos)
        elif kind == 2:
            size, pos = read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif kind in (1, 5):
            value, pos = buf[pos:pos + (8 if kind == 1 else 4)], pos + (8 if kind == 1 else 4)
        else:
            raise WireError(f"the step graph has a protobuf field of wire type {kind}")
        if pos > len(buf):
            raise WireError("the step graph's file is truncated")
        yield number, value, buf[start:pos]


def field_int(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, value: bytes | str) -> bytes:
    value = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(value)) + value


def first_field(buf: bytes, number: int, default=None):
    return next((value for n, value, _ in read_fields(buf) if n == number), default)


def value_name(value_info: bytes) -> str:
    return first_field(value_info, 1, b"").decode()


def renamed(value_info: bytes, name: str) -> bytes:
    return field_bytes(1, name) + b"".join(raw for n, _, raw in read_fields(value_info) if n != 1)


def tensor_dims(value_info: bytes) -> tuple[int, list[bytes]]:
    """(element type, the shape's Dimension messages) of a tensor's ValueInfoProto; WireError for another."""
    tensor = first_field(first_field(value_info, 2, b""), 1)
    if tensor is None:
        raise WireError(f"input {value_name(value_info)!r} is not a tensor")
    return first_field(tensor, 1, 0), [d for n, d, _ in read_fields(first_field(tensor, 2, b"")) if n == 1]


def tensor_info(name: str, elem_type: int, dims: list[bytes]) -> bytes:
    shape = b"".join(field_bytes(1, d) for d in dims)
    return field_bytes(1, name) + field_bytes(2, field_bytes(1, field_int(1, elem_type) + field_bytes(2, shape)))


def has_subgraph(node: bytes) -> bool:
    """Whether a NodeProto has an attribute holding a graph (g 6, graphs 11): If, Loop, Scan."""
    return any(n == 5 and any(m in (6, 11) for m, _, _ in read_fields(value)) for n, value, _ in read_fields(node))


def node_io(node: bytes) -> tuple[list[str], list[str], str]:
    """(input names, output names, op type) of a NodeProto."""
    inputs, outputs, op = [], [], ""
    for n, value, _ in read_fields(node):
        if n == 1:
            inputs.append(value.decode())
        elif n == 2:
            outputs.append(value.decode())
        elif n == 4:
            op = value.decode()
    return inputs, outputs, op


def int64_tensor(name: str, values: list[int]) -> bytes:
    """A TensorProto of a 1-D int64 constant (dims 1, data_type 2, name 8, raw_data 9)."""
    raw = b"".join(v.to_bytes(8, "little", signed=True) for v in values)
    return field_int(1, len(values)) + field_int(2, 7) + field_bytes(8, name) + field_bytes(9, raw)


def node_bytes(op: str, inputs: list[str], outputs: list[str], name: str = "", attributes: list[bytes] = ()) -> bytes:
    return (b"".join(field_bytes(1, i) for i in inputs) + b"".join(field_bytes(2, o) for o in outputs)
            + (field_bytes(3, name) if name else b"") + field_bytes(4, op)
            + b"".join(field_bytes(5, a) for a in attributes))


def open_made(make: Callable[[], bytes], check: Callable[[ort.InferenceSession], None], folder: Path,
              options: ort.SessionOptions, unavailable: type[Exception], against: str) -> ort.InferenceSession:
    """The session of a graph made at load (`make()`: its bytes; its weights' files, if any, looked up in `folder`,
    where the artifact's own graphs found theirs), `check`ed against the graphs it was made from (`against`);
    `unavailable(why)` for any fault on the way."""
    try:
        proto = make()
    except unavailable:
        raise
    except Exception as e:  # (the artifact's own sessions opened, so this is unexpected: say so)
        raise unavailable(f"the {against} could not be read ({type(e).__name__}: {e})") from None
    key = "session.model_external_initializers_file_folder_path"
    try:
        already = options.get_session_config_entry(key)
    except Exception:  # (none set)
        already = None
    if already != str(folder):  # (ONNX Runtime warns when an entry is set again)
        options.add_session_config_entry(key, str(folder))
    try:
        session = ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise unavailable(f"ONNX Runtime did not open it ({e})") from None
    try:
        check(session)
    except unavailable:
        raise
    except Exception as e:
        raise unavailable(f"checking it against the {against} failed ({type(e).__name__}: {e})") from None
    return session
