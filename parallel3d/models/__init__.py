from parallel3d.models.llama import Transformer, flops_per_token, num_params

__all__ = ["Transformer", "flops_per_token", "num_params"]
