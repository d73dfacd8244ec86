"""Stage 4, training: an EAGLE-3 draft fitted on a store, exported in the form vLLM serves.

train.py       the training loop (DDP under torchrun), batches, resume, the export
draft.py       the draft's shape for a target (servable at every TP), its speculators config, draft vocabulary
checkpoint.py  checkpoints (complete, newest, pruned) and publishing the draft (bf16, no embedding)
"""
