"""One exception hierarchy for every user-facing failure.

Every error carries a single line: what went wrong, where, expected versus
actual, and what to do. The CLI turns these into a one-line message and a
non-zero exit status; anything that is not a ToolkitError is a bug.
"""


class ToolkitError(Exception):
    """Base class for errors caused by user input, files or the environment."""


class ConfigError(ToolkitError, ValueError):
    """A model configuration (dataclass, JSON file or preset name) is invalid."""


class ModelFileError(ToolkitError):
    """An artifact directory, manifest or ONNX file is missing, corrupt or inconsistent."""


class ExportError(ToolkitError):
    """The export could not produce a valid ONNX artifact."""


class BackendUnavailableError(ToolkitError):
    """A backend or execution provider was asked for but cannot run here."""


class InputError(ToolkitError, ValueError):
    """A feed does not match what the model declares (name, dtype, rank, shape, range)."""


class ComparisonError(ToolkitError):
    """A comparison could not be made at all (nothing in common to compare)."""


class CorruptModelError(ModelFileError):
    """An ONNX file that does not parse, or parses into something the ONNX checker rejects."""


class HashMismatchError(ModelFileError):
    """A file whose sha256 differs from the one its manifest records."""


class ExternalDataError(ModelFileError):
    """An external-data reference that is absolute, climbs out of the model directory or is missing."""


class UnsupportedOpsetError(ModelFileError):
    """An IR version, operator-set domain or domain version this toolkit does not know."""


class ModelTooLargeError(ModelFileError):
    """A model (graph file plus its external data) above the configured size limit."""
