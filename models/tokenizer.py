"""Text tokenizers from checkpoints, on the `tokenizers` library (no hand-written BPE).

Sources: a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`, and
`generation_config.json` for the end-of-sequence ids generation stops on), or the
vocabulary, merges and special tokens in GGUF metadata. Chat templates come
from the checkpoint, so they render in a sandboxed Jinja environment.
"""

from __future__ import annotations

import json
from pathlib import Path

from artifact.errors import ModelFileError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# GGUF pre-tokenizer names this toolkit can rebuild, and how.
GGUF_PRE_TOKENIZERS = ("gpt2", "smollm", "default")


class TextTokenizer:
    """eos_id is the tokenizer's own end-of-sequence token (what chat templates render); eos_ids are the
    further ids generation ends on (generation_config.json's eos_token_id list, Llama 3 Instruct's
    <|eot_id|>, GGUF's end-of-turn and end-of-message ids)."""

    def __init__(
        self,
        backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        eos_ids: tuple[int, ...] = (),
    ):
        self.backend = backend
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template
        self.eos_ids = tuple(eos_ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos_id first, then eos_ids, each once."""
        return tuple(dict.fromkeys(t for t in (self.eos_id, *self.eos_ids) if t is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ModelFileError("this tokenizer has no chat template; drop --chat or use a chat checkpoint")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token(self.bos_id) if self.bos_id is not None else "",
                eos_token=self.token(self.eos_id) if self.eos_id is not None else "",
            )
        except TemplateError as exc:
            raise ModelFileError(f"the checkpoint's chat template failed to render: {exc}") from None

    def files(self) -> dict[str, bytes]:
        """The artifact's copy: tokenizer.json and our tokenizer_config.json."""
        config = {
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "eos_ids": list(self.eos_ids),
        }
        return {
            TOKENIZER_FILE: self.backend.to_str().encode(),
            CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode(),
        }

    @classmethod
    def from_artifact(cls, directory: Path) -> TextTokenizer:
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
            config = json.loads((directory / CONFIG_FILE).read_text())
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception
            raise ModelFileError(f"{directory}: cannot read the tokenizer ({exc}); re-export with --from") from None
        eos_ids = config.get("eos_ids", [])  # absent from artifacts exported before eos_ids were kept
        if not isinstance(eos_ids, list) or not all(_is_token_id(t) for t in eos_ids):
            raise ModelFileError(
                f"{directory / CONFIG_FILE}: eos_ids {eos_ids!r:.60} is not a list of token ids; re-export with --from"
            )
        return cls(
            backend,
            bos_id=config.get("bos_id"),
            eos_id=config.get("eos_id"),
            add_bos=bool(config.get("add_bos")),
            chat_template=config.get("chat_template"),
            eos_ids=tuple(eos_ids),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> TextTokenizer | None:
        """None when the directory has no tokenizer.json (weights-only checkpoints)."""
        from tokenizers import Tokenizer

        path = directory / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception
            raise ModelFileError(f"{path}: not a readable tokenizer.json ({exc})") from None
        config = {}
        if (directory / CONFIG_FILE).is_file():
            try:
                config = json.loads((directory / CONFIG_FILE).read_text())
            except ValueError as exc:
                raise ModelFileError(f"{directory / CONFIG_FILE}: invalid JSON ({exc})") from None

        def special(name):
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(value) if isinstance(value, str) else None

        bos_id = special("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # no explicit flag: follow tokenizer.json's post-processor (Llama 3 prepends BOS there)
            add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=special("eos_token"),
            add_bos=bool(add_bos),
            chat_template=config.get("chat_template"),
            eos_ids=generation_eos_ids(directory / GENERATION_CONFIG_FILE),
        )

    @classmethod
    def from_gguf(cls, fields: dict) -> TextTokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.*)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelFileError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)")
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise ModelFileError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(GGUF_PRE_TOKENIZERS)}"
            )
        tokens = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":  # digits are split one by one before the byte-level regex
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type", [])
        control = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
        backend.add_special_tokens(control)
        return cls(
            backend,
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=fields.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
            # llama.cpp ends generation on end-of-turn and end-of-message tokens as on EOS.
            eos_ids=tuple(
                t for t in (fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")) if t is not None
            ),
        )


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list, as Llama 3 Instruct lists <|eot_id|>); () without one."""
    if not path.is_file():
        return ()
    try:
        config = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise ModelFileError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(config).__name__}")
    value = config.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_token_id(t) for t in ids):
        raise ModelFileError(f"{path}: eos_token_id {value!r:.60} is not a token id or a list of token ids")
    return tuple(dict.fromkeys(ids))


def load_tokenizer(artifact, shown: str | Path) -> TextTokenizer:
    """The artifact's tokenizer; `shown` names the artifact in the error when there is none."""
    if artifact.directory is None or not (artifact.directory / TOKENIZER_FILE).is_file():
        raise ModelFileError(f"{shown}: no tokenizer in the artifact; export a checkpoint with --from")
    return TextTokenizer.from_artifact(artifact.directory)
