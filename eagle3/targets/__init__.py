"""What states are extracted from: target profiles and layer ids.

presets.py    target profiles (tiny-kimi, mini-kimi, kimi-depth, kimi-k2.5, ...) and reading a target's config
layers.py     layer ids and their convention (id i = input of decoder layer i; id L = last layer, before the norm)
tiny.py       building a profile's model folder (weights and tokenizer) for tests and the demo
learnable.py  the tiny Llama target trained on the bundled dialogues (the end-to-end test's target)
learnable_profiles.py  the learnable targets' profiles, read by the CLI before any model code
int4.py       a DeepseekV3 target's routed experts in INT4, as Kimi-K2.5 ships them (compressed-tensors)
"""
