"""Stage 5, serving: the draft with its target in vLLM (speculative_config method eagle3).

evaluate.py  acceptance length per position, greedy equality with the target alone, speedup
"""
