"""get_tokenizer on the default SmolLM2 GGUF file and on a Hugging Face directory."""

import copy
from pathlib import Path

import pytest
import transformers

from pyorch.model_loader import default_model_path, get_tokenizer
from pyorch.model_loader.gguf_loader import gguf_chat_template

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, object]:
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return path, get_tokenizer(path)


def test_gguf_tokenizer(smollm2: tuple[str, object]) -> None:
    _, tok = smollm2
    assert len(tok) == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    text = "Hello world, this is pyorch!"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [19556, 905]
    assert tok.decode(ids) == text


def test_gguf_chat_template(smollm2: tuple[str, object]) -> None:
    path, tok = smollm2
    assert tok.chat_template == gguf_chat_template(path)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED_PROMPT


def test_chat_template_filled_from_metadata(
    smollm2: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Should transformers stop carrying the template over, it is read from the GGUF metadata.
    path, tok = smollm2
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: bare)
    assert get_tokenizer(path).chat_template == gguf_chat_template(path)


def test_hf_directory_tokenizer(smollm2: tuple[str, object], tmp_path: Path) -> None:
    _, tok = smollm2
    tok.save_pretrained(tmp_path)
    again = get_tokenizer("unused-model-name", tokenizer=str(tmp_path))
    assert again.encode("Hello world") == tok.encode("Hello world")
    assert again.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        EXPECTED_PROMPT
    )


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        get_tokenizer(str(tmp_path / "absent.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="bad.gguf"):
        get_tokenizer(str(bad))


def _tiny_tokenizer_dir(folder: Path, tokenizer_class: str, extra: dict | None = None) -> str:
    """A word-level tokenizer.json with special tokens and a chat template, saved by transformers,
    with tokenizer_config.json's tokenizer_class (and any extra keys) rewritten."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "pyorch", ",", "!", "user", "assistant"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class=tokenizer_class, **(extra or {}))
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_generic_tokenizer_built_directly_matches_auto_tokenizer(
    tmp_path: Path, tokenizer_class: str
) -> None:
    from pyorch.model_loader.tokenizer import _generic_tokenizer_class

    path = _tiny_tokenizer_dir(tmp_path, tokenizer_class)
    assert _generic_tokenizer_class(path) is not None
    ours, auto = get_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(auto)
    for text in ["hello world , pyorch !", "hello unknown-word", ""]:
        assert ours.encode(text) == auto.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (1, 2, 0)
    assert ours.all_special_ids == auto.all_special_ids
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "user hello"
    assert ours.chat_template == auto.chat_template


@pytest.mark.parametrize("tokenizer_class,extra", [
    ("LlamaTokenizer", None),  # a model-specific class: AutoTokenizer knows its mapping
    ("PreTrainedTokenizerFast", {"auto_map": {"AutoTokenizer": [None, "custom.Tok"]}}),
])
def test_other_tokenizers_go_through_auto_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_class: str, extra: dict | None
) -> None:
    from pyorch.model_loader.tokenizer import _generic_tokenizer_class

    path = _tiny_tokenizer_dir(tmp_path, tokenizer_class, extra)
    assert _generic_tokenizer_class(path) is None
    sentinel = object()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: sentinel)
    assert get_tokenizer(path) is sentinel


def test_generic_tokenizer_needs_tokenizer_json(tmp_path: Path) -> None:
    from pyorch.model_loader.tokenizer import _generic_tokenizer_class

    path = _tiny_tokenizer_dir(tmp_path, "PreTrainedTokenizerFast")
    (tmp_path / "tokenizer.json").unlink()
    assert _generic_tokenizer_class(path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert _generic_tokenizer_class(path) is None
