"""Each family's tokenizer as the tiny factory builds it: special tokens and chat template.

The byte-level vocabulary (ids 0..255 are UTF-8 bytes) is the same for all; a family adds its special tokens after
it and its chat format. The templates are written for these tiny tokenizers, after the real ones' formats.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every tag starts with `{{-` or `{%-`, so the layout whitespace below is not rendered.
CHATML_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags.<|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
"""ChatML as Qwen2/Qwen3 write it; a `tools` list is rendered into the system turn."""

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content | trim + '\n\n' }}{%- endif %}
    {{- 'You have access to the following functions:\n' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (tools and loop.first and message.role == 'system') %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' }}
        {{- message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""
"""Llama 3 header style; the template writes BOS itself, as Meta's does."""


GLM4_TEMPLATE = r"""
{{- '[gMASK]<sop>' }}
{%- if tools %}
    {{- '<|system|>\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call the following functions:' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- if not (tools and loop.first and message.role == 'system') %}
        {{- '<|' + message.role + '|>\n' + message.content }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}
"""
"""GLM-4-0414 style: `[gMASK]<sop>` once, then `<|role|>` + newline + content per turn, no end-of-turn token
(the next role tag ends a turn, so `<|user|>` and `<|observation|>` stop generation)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """A family's special tokens and chat format; the byte-level vocabulary is the same for all."""

    special_tokens: tuple[str, ...]
    """Appended after the 256 byte tokens, in this id order (ids 256, 257, ...)."""
    bos_token: str | None
    eos_token: str
    """Ends an assistant turn; the config's `eos_token_id`."""
    pad_token: str
    stop_tokens: tuple[str, ...]
    """Every token that ends generation (generation_config's `eos_token_id`), eos first."""
    add_bos_token: bool
    """Every encoded text starts with BOS (Llama 3's does, Qwen's does not)."""
    nfc_normalize: bool
    """Text is NFC-normalized first, as Qwen's is (transformers 5 rebuilds any qwen2 tokenizer that way on
    loading, whatever tokenizer.json says)."""
    chat_template: str


QWEN_TOKENIZER = TokenizerInfo(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    add_bos_token=False,
    nfc_normalize=True,
    chat_template=CHATML_TEMPLATE,
)
LLAMA3_TOKENIZER = TokenizerInfo(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token="<|end_of_text|>",
    stop_tokens=("<|eot_id|>", "<|end_of_text|>"),
    add_bos_token=True,
    nfc_normalize=False,
    chat_template=LLAMA3_TEMPLATE,
)
GLM4_TOKENIZER = TokenizerInfo(
    special_tokens=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|observation|>"),
    bos_token=None,
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    stop_tokens=("<|endoftext|>", "<|user|>", "<|observation|>"),
    add_bos_token=False,
    nfc_normalize=False,
    chat_template=GLM4_TEMPLATE,
)
