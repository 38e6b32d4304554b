"""Protobuf mechanics of ONNX models: fast serialisation, weightless copies, text-field and tensor walks."""

from __future__ import annotations

import onnx

from artifact.spans import FileSpan, buffers

WEIGHTLESS_BYTES = 1 << 16  # initializers above this size are checked by type and shape only


def is_repeated(field) -> bool:
    """Whether a protobuf field is repeated (protobuf 7 dropped FieldDescriptor.label; older releases lack
    is_repeated)."""
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


RAW_DATA_FIELD = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number


def serialize_model(model: onnx.ModelProto, raw: dict | None = None) -> bytearray:
    """The bytes of model.SerializeToString(), assembled from serialize_chunks' parts into one buffer."""
    out, chunks = bytearray(), serialize_chunks(model, raw)
    chunks.reverse()
    while chunks:  # each weight let go once in the buffer
        for data in buffers(chunks.pop()):
            out += data
    return out


def serialize_chunks(model: onnx.ModelProto, raw: dict | None = None) -> list:
    """The bytes of model.SerializeToString() as a list of chunks, in order: bytes of the message around its
    initializers' raw data, and each raw_data taken from `raw` as it is (a buffer, or an artifact.spans.FileSpan
    read from its file when written).

    raw: {initializer name: its bytes} for initializers that declare no raw_data of their own; each is written as
    that initializer's raw_data, straight from the buffer (taken from `raw` as it is placed, so a graph's
    weights are never copied into the message and out again), as if the message held it.

    protobuf (upb) serialises a model holding hundreds of MB of initializers in seconds, several
    times slower than the same bytes serialised one initializer at a time. Fields go out in
    field-number order, as protobuf writes them, so the bytes are the same (unknown fields of the
    model and graph messages themselves, which no export of ours carries, would be left out).
    """
    graph_field = model.DESCRIPTOR.fields_by_name["graph"]
    init_field = model.graph.DESCRIPTOR.fields_by_name["initializer"]
    head, tail = onnx.ModelProto(), onnx.ModelProto()
    for field, value in model.ListFields():
        if field is not graph_field:
            _copy_field(head if field.number < graph_field.number else tail, field, value)
    graph_head, graph_tail = onnx.GraphProto(), onnx.GraphProto()
    for field, value in model.graph.ListFields():
        if field is not init_field:
            _copy_field(graph_head if field.number < init_field.number else graph_tail, field, value)
    chunks, out = [], bytearray(head.SerializeToString())
    if model.HasField("graph"):
        # The graph's length prefix comes first: sum the initializers' sizes without serialising them.
        outside = _raw_outside(model.graph.initializer, raw or {})
        sizes = [
            tensor.ByteSize() + _raw_field_size(outside[tensor.name]) if tensor.name in outside else tensor.ByteSize()
            for tensor in model.graph.initializer
        ]
        init_tag = _varint(init_field.number << 3 | 2)  # wire type 2: length-delimited
        graph_head_bytes, graph_tail_bytes = graph_head.SerializeToString(), graph_tail.SerializeToString()
        graph_size = (
            len(graph_head_bytes)
            + len(graph_tail_bytes)
            + sum(len(init_tag) + len(_varint(size)) + size for size in sizes)
        )
        out += _varint(graph_field.number << 3 | 2) + _varint(graph_size) + graph_head_bytes
        for tensor, size in zip(model.graph.initializer, sizes, strict=False):
            # One initializer at a time (a few MB): the message's own bytes gathered, each weight a chunk apart.
            out += init_tag + _varint(size)
            out += tensor.SerializeToString()
            if tensor.name in outside:  # raw_data's field number follows every field such a tensor declares
                # Dropped from both maps as it is placed, so each weight is let go once written.
                del outside[tensor.name]
                data = raw.pop(tensor.name)
                if not isinstance(data, FileSpan):
                    data = memoryview(data).cast("B")  # bytes, whatever the buffer's item type
                out += _varint(RAW_DATA_FIELD << 3 | 2) + _varint(len(data))
                chunks += [out, data]
                out = bytearray()
                del data
        out += graph_tail_bytes
    out += tail.SerializeToString()
    chunks.append(out)
    return chunks


def _raw_outside(initializers, raw: dict) -> dict:
    """{name: bytes} of the initializers whose raw_data comes from `raw`: those without raw_data of their own
    and with no field numbered after raw_data's (which protobuf would write after it)."""
    outside = {}
    for tensor in initializers:
        if tensor.name in raw and not tensor.raw_data:
            if max(field.number for field, _ in tensor.ListFields()) > RAW_DATA_FIELD:
                raise ValueError(f"initializer {tensor.name!r} has fields after raw_data; cannot write it from outside")
            outside[tensor.name] = raw[tensor.name]
    return outside


def _raw_field_size(data) -> int:
    size = len(data) if isinstance(data, FileSpan) else memoryview(data).nbytes
    return len(_varint(RAW_DATA_FIELD << 3 | 2)) + len(_varint(size)) + size


def _copy_field(target, field, value) -> None:
    if is_repeated(field):
        getattr(target, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def weightless(
    model: onnx.ModelProto, threshold: int | None = None, raw_sizes: list[int] | None = None
) -> onnx.ModelProto:
    """A copy of `model` whose initializers over `threshold` bytes, or in external data, are graph inputs of the
    same type and shape.

    The ONNX checker and shape inference serialise the model they are given, which for a real
    checkpoint is hundreds of MB each time; neither reads weight values, only small shape constants,
    which stay initializers. (read.check_initializer_sizes covers what the checker would see of the data.)
    raw_sizes: len(raw_data) of each initializer, in order, when known (reading it from a parsed
    model copies the bytes).
    """
    threshold = WEIGHTLESS_BYTES if threshold is None else threshold
    skeleton = onnx.ModelProto()
    for name in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(skeleton, name, getattr(model, name))
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    skeleton.metadata_props.extend(model.metadata_props)
    graph = skeleton.graph
    graph.name = model.graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(model.graph, field))
    if raw_sizes is None:
        raw_sizes = [len(tensor.raw_data) for tensor in model.graph.initializer]
    for tensor, raw_size in zip(model.graph.initializer, raw_sizes, strict=True):
        # An external tensor's bytes are in a file the checker would open: its declaration is all it needs.
        if raw_size > threshold or tensor.data_location == onnx.TensorProto.EXTERNAL:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
        else:
            graph.initializer.append(tensor)
    return skeleton


class NotText(ValueError):
    pass


def decode_strings(message) -> None:
    """Touch every string field once: protobuf decodes UTF-8 lazily (and may hand proto2 strings back
    as bytes), so an invalid one would otherwise surface wherever a name is first read (a runner, a
    report). Bytes fields (raw tensor data) and numeric arrays are not walked."""
    for field, value in _set_fields(message):
        repeated = is_repeated(field)
        if field.type == field.TYPE_MESSAGE:
            for item in value if repeated else (value,):
                decode_strings(item)
        elif field.type == field.TYPE_STRING:
            if not all(isinstance(v, str) for v in (value if repeated else (value,))):
                raise NotText(field.full_name)


_TENSOR_TEXT_FIELDS = [f for f in onnx.TensorProto.DESCRIPTOR.fields if f.type in (f.TYPE_STRING, f.TYPE_MESSAGE)]


def _set_fields(message):
    """message.ListFields(), except that a tensor's numeric and bytes fields are left out unread:
    ListFields() would copy every initializer's bytes out of a parsed model (hundreds of MB).
    A tensor's unset text fields read as their defaults ("" and empty messages), which pass."""
    if not isinstance(message, onnx.TensorProto):
        return message.ListFields()
    return [(field, getattr(message, field.name)) for field in _TENSOR_TEXT_FIELDS]


def all_tensors(model):
    """Every TensorProto of the model: initializers, sparse initializers and attributes, in the main
    graph, its subgraphs and the model-local functions."""

    def from_graph(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from from_nodes(graph.node)

    def from_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                for sparse in attr.sparse_tensors:
                    yield sparse.values
                    yield sparse.indices
                if attr.HasField("g"):
                    yield from from_graph(attr.g)
                for sub in attr.graphs:
                    yield from from_graph(sub)

    yield from from_graph(model.graph)
    for function in model.functions:
        yield from from_nodes(function.node)


def is_external(tensor) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


# ----------------------------------------------------------------------------------------------------- streaming

GRAPH_FIELD = onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number
INITIALIZER_FIELD = onnx.GraphProto.DESCRIPTOR.fields_by_name["initializer"].number
SKIP_CHUNK = 8 << 20  # the bytes of a skipped field are read (and hashed) this many at a time


class Malformed(ValueError):
    """The file's protobuf framing is broken (a truncated field, a length past its message, an unknown wire type)."""


class _Reader:
    """Reads a file front to back, every byte through `digest` (skipped ones too), so the bytes checked are the
    bytes hashed; `report(done, size)` is called as whole chunks go by."""

    def __init__(self, handle, size: int, digest, report=None):
        self.handle, self.size, self.digest, self.report = handle, size, digest, report
        self.pos = 0

    def read(self, n: int) -> bytes:
        if n > self.size - self.pos:
            raise Malformed(f"a field of {n} bytes at offset {self.pos} runs past the end of the file ({self.size})")
        data = self.handle.read(n)
        if len(data) != n:
            raise Malformed(f"the file ended at offset {self.pos + len(data)}, before its stated {self.size} bytes")
        self.digest.update(data)
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        end = self.pos + n
        if end > self.size:
            raise Malformed(f"a field of {n} bytes at offset {self.pos} runs past the end of the file ({self.size})")
        while self.pos < end:
            self.read(min(SKIP_CHUNK, end - self.pos))
            if self.report is not None:
                self.report(self.pos, self.size)

    def varint(self) -> tuple[int, bytes]:
        raw = bytearray()
        while True:
            byte = self.read(1)[0]
            raw.append(byte)
            if byte < 0x80:
                break
            if len(raw) == 10:
                raise Malformed(f"a varint at offset {self.pos - 10} is longer than 10 bytes")
        value = 0
        for shift, byte in enumerate(raw):
            value |= (byte & 0x7F) << (7 * shift)
        return value, bytes(raw)

    def field(self, end: int) -> tuple[int, int, bytes]:
        """(field number, wire type, the tag's bytes) of the next field of a message that ends at `end`."""
        tag, raw = self.varint()
        if self.pos > end:
            raise Malformed(f"a field tag at offset {self.pos - len(raw)} runs past its message")
        return tag >> 3, tag & 7, raw

    def value(self, wire_type: int, end: int, number: int = 0) -> bytes:
        """The bytes of a field's value after its tag (a length-delimited one with its length prefix; a group's up to
        and including its end tag, which protobuf accepts as an unknown field)."""
        if wire_type == 3:
            data = bytearray()
            while True:
                inner, inner_type, tag = self.field(end)
                data += tag
                if inner_type == 4:
                    if inner != number:
                        raise Malformed(f"a group {number} ends with the end tag of group {inner}")
                    break
                data += self.value(inner_type, end, inner)
            return bytes(data)
        if wire_type == 0:
            data = self.varint()[1]
        elif wire_type == 1:
            data = self.read(8)
        elif wire_type == 5:
            data = self.read(4)
        elif wire_type == 2:
            length, prefix = self.length(end)
            data = prefix + self.read(length)
        else:
            raise Malformed(f"wire type {wire_type} at offset {self.pos}")
        if self.pos > end:
            raise Malformed(f"a field ending at offset {self.pos} runs past its message (ends at {end})")
        return data

    def length(self, end: int) -> tuple[int, bytes]:
        length, prefix = self.varint()
        if self.pos + length > end:
            raise Malformed(f"a field of {length} bytes at offset {self.pos} runs past its message (ends at {end})")
        return length, prefix


def read_skeleton(handle, size: int, digest, threshold: int | None = None, report=None) -> tuple[bytes, dict[int, int]]:
    """(the model's bytes with the raw_data of every graph initializer of more than `threshold` bytes left out,
    {initializer index: the raw_data length left out}) of the serialised ModelProto in `handle` (`size` bytes),
    read once front to back with every byte through `digest`.

    Parsing a model with its weights inside holds the file's bytes and the parsed message at once, two copies of
    the weights; the checks that read a graph (the checker, shape inference, the manifest's) need none of them.
    Only the framing is read here: the skeleton's bytes still go through protobuf's own parser. Malformed when the
    framing is broken."""
    threshold = WEIGHTLESS_BYTES if threshold is None else threshold
    reader, out, left_out = _Reader(handle, size, digest, report), bytearray(), {}
    index = 0  # of the next initializer: a file may split its graph into several fields, which protobuf merges
    while reader.pos < size:
        number, wire_type, tag = reader.field(size)
        if number != GRAPH_FIELD or wire_type != 2:
            out += tag + reader.value(wire_type, size, number)
            continue
        length, _ = reader.length(size)
        graph, index = _graph_skeleton(reader, reader.pos + length, threshold, left_out, index)
        out += tag + _varint(len(graph)) + graph
    return bytes(out), left_out


def _graph_skeleton(
    reader: _Reader, end: int, threshold: int, left_out: dict[int, int], index: int
) -> tuple[bytearray, int]:
    out = bytearray()
    while reader.pos < end:
        number, wire_type, tag = reader.field(end)
        if number != INITIALIZER_FIELD or wire_type != 2:
            out += tag + reader.value(wire_type, end, number)
            continue
        length, prefix = reader.length(end)
        if length <= threshold:  # no raw_data in it can be over the threshold
            out += tag + prefix + reader.read(length)
        else:
            tensor, raw = _tensor_skeleton(reader, reader.pos + length, threshold)
            out += tag + _varint(len(tensor)) + tensor
            if raw is not None:
                left_out[index] = raw
        index += 1
    return out, index


def _tensor_skeleton(reader: _Reader, end: int, threshold: int) -> tuple[bytearray, int | None]:
    """(a TensorProto's bytes less a raw_data of more than `threshold` bytes, that raw_data's length or None)."""
    out, raw = bytearray(), None
    while reader.pos < end:
        number, wire_type, tag = reader.field(end)
        if number != RAW_DATA_FIELD or wire_type != 2:
            out += tag + reader.value(wire_type, end, number)
            continue
        length, prefix = reader.length(end)
        # protobuf keeps the last of a singular field that occurs twice, and so does this
        if length > threshold:
            reader.skip(length)
            raw = length
        else:
            out += tag + prefix + reader.read(length)
            raw = None
    return out, raw
