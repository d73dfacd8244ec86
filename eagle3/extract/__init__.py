"""Stage 2, extraction: samples -> a backend (transformers or vLLM) -> the shard store.

extract.py       the extraction loop (resumable at shard granularity) and the first-batch self-check
recipe.py        the extract options a store records (`extract --resume STORE`)
hf_backend.py    the reference backend (transformers; CPU by default)
vllm_backend.py  the vLLM driver: engine, sessions, the ranks' replies
vllm_worker.py   the worker extension loaded into vLLM's workers (hooks, aux capture, the owner rank's writer)
vllm_compat.py   every vLLM internal eagle3 touches, in one adapter
capture.py       GPU rows -> pinned host buffers -> shards, preemption-safe placement
rpc.py           collective_rpc replies, validated in one place
selfcheck.py     the final-state self-check (final norm + lm_head on the captured last state)
"""
