"""Fault tolerance across replica groups (torchft): quorum, cross-group averaging, healing, membership."""
