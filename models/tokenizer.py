"""Text tokenizers from checkpoints, on the `tokenizers` library (no hand-written BPE).

Sources: a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`, and
`generation_config.json` for the end-of-sequence ids generation stops on), or the
vocabulary, merges (or SentencePiece scores) and special tokens in GGUF metadata. Chat templates come
from the checkpoint, so they render in a sandboxed Jinja environment.

Text a user typed is text: "</s>" in a prompt or a message encodes as its characters, never as the
control token (`encode`, `encode_chat`); only a chat template's own markup yields control tokens.
The JSON files are read through the bounded reader and typed (pydantic) before use.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Annotated

from pydantic import Field

from artifact.errors import InputError, ModelFileError
from artifact.jsonfile import read_json
from artifact.typed import Strict, TokenId, parse_typed

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# GGUF pre-tokenizer names this toolkit can rebuild, and how.
GGUF_PRE_TOKENIZERS = ("gpt2", "smollm", "default")
GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type); byte (6) and unused (5) pieces need no handling
# of their own: byte pieces are what byte fallback emits, unused ones are never produced.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4
SPM_SPACE = "\u2581"  # SentencePiece's spelling of a space


class ArtifactTokenizerConfig(Strict):
    """The artifact's tokenizer_config.json, as `TextTokenizer.files` writes it."""

    bos_id: TokenId | None = None
    eos_id: TokenId | None = None
    add_bos: bool = False
    chat_template: str | None = None
    eos_ids: list[TokenId] = []  # absent from artifacts exported before eos_ids were kept


class SpecialToken(Strict):
    content: str


class NamedTemplate(Strict):
    name: str
    template: str


class HFTokenizerConfig(Strict):
    """The keys of a Hugging Face tokenizer_config.json this toolkit reads (the others are the tokenizers
    library's, read from tokenizer.json)."""

    bos_token: str | SpecialToken | None = None
    eos_token: str | SpecialToken | None = None
    add_bos_token: bool | None = None
    # One template, or named ones (transformers uses "default" unless told otherwise).
    chat_template: str | Annotated[list[NamedTemplate], Field(min_length=1)] | None = None


class GenerationConfig(Strict):
    eos_token_id: TokenId | list[TokenId] | None = None


# Private-use characters around a nonce mark each message's content while a chat template renders: a user
# cannot type a marker, so what lies between two markers is the content, whatever it looks like.
_OPEN, _CLOSE = "\U000f0000", "\U000f0001"


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
        template_source: str = "the tokenizer",
    ):
        self.backend = backend
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template
        self.eos_ids = tuple(eos_ids)
        self.template_source = template_source
        # The same tokenizer with special tokens matched as plain text (a flag of the tokenizers object, so
        # a copy of its own rather than a flag flipped around calls that may run on several threads).
        self.text_backend = type(backend).from_str(backend.to_str())
        self.text_backend.encode_special_tokens = True
        self.special_ids = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos_id first, then eos_ids, each once."""
        return tuple(dict.fromkeys(t for t in (self.eos_id, *self.eos_ids) if t is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """`text` as a user typed it: a special token's spelling ("</s>", "<|im_end|>") encodes as its
        characters. BOS first when the tokenizer adds one."""
        return self._with_bos(self._text_ids(text))

    def _text_ids(self, text: str) -> list[int]:
        # encode_batch, not encode: the library releases the GIL only in the batch call, so a server thread
        # tokenizing a long prompt leaves the event loop free.
        return self.text_backend.encode_batch([text], add_special_tokens=False)[0].ids if text else []

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as the template renders it, as text. To tokenize a chat use `encode_chat`: encoding this
        text with `encode` would make the template's own control tokens plain text too."""
        return self._render(messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a chat: the template's markup with its special tokens as control tokens, each
        message's content as text (a "</s>" a user typed is its characters). BOS first when the tokenizer adds
        one and the template did not render it.

        The template renders once with the real contents and once with each content between unforgeable
        markers; the two must agree once the markers are removed (a template that trims contents is followed),
        and each marked span must be a message's own content, else the template changes contents in a way that
        cannot be told apart from its markup and the chat is refused. Special tokens are taken from the markup only; everything between two of them (markup
        text and contents together) is encoded in one piece, so ordinary chats get the ids the whole rendered
        string would.
        """
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if content is not None and not isinstance(content, str):
                raise InputError(
                    f"a chat message's content must be a string, got {type(content).__name__}; join content parts first"
                )
        plain = self._render(messages, add_generation_prompt)
        nonce = secrets.token_hex(8)
        opening, closing = f"{_OPEN}{nonce}{_CLOSE}", f"{_CLOSE}{nonce}{_OPEN}"
        for trim in (False, True):
            marked = [
                {**m, "content": f"{opening}{m['content'].strip() if trim else m['content']}{closing}"}
                if isinstance(m, dict) and m.get("content")
                else m
                for m in messages
            ]
            segments = _split_marked(self._render(marked, add_generation_prompt), opening, closing)
            # Each content must come out as a message's own (a template that upper-cases contents renders its
            # markers through unchanged where they hold no letters, and the two renders then agree).
            contents = {c.strip() if trim else c for m in messages if isinstance(m, dict) and (c := m.get("content"))}
            if (
                segments is not None
                and all(text in contents for text, is_content in segments if is_content)
                and "".join(text for text, _ in segments) == plain
            ):
                return self._with_bos(self._segment_ids(segments))
        raise ModelFileError(
            f"{self.template_source}: the chat template changes message contents (beyond trimming them) or drops "
            "their boundaries, so a content cannot be told apart from the template's own special tokens; "
            "use a template that inserts message['content'] as it is"
        )

    def _segment_ids(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Ids of (text, is_content) segments: special tokens found in markup segments, the rest as text."""
        ids, pending = [], []
        for text, is_content in segments:
            if is_content:
                pending.append(text)
                continue
            encoding = self.backend.encode_batch([text], add_special_tokens=False)[0]
            cursor = 0
            for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
                if token in self.special_ids:
                    pending.append(text[cursor:start])
                    ids += self._text_ids("".join(pending)) + [token]
                    pending, cursor = [], end
            pending.append(text[cursor:])
        return ids + self._text_ids("".join(pending))

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not self.chat_template:
            raise ModelFileError(
                f"{self.template_source}: this tokenizer has no chat template; drop --chat or use a chat checkpoint"
            )
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
            raise ModelFileError(f"{self.template_source}: the chat template failed to render: {exc}") from None
        except Exception as exc:  # the template is the checkpoint's code: any failure of it is the file's
            detail = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise ModelFileError(
                f"{self.template_source}: the chat template failed to render: {type(exc).__name__}: {detail}"
            ) from None

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
        config_path = directory / CONFIG_FILE
        advice = "re-export with --from"
        raw = read_json(config_path, what="tokenizer config", advice=advice)
        config = parse_typed(ArtifactTokenizerConfig, raw, config_path, ModelFileError, advice)
        backend = _load_backend(directory / TOKENIZER_FILE, advice)
        _check_ids(
            backend,
            config_path,
            {
                "bos_id": config.bos_id,
                "eos_id": config.eos_id,
                **{f"eos_ids[{i}]": t for i, t in enumerate(config.eos_ids)},
            },
            advice,
        )
        return cls(
            backend,
            bos_id=config.bos_id,
            eos_id=config.eos_id,
            add_bos=config.add_bos,
            chat_template=config.chat_template,
            eos_ids=tuple(config.eos_ids),
            template_source=str(config_path),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> TextTokenizer | None:
        """None when the directory has no tokenizer.json (weights-only checkpoints)."""
        path = directory / TOKENIZER_FILE
        if not path.exists():
            return None
        backend = _load_backend(path, "")
        config_path = directory / CONFIG_FILE
        config = HFTokenizerConfig()
        if config_path.exists():
            config = parse_typed(
                HFTokenizerConfig, read_json(config_path, what="tokenizer config"), config_path, ModelFileError
            )

        def special(value):
            value = value.content if isinstance(value, SpecialToken) else value
            return backend.token_to_id(value) if value is not None else None

        bos_id = special(config.bos_token)
        add_bos = config.add_bos_token
        if add_bos is None:  # no explicit flag: follow tokenizer.json's post-processor (Llama 3 prepends BOS there)
            add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        template = config.chat_template
        if isinstance(template, list):  # named templates: transformers renders "default" unless told otherwise
            named = {t.name: t.template for t in template}
            if "default" not in named:
                raise ModelFileError(
                    f"{config_path}: chat_template lists templates {sorted(named)} but none named 'default'"
                )
            template = named["default"]
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=special(config.eos_token),
            add_bos=add_bos,
            chat_template=template,
            eos_ids=generation_eos_ids(directory / GENERATION_CONFIG_FILE),
            template_source=str(config_path),
        )

    @classmethod
    def from_gguf(cls, fields: dict) -> TextTokenizer:
        """Rebuild a GGUF's tokenizer from its metadata (tokenizer.ggml.*): byte-level BPE ("gpt2") or
        SentencePiece BPE ("llama"), as llama.cpp tokenizes them."""
        from tokenizers import AddedToken

        kind = fields.get("tokenizer.ggml.model")
        if kind not in GGUF_TOKENIZER_MODELS:
            raise ModelFileError(
                f"GGUF tokenizer model {kind!r:.60} is not supported; supported: "
                + ", ".join(f"{k!r} ({what})" for k, what in GGUF_TOKENIZER_MODELS.items())
            )
        tokens = fields["tokenizer.ggml.tokens"]
        backend = _gguf_byte_level(fields, tokens) if kind == "gpt2" else _gguf_sentencepiece(fields, tokens)
        types = fields.get("tokenizer.ggml.token_type", [])
        # Control tokens are special (text a user types never yields them); llama.cpp matches user-defined tokens
        # whole in any text, before the rest is split, so they are added tokens that are not special.
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_CONTROL]
        )
        if kind == "llama":
            backend.add_tokens(
                [
                    AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types)
                    if t == TOKEN_USER_DEFINED
                ]
            )
        template = fields.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFileError(f"GGUF tokenizer.chat_template must be a string, got {type(template).__name__}")
        return cls(
            backend,
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=fields.get("tokenizer.ggml.eos_token_id"),
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=template,
            template_source="the GGUF's tokenizer.chat_template",
            # llama.cpp ends generation on end-of-turn and end-of-message tokens as on EOS.
            eos_ids=tuple(
                t for t in (fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")) if t is not None
            ),
        )


def _gguf_byte_level(fields: dict, tokens: list[str]):
    """A byte-level BPE ("gpt2"): the file's merges by rank, split by the named pre-tokenizer's regex."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ModelFileError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(GGUF_PRE_TOKENIZERS)}"
        )
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits are split one by one before the byte-level regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(fields: dict, tokens: list[str]):
    """A SentencePiece BPE ("llama": Llama 2, Mistral v0.1, Gemma, Phi-3) as llama.cpp's llm_tokenizer_spm runs it.

    llama.cpp merges the adjacent pair whose joined text is the highest-scoring token, and spells a piece that is
    no token as its bytes (<0xXX> tokens). A BPE model whose merges are every way of cutting a token in two,
    ranked by that token's score, makes the same merges; the file's order breaks ties between equal scores.
    Spaces are "▁" and each piece of text between added tokens starts with one where add_space_prefix says so
    (llama.cpp prefixes every text fragment that follows a token it matched whole, or starts the text).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = fields.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelFileError(
            "GGUF tokenizer model 'llama' (SentencePiece) needs tokenizer.ggml.scores; the file has none"
        )
    types = fields.get("tokenizer.ggml.token_type", [])
    types = [*types, *[TOKEN_NORMAL] * (len(tokens) - len(types))]  # a token without a type is normal
    vocab = {token: i for i, token in enumerate(tokens)}
    # Only normal pieces are made from text: control, unknown, byte and unused pieces never are (SentencePiece),
    # and user-defined ones are matched whole before any merging.
    candidates = []
    for i, token in enumerate(tokens):
        if types[i] != TOKEN_NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], i, cut, left, right))
    merges = [(left, right) for *_, left, right in sorted(candidates)]
    unknown = fields.get("tokenizer.ggml.unknown_token_id")
    if unknown is None:
        unknown = next((i for i, t in enumerate(types) if t == TOKEN_UNKNOWN), None)
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unknown] if unknown is not None else None,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the space the prefix added before the first word
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _split_marked(text: str, opening: str, closing: str) -> list[tuple[str, bool]] | None:
    """(text, is_content) segments of a render whose contents lie between `opening` and `closing`; None when
    the markers do not alternate (the template cut or reordered a content)."""
    segments, position = [], 0
    for match in re.finditer(re.escape(opening) + "(.*?)" + re.escape(closing), text, re.S):
        segments.append((text[position : match.start()], False))
        segments.append((match.group(1), True))
        position = match.end()
    segments.append((text[position:], False))
    if any(opening in t or closing in t or _OPEN in t or _CLOSE in t for t, _ in segments):
        return None
    return segments


def _load_backend(path: Path, advice: str):
    """The tokenizers object of a tokenizer.json (the library parses it; a FIFO or a device is refused first)."""
    from tokenizers import Tokenizer

    from artifact.jsonfile import read_regular_file

    data = read_regular_file(path, max_bytes=1 << 30, error=ModelFileError, what="tokenizer.json")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises plain Exception; UnicodeDecodeError too
        tail = f"; {advice}" if advice else ""
        raise ModelFileError(f"{path}: not a readable tokenizer.json ({str(exc)[:200]}){tail}") from None


def _check_ids(backend, where, ids: dict, advice: str) -> None:
    size = backend.get_vocab_size(with_added_tokens=True)
    for name, token in ids.items():
        if token is not None and token >= size:
            raise ModelFileError(f"{where}: {name} {token} is not a token of the {size}-token vocabulary; {advice}")


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (one id or a list, as Llama 3 Instruct lists <|eot_id|>); () without one."""
    if not path.exists():
        return ()
    raw = read_json(path, what="generation config")
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        value = parse_typed(GenerationConfig, raw, path, ModelFileError).eos_token_id
    except ModelFileError:
        raise ModelFileError(
            f"{path}: eos_token_id {raw.get('eos_token_id')!r:.60} is not a token id or a list of token ids"
        ) from None
    ids = [] if value is None else value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(ids))


def load_tokenizer(artifact, shown: str | Path) -> TextTokenizer:
    """The artifact's tokenizer; `shown` names the artifact in the error when there is none."""
    if artifact.directory is None or not (artifact.directory / TOKENIZER_FILE).is_file():
        raise ModelFileError(f"{shown}: no tokenizer in the artifact; export a checkpoint with --from")
    return TextTokenizer.from_artifact(artifact.directory)
