"""Checkpoints: sharded saves with torch.distributed.checkpoint, their manifests, the resume decision,
the checkpoint section of validation, and what can go wrong, said in one line."""
