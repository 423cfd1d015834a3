"""Tokenizer: text <-> token ids and chat rendering, from the files a checkpoint directory ships.

Two formats, never a download: Kimi's `tiktoken.model` (+ `tokenizer_config.json`) or a Hugging
Face `tokenizer.json`. Contract: `encode` treats special-token text as plain text (safe for
untrusted prompts); only the chat template's own markers become special ids. `decode` accepts any
id in [0, vocab_size). Pickling keeps only the directory path, so the receiver must see the files.
`write_tiny_tokenizer` writes a Kimi-style tokenizer for test checkpoints.
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import re
import uuid
from pathlib import Path

import jinja2
import jinja2.sandbox

# Kimi's pre-tokenization regex (tiktoken/fancy-regex syntax; `&&` is class intersection).
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # cased letters, Han excluded
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "*" + _LOWER + "+" + _SUFFIX,
        r"[^\r\n\p{L}\p{N}]?" + _UPPER + "+" + _LOWER + "*" + _SUFFIX,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
_TIKTOKEN_FILE = "tiktoken.model"
_HF_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
# Special tokens that end a turn or a document; each present one is a stop token besides eos.
_END_OF_TURN_NAMES = ("<|im_end|>", "[EOS]")


class Tokenizer:
    """Encode/decode and chat rendering over a tiktoken or `tokenizers` backend.

    Thread-safe for concurrent encode/decode (both backends are). Build with `from_dir`.
    """

    def __init__(self, path: Path, backend, specials: dict[str, int], config: dict):
        """Use `from_dir`. `backend` is a tiktoken.Encoding or a tokenizers.Tokenizer."""
        self._path = path
        self._backend = backend
        self._is_tiktoken = hasattr(backend, "n_vocab")  # tokenizers.Tokenizer has no n_vocab
        self.special_tokens = dict(specials)  # content -> id
        self._special_ids = frozenset(specials.values())
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first))) if specials else None
        self.vocab_size: int = (
            backend.n_vocab if self._is_tiktoken else backend.get_vocab_size(with_added_tokens=True)
        )
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            self._config_token_id(config, key) for key in ("bos_token", "eos_token", "pad_token")
        )
        stop = [self.eos_token_id] + [specials.get(name) for name in _END_OF_TURN_NAMES]
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            stop += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.stop_token_ids = tuple(dict.fromkeys(i for i in stop if i is not None))
        self.chat_template: str | None = _chat_template(path, config)
        self._template_names = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """Load `tiktoken.model` if present, else `tokenizer.json`, plus the config beside it."""
        path = Path(path)
        config_path = path / _CONFIG_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if (path / _TIKTOKEN_FILE).is_file():
            backend, specials = _load_tiktoken(path, config)
        elif (path / _HF_FILE).is_file():
            import tokenizers

            backend = tokenizers.Tokenizer.from_file(str(path / _HF_FILE))
            backend.encode_special_tokens = True  # special-token text in input stays plain text
            specials = {
                t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special
            }
        else:
            raise ValueError(f"no tokenizer in {path}: looked for {_TIKTOKEN_FILE} and {_HF_FILE}")
        return cls(path, backend, specials, config)

    def __reduce__(self):
        return (Tokenizer.from_dir, (str(self._path.absolute()),))

    def _config_token_id(self, config: dict, key: str) -> int | None:
        token = _token_text(config.get(key))
        if token is None:
            return None
        token_id = self.special_tokens.get(token)
        if token_id is None and not self._is_tiktoken:
            token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{key} {token!r} in {self._path / _CONFIG_FILE} is not in the vocab")
        return token_id

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Plain-text ids for `text`; special-token text is never mapped to a special id."""
        if self._is_tiktoken:
            ids = self._backend.encode_ordinary(text)
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError(f"add_bos=True but the tokenizer in {self._path} has no bos_token")
            ids = [self.bos_token_id, *ids]
        return ids

    def _encode_with_specials(self, text: str) -> list[int]:
        """Ids for template text: special-token strings become their ids, the rest plain text."""
        if self._special_re is None:
            return self.encode(text)
        ids, start = [], 0
        for match in self._special_re.finditer(text):
            ids += self.encode(text[start : match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        return ids + self.encode(text[start:])

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD. Raises ValueError for ids out of range."""
        ids = [int(i) for i in ids]
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:
            raise ValueError(f"token ids {bad[:8]} are outside [0, {self.vocab_size})")
        if not self._is_tiktoken:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._backend.decode_bytes(ids).decode("utf-8", errors="replace")

    @functools.cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {self._path} has no chat_template")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(self.chat_template)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._template_names
        )

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt=True) -> list[int]:
        """Render the chat template and encode it.

        Template markers become special ids; message contents are encoded as plain text, so a
        user typing "<|im_end|>" cannot end a turn. This works by rendering with each content
        replaced by a unique placeholder. If the template alters contents (so the placeholder
        render does not reproduce the real one), specials are matched over the whole real render,
        which is only allowed when no content contains special-token text.
        """
        _check_messages(messages)
        real = self._render(messages, add_generation_prompt)
        nonce = uuid.uuid4().hex
        marks = {f"\x00{nonce}:{i}\x00": m["content"] for i, m in enumerate(messages)}
        marked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
        rendered = self._render(marked, add_generation_prompt)
        parts = re.split(f"(\x00{nonce}:\\d+\x00)", rendered)  # odd indices are placeholders
        if "".join(marks.get(p, p) for p in parts) == real:
            ids = []
            for idx, part in enumerate(parts):
                ids += self.encode(marks[part]) if idx % 2 else self._encode_with_specials(part)
            return ids
        if self._special_re is not None and any(self._special_re.search(c) for c in marks.values()):
            raise ValueError(
                f"the chat template in {self._path} rewrites message contents and a message "
                "contains special-token text; refusing to encode it as template markup"
            )
        return self._encode_with_specials(real)


def _load_tiktoken(path: Path, config: dict):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(path / _TIKTOKEN_FILE))
    num_base = len(ranks)
    if sorted(ranks.values()) != list(range(num_base)):
        raise ValueError(f"ranks in {path / _TIKTOKEN_FILE} are not exactly 0..{num_base - 1}")
    named = {int(i): _token_text(t) for i, t in config.get("added_tokens_decoder", {}).items()}
    if low := [i for i in named if i < num_base]:
        raise ValueError(
            f"added_tokens_decoder in {path / _CONFIG_FILE} has ids {low[:8]} below the "
            f"{num_base} regular tokens of {path / _TIKTOKEN_FILE}"
        )
    # Unnamed ids up to the largest named one are reserved, as in Kimi's tokenizer.
    top = max(named, default=num_base - 1) + 1
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, top)}
    if len(specials) != top - num_base:
        raise ValueError(f"duplicate special-token contents in {path / _CONFIG_FILE}")
    name = f"k3batch:{path.name}"
    return tiktoken.Encoding(
        name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials
    ), specials


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(path: Path, config: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():  # newer HF layout keeps it in its own file
        return (path / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template


def _raise_exception(message: str):
    raise ValueError(f"chat template: {message}")


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for idx, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{idx}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"messages[{idx}][{key!r}] must be a string, got {message.get(key)!r:.80}"
                )


# ---------------------------------------------------------------------------------------------
# Tiny Kimi-style tokenizer for test checkpoints.

_KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role ' ~ message['role']) }}"
    "{%- endif -%}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
_CORPUS = (
    "The engine reads a batch of prompts, turns each one into tokens, and runs the model over "
    "them until every sequence has finished. The scheduler decides which requests run in the "
    "next step. When the cache is full, the scheduler preempts the youngest request and puts it "
    "back in the queue. There is nothing surprising about it: a tokenizer, a model, a cache and "
    "a loop that ties them together, tested on small models that run in a few seconds."
)
_SYNTHETIC_ALPHABET = b" etaoinshrdlucmfwypvbgkjqxz"


def _learn_merges(text: str, max_merges: int) -> list[bytes]:
    """Greedy byte-pair merges over `text` (most frequent pair first, ties by bytes)."""
    words = collections.Counter(re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text))
    splits = {w: [bytes([b]) for b in w.encode()] for w in words}
    merges: list[bytes] = []
    while len(merges) < max_merges:
        pairs: collections.Counter = collections.Counter()
        for word, parts in splits.items():
            for pair in zip(parts, parts[1:]):
                pairs[pair] += words[word]
        best, count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]), default=(None, 0))
        if count < 2:
            break
        merges.append(best[0] + best[1])
        for parts in splits.values():  # merge left to right, in place
            i = 0
            while i < len(parts) - 1:
                if (parts[i], parts[i + 1]) == best:
                    parts[i : i + 2] = [merges[-1]]
                i += 1
    return merges


def _regular_tokens(num_regular: int) -> list[bytes]:
    """256 single bytes, then learned merges, then unique synthetic n-grams; rank = list index."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += dict.fromkeys(_learn_merges(_CORPUS, max_merges=min(num_regular - 256, 400)))
    seen = set(tokens)
    grams = [b""]
    while len(tokens) < num_regular:
        grams = [g + bytes([c]) for g in grams for c in _SYNTHETIC_ALPHABET]
        for token in grams:
            if len(tokens) == num_regular:
                break
            if len(token) > 1 and token not in seen:
                tokens.append(token)
                seen.add(token)
    return tokens[:num_regular]


def write_tiny_tokenizer(
    out_dir, *, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
) -> None:
    """Write `tiktoken.model` + `tokenizer_config.json` in Kimi's format into `out_dir`.

    Regular tokens are ids [0, bos_token_id); specials fill [bos_token_id, vocab_size) in Kimi's
    layout: [BOS]=bos, [EOS]=bos+1, <|im_end|>=eos, <|im_user|>=bos+3, <|im_assistant|>=bos+4,
    <|im_system|>=bos+10, <|im_middle|>=bos+17, [UNK]=pad-1, [PAD]=pad, the rest reserved.
    """
    b = bos_token_id
    layout = [
        ("[BOS]", b),
        ("[EOS]", b + 1),
        ("<|im_end|>", eos_token_id),
        ("<|im_user|>", b + 3),
        ("<|im_assistant|>", b + 4),
        ("<|im_system|>", b + 10),
        ("<|im_middle|>", b + 17),
        ("[UNK]", pad_token_id - 1),
        ("[PAD]", pad_token_id),
    ]
    named = {i: name for name, i in layout}
    if len(named) != len(layout) or not all(b <= i < vocab_size for i in named) or b < 256:
        raise ValueError(
            f"special ids {dict(layout)} must be distinct and in [bos_token_id, vocab_size) = "
            f"[{b}, {vocab_size}), with bos_token_id >= 256"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(_regular_tokens(b))]
    (out_dir / _TIKTOKEN_FILE).write_text("".join(lines))
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    decoder = {
        str(i): {"content": named.get(i, f"<|reserved_token_{i}|>"), **flags}
        for i in range(b, vocab_size)
    }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": _KIMI_CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out_dir / _CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
