"""Import real checkpoints: Hugging Face directories (safetensors) and GGUF files.

Only local paths; no code from the checkpoint runs (safetensors and GGUF are
plain data; chat templates render in a sandbox). Every import is validated
against the config: the first missing, unexpected or mis-shaped tensor is named.

Files are hostile until checked: the safetensors header and the GGUF header are
walked against the file size (lengths, counts, shapes x dtypes vs byte spans,
offsets, overlaps) before the `safetensors` library parses the one or any GGUF
tensor is mapped, so no allocation or loop is sized by an unchecked header
field; library exceptions become ModelFileError naming the file. The GGUF walk
also reads the metadata (values as gguf.GGUFReader gives them) and the `gguf`
library dequantizes the tensors.

    huggingface.py        config.json -> LlamaConfig / GPTConfig, Hugging Face names -> ours
    safetensors_reader.py the safetensors header check, shard discovery and reading
    gguf_reader.py        the GGUF header walk (GGUFHeaderReader, one method per section)
    gguf_import.py        GGUF metadata -> LlamaConfig, dequantization, llama.cpp names, the GGUF tokenizer
    loading.py            ImportedCheckpoint and what both formats share: taking tensors, loading the model
"""

from __future__ import annotations

from pathlib import Path

from artifact.errors import ModelFileError
from models.checkpoints.gguf_import import GGUF_ARCHITECTURES, GGUF_TENSOR_TYPES, import_gguf, open_gguf
from models.checkpoints.gguf_reader import (
    GGUF_MAX_DIMS,
    GGUF_PLAIN_TYPES,
    GGUF_VERSIONS,
    GGUFHeader,
    GGUFHeaderReader,
    GGUFTensor,
    check_gguf_header,
)
from models.checkpoints.huggingface import HF_ARCHITECTURES, import_huggingface, open_huggingface
from models.checkpoints.loading import IGNORED_TENSORS, ImportedCheckpoint, OpenedCheckpoint
from models.checkpoints.safetensors_reader import SAFETENSORS_DTYPES, SAFETENSORS_MAX_HEADER, check_safetensors_header

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_MAX_DIMS",
    "GGUF_PLAIN_TYPES",
    "GGUF_TENSOR_TYPES",
    "GGUF_VERSIONS",
    "HF_ARCHITECTURES",
    "IGNORED_TENSORS",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_MAX_HEADER",
    "GGUFHeader",
    "GGUFHeaderReader",
    "GGUFTensor",
    "ImportedCheckpoint",
    "OpenedCheckpoint",
    "check_gguf_header",
    "check_safetensors_header",
    "import_checkpoint",
    "import_gguf",
    "import_huggingface",
    "open_checkpoint",
    "open_gguf",
    "open_huggingface",
]


def import_checkpoint(path: str | Path, *, keep_dtype: bool = False) -> ImportedCheckpoint:
    """The checkpoint's model, config, tokenizer and provenance. keep_dtype: float16/bfloat16 weights of a
    safetensors checkpoint stay in that dtype (the model is then for export_model(release_weights=True), which
    converts one tensor at a time) instead of becoming float32 at once."""
    return open_checkpoint(path, keep_dtype=keep_dtype).load()


def open_checkpoint(path: str | Path, *, keep_dtype: bool = False) -> OpenedCheckpoint:
    """import_checkpoint without reading the weights yet: everything but the tensors' values is read and checked
    now, and read_model() reads those (export_model takes it in place of a model, and traces first)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such checkpoint; give a Hugging Face directory or a .gguf file")
    if path.is_dir():
        return open_huggingface(path, keep_dtype=keep_dtype)
    if path.suffix.lower() == ".gguf":
        return open_gguf(path)
    raise ModelFileError(
        f"{path}: not a checkpoint; expected a Hugging Face directory (config.json + *.safetensors) or a .gguf file"
    )


def checkpoint_weights(path: str | Path) -> tuple[int, str]:
    """(parameters, the dtype most of them are stored in) of a checkpoint's floating tensors, from its headers
    alone: what an export will hold, known before a weight is read. (0, "float32") when the path is not a
    readable checkpoint; the import then says why. A GGUF import dequantizes to float32."""
    import math

    path = Path(path)
    counts: dict[str, int] = {}
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    try:
        if path.is_dir():
            from models.checkpoints.safetensors_reader import check_safetensors_header, safetensors_files

            for file in safetensors_files(path):
                for name, info in check_safetensors_header(file).items():
                    if name != "__metadata__" and info["dtype"] in names:
                        kind = names[info["dtype"]]
                        counts[kind] = counts.get(kind, 0) + math.prod(info["shape"])
        elif path.suffix.lower() == ".gguf" and path.is_file():
            from models.checkpoints.gguf_reader import check_gguf_header

            counts["float32"] = sum(math.prod(t.shape) for t in check_gguf_header(path).tensors.values())
    except ModelFileError:
        return 0, "float32"
    if not counts:
        return 0, "float32"
    return sum(counts.values()), max(counts, key=counts.get)
