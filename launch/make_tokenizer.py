"""The model maker's tokenizer: a byte-level BPE trained here on the running Python's stdlib sources, with ChatML."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from launch.demo_corpus import stdlib_sources

# One token serves as bos, eos and pad, for plain and chat prompts alike: a single stop id keeps
# HF `generate` and the engine stopping at the same place, and random weights give <|im_end|> no
# meaning that would be worth a second stop token.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = ("<think>", "</think>")
# ChatML; with tools, Hermes/Qwen2.5's format: the tools listed in a system turn, calls written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results sent back as <tool_response> user turns. A call
# without text before it starts right after the role's newline, as the generation prompt ends: with a newline of
# its own between them the model would be taught a "\n\n" token the prompt never ends with.
CHAT_TEMPLATE = (
    r"{%- if tools %}"
    r"{{- '<|im_start|>system\n' }}"
    r"{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    r"{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    r"function signatures within <tools></tools> XML tags:\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    r"{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    r"<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    r"<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    r"{%- endif %}"
    r"{%- for message in messages %}"
    r"{%- if tools and loop.first and message['role'] == 'system' %}"
    r"{%- elif message['role'] == 'tool' %}"
    r"{{- '<|im_start|>user\n<tool_response>\n' + (message['content'] or '') + '\n</tool_response><|im_end|>\n' }}"
    r"{%- else %}"
    r"{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    r"{%- for call in message.get('tool_calls') or [] %}"
    r"{{- ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": ' "
    r"+ (call['function']['name'] | tojson) + ', \"arguments\": ' "
    r"+ (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    r"{%- endfor %}"
    r"{{- '<|im_end|>\n' }}"
    r"{%- endif %}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

CORPUS_BYTES = 3_000_000
MULTILINGUAL_REPEATS = 100
MULTILINGUAL_TEXT = """\
Le café de l'hôtel était déjà fermé ; où est passé le garçon ? Élève, façade, naïve, cœur.
Müller aß größere Brötchen über dem Fluss. ¿Dónde está la niña? Añadir, canción, pingüino.
Привет, как дела? Это простой пример текста на русском языке. Ελληνικά: καλημέρα κόσμε.
日本語のテキストです。東京は大きな都市で、今日は天気がいいです。ひらがな、カタカナ、漢字。
我们今天学习中文。这是一个简单的例子，用来训练分词器。你好，世界！
한국어 문장입니다. 안녕하세요, 만나서 반갑습니다. العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया।
Emoji: 😀 😂 🎉 👍 🚀 ❤️ 🌍 🐍 ✨ 🤖 — “quotes” ‘single’ … € £ ¥ © ® ™ ° ± × ÷ → ← ≤ ≥ ∞.
"""


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML template; training runs once per vocab size per process."""
    return hf_tokenizer(_trained_bpe(vocab_size))


def hf_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """`bpe` as a transformers tokenizer: <|endoftext|> as bos, eos and pad, and the ChatML template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=None)
def _trained_bpe(vocab_size: int) -> Tokenizer:
    bpe = bpe_tokenizer(vocab_size, _training_texts())
    # As in Qwen3 and DeepSeek-R1: one token each, kept in the text, so reasoning parsers have a model to serve.
    bpe.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in THINK_TOKENS])
    return bpe


def bpe_tokenizer(vocab_size: int, texts: Iterable[str], pretokenize_regex: str = PRETOKENIZE_REGEX) -> Tokenizer:
    """A byte-level BPE with Qwen2's pre-tokenizer (or `pretokenize_regex`) and the special tokens, trained on
    `texts`."""
    # AutoTokenizer rebuilds a qwen2 tokenizer with Qwen2's own normalizer and pre-tokenizer, ignoring
    # tokenizer.json; using that same pipeline for every arch keeps all four tokenizing alike.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def _training_texts() -> Iterator[str]:
    """The first few MB of the running Python's stdlib sources, then a multilingual paragraph."""
    budget = CORPUS_BYTES
    for path in stdlib_sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        budget -= len(text)
        if budget <= 0:
            break
    yield from [MULTILINGUAL_TEXT] * MULTILINGUAL_REPEATS

