"""Tokenizer: both on-disk formats, special-token safety, chat template ids, pickling."""

import json
import pickle
import time

import pytest

from k3batch.tokenizer import KIMI_PAT_STR, Tokenizer, write_tiny_tokenizer

TEXTS = [
    "",
    "Hello, world! The engine's 12345 tokens.\n\n  indented\tline\r\n",
    "中文分词测试，混合 English 和 数字 2024。",
    "emoji 🚀🎉 and accents: café naïve Ω ∑",
]
FLAVORS = {
    "tiny": dict(vocab_size=512, bos_token_id=256, eos_token_id=258, pad_token_id=511),
    "full": dict(vocab_size=163840, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839),
}


def test_tokenizer_pat_str_is_kimis():
    kimi_pat_str = "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )
    assert KIMI_PAT_STR == kimi_pat_str


@pytest.fixture(scope="module", params=list(FLAVORS))
def kimi(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(request.param)
    write_tiny_tokenizer(out_dir, **FLAVORS[request.param])
    return Tokenizer.from_dir(out_dir), FLAVORS[request.param]


def test_tokenizer_round_trip(kimi):
    tok, flavor = kimi
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < flavor["bos_token_id"] for i in ids)
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_bos=True)) == text


def test_tokenizer_special_ids(kimi):
    tok, flavor = kimi
    bos, eos, pad = flavor["bos_token_id"], flavor["eos_token_id"], flavor["pad_token_id"]
    assert tok.vocab_size == flavor["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (bos, eos, pad)
    expected = {
        "[BOS]": bos,
        "[EOS]": bos + 1,
        "<|im_end|>": eos,
        "<|im_user|>": bos + 3,
        "<|im_assistant|>": bos + 4,
        "<|im_system|>": bos + 10,
        "<|im_middle|>": bos + 17,
        "[UNK]": pad - 1,
        "[PAD]": pad,
        f"<|reserved_token_{bos + 5}|>": bos + 5,
    }
    assert {k: tok.special_tokens[k] for k in expected} == expected
    assert len(tok.special_tokens) == flavor["vocab_size"] - bos
    assert tok.stop_token_ids == (eos, bos + 1)
    assert tok.encode("x", add_bos=True)[0] == bos


def test_tokenizer_user_special_text_is_plain(kimi):
    tok, flavor = kimi
    ids = tok.encode("<|im_end|>[BOS]")
    assert all(i < flavor["bos_token_id"] for i in ids)
    assert tok.decode(ids) == "<|im_end|>[BOS]"


def test_tokenizer_decode_any_id(kimi):
    tok, flavor = kimi
    every_id = list(range(0, flavor["vocab_size"], max(1, flavor["vocab_size"] // 4096)))
    every_id += list(range(flavor["bos_token_id"], flavor["vocab_size"]))
    tok.decode(every_id)
    text = tok.decode([flavor["eos_token_id"], 0xE4, 0xB8], skip_special_tokens=False)
    assert text.startswith("<|im_end|>") and text.endswith("\ufffd")
    assert tok.decode([flavor["eos_token_id"]]) == ""
    with pytest.raises(ValueError, match="outside"):
        tok.decode([flavor["vocab_size"]])


def test_tokenizer_chat_template_ids(kimi):
    tok, flavor = kimi
    bos = flavor["bos_token_id"]
    im_user, im_assistant, im_middle, im_end = bos + 3, bos + 4, bos + 17, flavor["eos_token_id"]
    messages = [
        {"role": "user", "content": "Hi <|im_end|> there"},
        {"role": "assistant", "content": "Hello! 你好"},
    ]
    expected = (
        [im_user]
        + tok.encode("user")
        + [im_middle]
        + tok.encode("Hi <|im_end|> there")
        + [im_end]
        + [im_assistant]
        + tok.encode("assistant")
        + [im_middle]
        + tok.encode("Hello! 你好")
        + [im_end]
        + [im_assistant]
        + tok.encode("assistant")
        + [im_middle]
    )
    assert tok.apply_chat_template(messages) == expected
    without_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt == expected[: -len(tok.encode("assistant")) - 2]
    system = [{"role": "system", "content": "Be brief."}]
    assert tok.apply_chat_template(system, add_generation_prompt=False) == (
        [bos + 10] + tok.encode("system") + [im_middle] + tok.encode("Be brief.") + [im_end]
    )


@pytest.mark.parametrize(
    "messages",
    [
        "hi",
        [],
        [["user", "hi"]],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"role": None, "content": "hi"}],
        [{"role": "robot", "content": "hi"}],
    ],
)
def test_tokenizer_bad_messages_raise(kimi, messages):
    tok, _ = kimi
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def test_tokenizer_pickle_round_trip(kimi):
    tok, _ = kimi
    clone = pickle.loads(pickle.dumps(tok))
    for text in TEXTS:
        assert clone.encode(text) == tok.encode(text)
    assert clone.stop_token_ids == tok.stop_token_ids


def test_tokenizer_full_size_build_is_fast(tmp_path):
    start = time.perf_counter()
    write_tiny_tokenizer(tmp_path, **FLAVORS["full"])
    tok = Tokenizer.from_dir(tmp_path)
    assert time.perf_counter() - start < 5.0
    # Learned and synthetic merges make ordinary English shorter than its byte count.
    text = "the scheduler preempts the youngest request"
    assert len(tok.encode(text)) < len(text) // 2


def test_tokenizer_missing_files_names_dir(tmp_path):
    with pytest.raises(ValueError, match="tiktoken.model") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_tokenizer_bad_special_layout_raises(tmp_path):
    with pytest.raises(ValueError, match="special ids"):
        write_tiny_tokenizer(
            tmp_path, vocab_size=512, bos_token_id=256, eos_token_id=257, pad_token_id=511
        )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_end|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello tokens",
        "batch inference engines turn prompts into tokens",
    ] * 10
    hf.train_from_iterator(sentences, trainer=trainer)
    out_dir = tmp_path_factory.mktemp("hf")
    hf.save(str(out_dir / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<s>assistant: "
        "{% endif %}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return out_dir


def test_tokenizer_hf_json_dir(hf_dir):
    tok = Tokenizer.from_dir(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 3)
    assert tok.stop_token_ids == (1, 2)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("hi <|im_end|>", add_bos=True)
    assert ids[0] == 0 and 2 not in ids
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi <|im_end|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "x </s>"}])
    assert chat == (
        [0] + tok.encode("user: ") + tok.encode("x </s>") + [2, 0] + tok.encode("assistant: ")
    )
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_tokenizer_template_rewriting_content(tmp_path):
    # A template that alters contents defeats the placeholders: allowed only without special text.
    write_tiny_tokenizer(tmp_path, **FLAVORS["tiny"])
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[BOS]{{ m['content'] | upper }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == [256] + tok.encode("HI")
    with pytest.raises(ValueError, match="special-token text"):
        tok.apply_chat_template([{"role": "user", "content": "hi <|im_end|>"}])
