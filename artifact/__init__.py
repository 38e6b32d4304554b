"""The foundation: the error hierarchy and the artifact format (types, reading and validating, atomic writing,
protobuf serialisation, hashing).

It imports nothing from models/, runners/, exporters/ or toolkit/; they all import it.
The names below are its public API.
"""

from artifact.errors import (
    BackendUnavailableError,
    ComparisonError,
    ConfigError,
    CorruptModelError,
    ExportError,
    ExternalDataError,
    HashMismatchError,
    InputError,
    ModelFileError,
    ModelTooLargeError,
    ToolkitError,
    UnsupportedOpsetError,
)
from artifact.format import (
    CUSTOM_DOMAIN,
    CUSTOM_DOMAIN_VERSION,
    DEFAULT_DTYPE,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    METADATA_KEY,
    MODEL_FILE,
    SHARED_KV_CACHE,
    SPEC_DTYPES,
    Artifact,
    GraphArtifact,
    GraphEntry,
    Manifest,
    TensorSpec,
    WeightPlace,
    parse_manifest,
    tensor_specs,
)
from artifact.hashing import array_digest, sha256_bytes, sha256_file
from artifact.protobuf import WEIGHTLESS_BYTES, serialize_model, weightless
from artifact.read import (
    ALLOWED_OPSETS,
    DEFAULT_MAX_MODEL_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MODEL_BYTES_ENV,
    load_artifact,
    load_onnx,
    max_model_bytes,
    validate_onnx,
    write_and_load,
)
from artifact.write import (
    check_output_dir,
    is_artifact_dir,
    save_npz_atomically,
    swap_in,
    write_artifact,
    write_text_atomically,
)
