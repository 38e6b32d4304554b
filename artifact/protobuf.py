"""Protobuf mechanics of ONNX models: fast serialisation, weightless copies, text-field and tensor walks."""

from __future__ import annotations

import onnx

WEIGHTLESS_BYTES = 1 << 16  # initializers above this size are checked by type and shape only


def is_repeated(field) -> bool:
    """Whether a protobuf field is repeated (protobuf 7 dropped FieldDescriptor.label; older releases lack
    is_repeated)."""
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


RAW_DATA_FIELD = onnx.TensorProto.DESCRIPTOR.fields_by_name["raw_data"].number


def serialize_model(model: onnx.ModelProto, raw: dict | None = None) -> bytearray:
    """The bytes of model.SerializeToString(), assembled from parts into one buffer.

    raw: {initializer name: its bytes (a buffer)} for initializers that declare no raw_data of their own; each is
    written as that initializer's raw_data, straight from the buffer (taken from `raw` as it is written, so a
    graph's weights are never copied into the message and out again), as if the message held it.

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
    out = bytearray(head.SerializeToString())
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
            # One initializer at a time (a few MB), appended to the one buffer (grown in place).
            out += init_tag + _varint(size)
            out += tensor.SerializeToString()
            if tensor.name in outside:  # raw_data's field number follows every field such a tensor declares
                data = memoryview(raw.pop(tensor.name)).cast("B")  # bytes, whatever the buffer's item type
                out += _varint(RAW_DATA_FIELD << 3 | 2) + _varint(len(data))
                out += data
                del data
        out += graph_tail_bytes
    out += tail.SerializeToString()
    return out


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
    size = memoryview(data).nbytes
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
