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
from models.checkpoints.gguf_import import GGUF_ARCHITECTURES, GGUF_TENSOR_TYPES, import_gguf
from models.checkpoints.gguf_reader import (
    GGUF_MAX_DIMS,
    GGUF_PLAIN_TYPES,
    GGUF_VERSIONS,
    GGUFHeader,
    GGUFHeaderReader,
    GGUFTensor,
    check_gguf_header,
)
from models.checkpoints.huggingface import HF_ARCHITECTURES, import_huggingface
from models.checkpoints.loading import IGNORED_TENSORS, ImportedCheckpoint
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
    "check_gguf_header",
    "check_safetensors_header",
    "import_checkpoint",
    "import_gguf",
    "import_huggingface",
]


def import_checkpoint(path: str | Path) -> ImportedCheckpoint:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such checkpoint; give a Hugging Face directory or a .gguf file")
    if path.is_dir():
        return import_huggingface(path)
    if path.suffix.lower() == ".gguf":
        return import_gguf(path)
    raise ModelFileError(
        f"{path}: not a checkpoint; expected a Hugging Face directory (config.json + *.safetensors) or a .gguf file"
    )
