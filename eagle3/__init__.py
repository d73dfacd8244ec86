"""eagle3: extract target hidden states (vLLM or the hf reference) and train EAGLE-3 drafts.

Importing this package never imports vLLM or initializes CUDA; each stage lives in its own module:
data -> extract (backends: hf_backend, vllm_backend) -> store -> train -> checkpoint.
"""

__version__ = "0.1.0"
