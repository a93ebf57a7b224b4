"""Hugging Face interop: each family's parameter names and config.json, DeepSeek-V3's, a complete
folder out, LoRA merged or as PEFT's adapter."""
