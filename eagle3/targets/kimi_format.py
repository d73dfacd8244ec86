"""Kimi-K2's chat format, for the learnable DeepseekV3 target: its role tokens, thinking and tool-call section tokens.

Written here after Kimi-K2's published format and vLLM 0.26's kimi_k2 parser (vllm/parser/kimi_k2.py):
    <|im_system|>system<|im_middle|>...<|im_end|>            (also tool_declare: the tools list as JSON)
    <|im_user|>user<|im_middle|>...<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>R</think>text
        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{args}
        <|tool_call_end|><|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.NAME:I\\n...<|im_end|>
The generation prompt is ``<|im_assistant|>assistant<|im_middle|>``: the target writes ``<think>`` itself (the
reasoning parser starts in its reasoning state either way). As in Kimi-K2's thinking template, an assistant turn
before the last user message keeps no thinking (``<think></think>``). ``<|im_end|>`` ends a turn (the eos).
"""

from __future__ import annotations

ROLE_TOKENS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
TOOL_TOKENS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
SPECIAL_TOKENS = ["[BOS]", "[EOS]", "[PAD]"] + ROLE_TOKENS + THINK + TOOL_TOKENS
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c -%}{%- for p in c -%}{{ p['text'] }}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] not in ['system', 'developer'] -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM + "<|im_end|>{%- endif -%}"
    "{%- set ns = namespace(last_user=-1, calls=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ text(m['content']) }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for c in m['tool_calls'] -%}<|tool_call_begin|>"
    "{{ c.get('id') or 'functions.' ~ c['function']['name'] ~ ':' ~ ns.calls }}<|tool_call_argument_begin|>"
    "{%- set ns.calls = ns.calls + 1 -%}"
    "{%- if c['function']['arguments'] is string -%}{{ c['function']['arguments'] }}"
    "{%- else -%}{{ c['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.get('tool_call_id', '') }}\n"
    "{{ text(m['content']) }}<|im_end|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ text(m['content']) }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{{ text(m['content']) }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def tokenizer_kwargs() -> dict:
    """PreTrainedTokenizerFast arguments for a tokenizer in this format."""
    return dict(
        bos_token="[BOS]",
        eos_token="<|im_end|>",
        pad_token="[PAD]",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[BOS]", "<|im_end|>", "[PAD]")],
    )
