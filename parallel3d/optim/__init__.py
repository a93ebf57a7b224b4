"""Optimizers: AdamW with its weight-decay groups, learning-rate schedules, gradient clipping,
and Muon for the blocks' matrices."""
