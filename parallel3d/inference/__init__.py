"""A trained model put to use: held-out evaluation, generation with a KV cache, and the model lm-
evaluation-harness runs."""
