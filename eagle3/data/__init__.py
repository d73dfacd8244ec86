"""Stage 1, the data: conversations (JSONL, OpenAI messages or ShareGPT) -> token ids and loss masks.

conversations.py  readers, chat template, loss masks, the long-sample rule, rejects
corpus.py         the templated dialogues bundled with eagle3 (the demo's and the learnable target's data)
"""
