"""``checkpoint.init_from``: initial weights from one of our checkpoints or a Hugging Face folder,
loaded with DCP at this run's layout (each rank reads only its shards of each tensor)."""

from __future__ import annotations

from pathlib import Path


from parallel3d.checkpoint.commit import find_checkpoint
from parallel3d.checkpoint.errors import checkpoint_errors
from parallel3d.checkpoint.state import TrainState, finish_load, model_targets
from parallel3d.config import hf_folder
from parallel3d.hf import families
from parallel3d.models.lora import is_adapter


def load_initial_weights(*, path: Path, state: TrainState, model_cfg, group) -> None:
    """Initial weights only, from one of our checkpoints or a Hugging Face Llama folder.
    ``group``: the process group DCP plans the load over (None in one process)."""
    if hf_folder.is_hf_dir(path):
        hf_folder.check_agrees(path, model_cfg)
        targets, copies = model_targets(state, lambda name, param: families.base_hf_tensors(name, param, model_cfg))
        if families.exported_buffers(model_cfg):
            targets |= {key: t for name, buf in state.persistent_buffers().items()
                        for key, t in families.hf_tensors(name, buf, model_cfg).items()}
    else:
        found = find_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"checkpoint.init_from={path}: neither a checkpoint nor a Hugging Face folder")
        path = found
        targets, copies = model_targets(state)
    # LoRA adapters start as LoRA does (B = 0) on whatever base is loaded: init_from gives the base.
    targets = {key: t for key, t in targets.items() if not is_adapter(key)}
    import torch.distributed.checkpoint as dcp  # imported by runs that load

    with checkpoint_errors(path, saving=False, every_rank=True):
        dcp.load(targets, storage_reader=dcp.HuggingFaceStorageReader(str(path)), process_group=group,
                 no_dist=group is None)
    finish_load(copies)
