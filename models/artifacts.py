"""What the model families make of an artifact: its config, and loading that refuses a config they refuse."""

from __future__ import annotations

import os

from artifact.errors import ConfigError, ModelFileError
from artifact.format import Artifact
from artifact.read import load_artifact
from models.registry import get_family


def artifact_config(artifact: Artifact):
    """The family's config dataclass built from the manifest; a config the family refuses is a ModelFileError."""
    try:
        return get_family(artifact.family).config_from_dict(dict(artifact.manifest.config))
    except (ConfigError, TypeError) as exc:  # TypeError: the dataclass constructor's own complaints
        raise ModelFileError(f"{artifact.location}: the manifest's config is invalid ({exc}); re-export") from None


def open_artifact(path: str | os.PathLike, *, max_bytes: int | None = None) -> Artifact:
    """load_artifact (format, hashes, graphs) and the family's check of the manifest's config, so a config
    the family refuses is refused at load time, not in a runner."""
    artifact = load_artifact(path, max_bytes=max_bytes)
    artifact_config(artifact)
    return artifact
