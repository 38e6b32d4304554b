"""safetensors checkpoints: the header checked against the file, then the tensors read one by one.

Layout: u64 little-endian N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
then the data; offsets are relative to the data and must tile it without overlaps. Every length,
shape and offset is checked against the file size before a byte of data is read, so no allocation
is sized by an unchecked field. A tensor read as stored (float32, or float16/bfloat16 kept) of at least
MAP_MIN_BYTES is a view of a private mapping of its own file pages (artifact.spans): resident only while read,
and exported by copying its file range. Any other is read with plain file reads into memory it owns (converted
to float32 at once): a mapping would add its touched pages to the process's resident set beside the converted
copy, doubling the peak of importing a multi-GB checkpoint.
"""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path

import torch

from artifact.errors import ModelFileError
from artifact.jsonfile import read_json
from artifact.spans import FileSpan, map_span

# safetensors dtypes read here (bytes per element); others (F8, complex, ...) are refused by name.
SAFETENSORS_DTYPES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own header-size limit
MAX_INDEX_BYTES = 1 << 26  # a shard index lists every tensor name once: megabytes for the largest models


TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(
    directory: Path, stored: dict | None = None, *, keep_dtype: bool = False
) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face directory's safetensors files (sharded or not), floating ones as float32
    (or, with keep_dtype, float16 and bfloat16 ones as stored). `stored`, when given, receives {dtype name:
    elements} of the floating tensors as the files store them."""
    tensors = {}
    for file in safetensors_files(directory):
        header, data_start = _checked_header(file)
        try:
            with open(file, "rb") as handle:
                for name, info in header.items():
                    if name == "__metadata__":
                        continue
                    dtype = TORCH_DTYPES[info["dtype"]]
                    if dtype.is_floating_point:
                        kept = dtype == torch.float32 or (keep_dtype and dtype in (torch.float16, torch.bfloat16))
                        tensor = (
                            _map_tensor(file, data_start, info)
                            if kept and _mappable(data_start, info)
                            else (_read_tensor if kept else _read_float32)(handle, data_start, info)
                        )
                        if stored is not None:
                            kind = str(dtype).removeprefix("torch.")
                            stored[kind] = stored.get(kind, 0) + tensor.numel()
                    else:
                        tensor = _read_tensor(handle, data_start, info)
                    tensors[name] = tensor
        except OSError as exc:
            raise ModelFileError(f"{file}: cannot read ({exc.strerror or exc})") from None
    return tensors


def header_tensors(directory: Path, stored: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files as a meta tensor of its stored dtype and shape, from the
    checked headers alone: what a name mapping checks before a byte of data is read. `stored`, when given,
    receives {dtype name: elements} of the floating tensors, as read_safetensors reports them."""
    tensors = {}
    for file in safetensors_files(directory):
        for name, info in check_safetensors_header(file).items():
            if name == "__metadata__":
                continue
            dtype = TORCH_DTYPES[info["dtype"]]
            tensors[name] = torch.empty(info["shape"], dtype=dtype, device="meta")
            if stored is not None and dtype.is_floating_point:
                kind = str(dtype).removeprefix("torch.")
                stored[kind] = stored.get(kind, 0) + tensors[name].numel()
    return tensors


READ_CHUNK_BYTES = 64 << 20


def _read_float32(handle, data_start: int, info: dict) -> torch.Tensor:
    """A floating tensor as float32. A float16/bfloat16 one is converted a chunk at a time into the float32
    tensor: reading it whole first would hold it at both widths (1.5 GB beside 1 GB for a 128k x 2048 embedding)."""
    dtype = TORCH_DTYPES[info["dtype"]]
    if dtype == torch.float32:
        return _read_tensor(handle, data_start, info)
    begin, end = info["data_offsets"]
    width = SAFETENSORS_DTYPES[info["dtype"]]
    out = torch.empty(info["shape"], dtype=torch.float32)
    flat = out.view(-1)
    step = max(READ_CHUNK_BYTES // width, 1)
    handle.seek(data_start + begin)
    for first in range(0, flat.numel(), step):
        count = min(step, flat.numel() - first)
        buffer = bytearray(count * width)
        if handle.readinto(buffer) != len(buffer):
            raise OSError(f"short read at byte {data_start + begin + first * width}")
        flat[first : first + count] = torch.frombuffer(buffer, dtype=dtype)
    return out


MAP_MIN_BYTES = 1 << 16  # smaller tensors (norms, biases) are read: a mapping per tensor would cost more


def _mappable(data_start: int, info: dict) -> bool:
    begin, end = info["data_offsets"]
    return end - begin >= MAP_MIN_BYTES and (data_start + begin) % SAFETENSORS_DTYPES[info["dtype"]] == 0


def _map_tensor(file: Path, data_start: int, info: dict) -> torch.Tensor:
    """One tensor of a checked header as a view of a private mapping of its bytes in the file (written to in
    place, it keeps its own copy of the pages written, and artifact.spans no longer takes it for the file's)."""
    begin, end = info["data_offsets"]
    mapping, delta, _ = map_span(FileSpan(str(file), data_start + begin, end - begin))
    dtype = TORCH_DTYPES[info["dtype"]]
    count = (end - begin) // SAFETENSORS_DTYPES[info["dtype"]]
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=delta).reshape(info["shape"])


def _read_tensor(handle, data_start: int, info: dict) -> torch.Tensor:
    """One tensor of a checked header, read from the open file into a buffer of its own (little-endian data)."""
    begin, end = info["data_offsets"]
    buffer = bytearray(end - begin)
    handle.seek(data_start + begin)
    if handle.readinto(buffer) != len(buffer):
        raise OSError(f"short read at byte {data_start + begin}")
    dtype = TORCH_DTYPES[info["dtype"]]
    if not buffer:
        return torch.empty(info["shape"], dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(info["shape"])


def safetensors_files(directory: Path) -> list[Path]:
    """The shards model.safetensors.index.json lists (each must exist), else every *.safetensors file."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = read_json(index, what="shard index", max_bytes=MAX_INDEX_BYTES)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ModelFileError(f"{index}: 'weight_map' must map tensor names to shard file names")
        files = sorted({directory / Path(name).name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileError(f"{index}: shard {missing[0]!r} is listed but not in {directory}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory}: no *.safetensors files; only safetensors checkpoints are read")
    for file in files:
        # A FIFO would block the first read forever and a device never end: only plain files are read.
        if not file.is_file():
            raise ModelFileError(f"{file}: not a regular file; a safetensors shard must be a plain file")
    return files


def check_safetensors_header(file: Path) -> dict:
    """Validate a safetensors header against the file before any data is read; returns the header."""
    return _checked_header(file)[0]


def _checked_header(file: Path) -> tuple[dict, int]:
    """(the checked header, the file offset where the data section starts)."""
    raw, data_size = _header_bytes(file)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelFileError(
            f"{file}: unreadable safetensors file (header is not JSON: {type(exc).__name__})"
        ) from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: unreadable safetensors file (header is not a JSON object)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ModelFileError(f"{file}: unreadable safetensors file (__metadata__ must map strings to strings)")
            continue
        spans.append(_tensor_span(file, name, info, data_size))
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in pairwise(spans):
        if begin_b < end_a:
            raise ModelFileError(
                f"{file}: unreadable safetensors file: tensors {a!r:.80} and {b!r:.80} overlap "
                f"(bytes from {begin_b} to {end_a}); the header lies"
            )
        if begin_b > end_a:
            raise ModelFileError(
                f"{file}: unreadable safetensors file: {begin_b - end_a} unclaimed byte(s) between tensors "
                f"{a!r:.80} and {b!r:.80}; the format packs tensors without gaps"
            )
    covered = (spans[0][0], spans[-1][1]) if spans else (0, 0)
    if covered != (0, data_size):
        raise ModelFileError(
            f"{file}: unreadable safetensors file: the tensors cover bytes {covered[0]} to {covered[1]} of a "
            f"{data_size}-byte data section; the format packs them from its start to its end"
        )
    return header, 8 + len(raw)


def _header_bytes(file: Path) -> tuple[bytes, int]:
    """(the header's JSON bytes, the data section's size), reading no more than the checked header length."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ModelFileError(
                    f"{file}: unreadable safetensors file (truncated: {size} bytes, the header length alone takes 8)"
                )
            length = int.from_bytes(prefix, "little")
            if length > SAFETENSORS_MAX_HEADER:
                raise ModelFileError(
                    f"{file}: unreadable safetensors file (header length {length:,} is above the "
                    f"{SAFETENSORS_MAX_HEADER:,}-byte limit)"
                )
            if 8 + length > size:
                raise ModelFileError(
                    f"{file}: unreadable safetensors file (truncated: header length {length:,} "
                    f"runs past the end of the {size:,}-byte file)"
                )
            return handle.read(length), size - 8 - length
    except OSError as exc:
        raise ModelFileError(f"{file}: cannot read ({exc.strerror or exc})") from None


def _tensor_span(file: Path, name: str, info, data_size: int) -> tuple[int, int, str]:
    """(begin, end, name) of one header entry, once its dtype, shape and offsets agree with the data."""
    where = f"{file}: unreadable safetensors file: tensor {name!r:.80}"
    if not isinstance(info, dict):
        raise ModelFileError(f"{where}: header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise ModelFileError(
            f"{where}: dtype {dtype!r:.40} is not supported; supported: {', '.join(SAFETENSORS_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise ModelFileError(f"{where}: shape {shape!r:.60} is not a list of non-negative integers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise ModelFileError(f"{where}: data_offsets {offsets!r:.60} are not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise ModelFileError(
            f"{where}: data_offsets [{begin}, {end}) run past the end of the data "
            f"({data_size:,} bytes); the file is truncated or the header lies"
        )
    needed = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
    if end - begin != needed:
        raise ModelFileError(
            f"{where}: shape {tuple(shape)} of {dtype} needs {needed:,} bytes but data_offsets "
            f"[{begin}, {end}) hold {end - begin:,}"
        )
    return begin, end, name


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
