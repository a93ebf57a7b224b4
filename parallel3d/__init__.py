"""parallel3d: data x tensor x pipeline parallel training of decoder LLMs over one DeviceMesh."""

__version__ = "0.1.0"
