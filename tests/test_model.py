"""The Llama 3 model: published sizes, forward pass, causality, deterministic layout-independent init,
tied embeddings, RoPE scaling and the FLOP count."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from parallel3d.config.compose import compose
from parallel3d.config.schema import ModelConfig, RopeScaling
from parallel3d.models.llama import Transformer, flops_per_token, num_params, rope_frequencies


def model_config(name: str) -> ModelConfig:
    cfg = OmegaConf.to_object(compose([f"model={name}"]).model)
    assert isinstance(cfg, ModelConfig)
    return cfg


def build(cfg: ModelConfig, seed: int | None = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    if seed is not None:
        model.to_empty(device="cpu")
        model.init_weights(seed)
    return model


# Published totals of the Llama 3 family (Hugging Face model cards / safetensors metadata of
# meta-llama/Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B, Llama-3.1-405B).
PUBLISHED_PARAMS = {
    "llama3_1b": 1_235_814_400,  # tied embeddings
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_llama3_parameter_counts_match_published(name):
    cfg = model_config(name)
    assert cfg.name == name
    model = build(cfg, seed=None)
    assert all(p.is_meta for p in model.parameters())
    assert num_params(model) == PUBLISHED_PARAMS[name]


def test_llama3_1b_ties_embeddings():
    cfg = model_config("llama3_1b")
    assert cfg.tie_embeddings
    untied = build(replace(cfg, tie_embeddings=False), seed=None)
    assert num_params(untied) == PUBLISHED_PARAMS["llama3_1b"] + cfg.vocab_size * cfg.dim


@pytest.fixture(scope="module")
def tiny_cfg() -> ModelConfig:
    return model_config("tiny")


@pytest.fixture(scope="module")
def tiny(tiny_cfg) -> Transformer:
    return build(tiny_cfg).eval()


def test_forward_shape_and_finite(tiny, tiny_cfg):
    tokens = torch.randint(0, tiny_cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny(tokens)
    assert logits.shape == (3, 17, tiny_cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Untrained with std 0.02: close to uniform, so the loss is near log(vocab).
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    assert abs(loss.item() - math.log(tiny_cfg.vocab_size)) < 0.5


@pytest.mark.fast
def test_forward_is_causal(tiny, tiny_cfg):
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    pos = 13
    changed[:, pos] = (changed[:, pos] + 1) % tiny_cfg.vocab_size
    with torch.no_grad():
        a, b = tiny(tokens), tiny(changed)
    torch.testing.assert_close(a[:, :pos], b[:, :pos], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, pos:], b[:, pos:], atol=1e-4)  # the change is seen from pos on
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-4


def test_forward_prefix_matches_shorter_sequence(tiny, tiny_cfg):
    """Positions come from the rope tables: a prefix alone gives the same logits as inside a longer input."""
    tokens = torch.randint(0, tiny_cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, prefix = tiny(tokens), tiny(tokens[:, :9])
    torch.testing.assert_close(full[:, :9], prefix, rtol=1e-5, atol=1e-6)


def test_init_is_deterministic_in_seed(tiny_cfg):
    a, b, c = build(tiny_cfg, 0).state_dict(), build(tiny_cfg, 0).state_dict(), build(tiny_cfg, 1).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert "rope_cos" not in a  # not persistent
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if "norm" in name:
            assert torch.equal(a[name], torch.ones_like(a[name])), name
            assert torch.equal(c[name], a[name]), name
        else:
            assert not torch.equal(a[name], c[name]), name


@pytest.mark.fast
def test_init_depends_on_parameter_name_and_std(tiny_cfg):
    sd = build(tiny_cfg, 0).state_dict()
    # Same shape, different names: different values.
    assert not torch.equal(sd["layers.0.attention.wq.weight"], sd["layers.1.attention.wq.weight"])
    assert not torch.equal(sd["layers.0.feed_forward.w1.weight"], sd["layers.0.feed_forward.w3.weight"])
    residual = tiny_cfg.init_std / math.sqrt(2 * tiny_cfg.n_layers)
    for name, value in sd.items():
        if "norm" in name:
            continue
        expected = residual if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else tiny_cfg.init_std
        assert abs(value.mean().item()) < 4 * expected / math.sqrt(value.numel()), name
        assert value.std().item() == pytest.approx(expected, rel=0.08), name


def test_init_weights_sets_rope_tables(tiny, tiny_cfg):
    head_dim = tiny_cfg.dim // tiny_cfg.n_heads
    assert tiny.rope_cos.shape == tiny.rope_sin.shape == (tiny_cfg.max_seq_len, head_dim // 2)
    freqs = rope_frequencies(head_dim, tiny_cfg.rope_theta, None)
    pos = 37
    torch.testing.assert_close(tiny.rope_cos[pos], torch.cos(pos * freqs))
    torch.testing.assert_close(tiny.rope_sin[pos], torch.sin(pos * freqs))


def test_tied_embeddings(tiny_cfg):
    cfg = replace(tiny_cfg, tie_embeddings=True)
    model = build(cfg, seed=None)  # as built, on the meta device
    assert model.output is None  # the embedding matrix is the output projection
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert len(names) == len(set(names))
    assert num_params(model) == num_params(build(tiny_cfg, seed=None)) - cfg.vocab_size * cfg.dim


def test_tied_embeddings_survive_materialization(tiny_cfg):
    cfg = replace(tiny_cfg, tie_embeddings=True)
    model = build(cfg, seed=0)  # meta -> to_empty -> init_weights, as train.py does
    assert "output.weight" not in dict(model.named_parameters())
    assert num_params(model) == num_params(build(cfg, seed=None))
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    grad = model.tok_embeddings.weight.grad
    # The output projection touches every row; the lookup alone would only touch rows 1..3.
    assert (grad[10:].abs().sum(dim=1) > 0).all()


# --- layout independence of init under FSDP -------------------------------------------------------

WORLD = 4
# Against a hang: four spawned ranks each import torch before they start, which on a loaded machine
# takes minutes, not seconds.
RANKS_TIMEOUT_S = 300
FSDP_CFG = dict(vocab_size=257, n_layers=2)  # vocab 257 rows shard unevenly over 4 ranks (65, 65, 65, 62)


def _fsdp_init_worker(rank: int, port: int, out_dir: str, cfg: ModelConfig) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
        mesh = init_device_mesh("cpu", (WORLD,))
        with torch.device("meta"):
            model = Transformer(cfg)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model.init_weights(0)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        local = model.tok_embeddings.weight.to_local().shape[0]
        count = num_params(model)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"state": state, "num_params": count, "local_rows": local},
                       os.path.join(out_dir, "rank0.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent through a file
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(repr(e))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multirank
def test_init_is_layout_independent_under_fsdp(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    cfg = replace(model_config("tiny"), **FSDP_CFG)
    procs = [ctx.Process(target=_fsdp_init_worker, args=(r, port, str(tmp_path), cfg), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=RANKS_TIMEOUT_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {f.name: f.read_text() for f in tmp_path.glob("error*.txt")}
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * WORLD
    got = torch.load(tmp_path / "rank0.pt")

    reference_model = build(cfg, seed=0)
    reference = reference_model.state_dict()
    assert got["num_params"] == num_params(reference_model)  # counts the full model whatever the sharding
    assert got["local_rows"] == math.ceil(FSDP_CFG["vocab_size"] / WORLD)  # really sharded
    assert got["state"].keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(got["state"][name], value), name


# --- RoPE -----------------------------------------------------------------------------------------

def test_rope_frequencies_without_scaling():
    head_dim, theta = 64, 10000.0
    freqs = rope_frequencies(head_dim, theta, None)
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    assert freqs.shape == (head_dim // 2,) and freqs.dtype == torch.float32
    torch.testing.assert_close(freqs, (1.0 / theta ** (2 * i / head_dim)).float())
    assert freqs[0] == 1.0


def test_rope_frequencies_llama31_scaling():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    head_dim, theta = 128, 500000.0
    base = rope_frequencies(head_dim, theta, None).double()
    scaled = rope_frequencies(head_dim, theta, scaling).double()
    wavelen = 2 * math.pi / base
    high = wavelen < scaling.original_max_seq_len / scaling.high_freq_factor
    low = wavelen > scaling.original_max_seq_len / scaling.low_freq_factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()  # all three regimes occur for Llama 3.1
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / scaling.factor)
    # In between, a smooth blend of the two that decreases with wavelength.
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / scaling.factor)).all()
    smooth = (scaling.original_max_seq_len / wavelen[mid] - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    torch.testing.assert_close(scaled[mid], (1 - smooth) * base[mid] / scaling.factor + smooth * base[mid],
                               rtol=1e-6, atol=0)
    assert (scaled[1:] < scaled[:-1]).all()


def test_rope_scaling_reaches_the_model(tiny_cfg):
    scaling = RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)
    plain, scaled = build(tiny_cfg), build(replace(tiny_cfg, rope_scaling=scaling))
    assert not torch.equal(plain.rope_cos, scaled.rope_cos)
    tokens = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        assert not torch.allclose(plain(tokens), scaled(tokens))


# --- FLOPs ----------------------------------------------------------------------------------------

def _matmul_weights(model: nn.Module) -> int:
    """Weights that multiply activations: the linear layers, plus a tied embedding (the output projection)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return linear + (model.tok_embeddings.weight.numel() if model.output is None else 0)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", ["tiny", "llama3_8b"])
def test_flops_per_token(name, tied):
    cfg = replace(model_config(name), tie_embeddings=tied)
    model = build(cfg, seed=None)
    seq_len = 2048
    head_dim = cfg.dim // cfg.n_heads
    attention = 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len  # PaLM appendix B
    assert flops_per_token(cfg, seq_len) == 6 * _matmul_weights(model) + attention

    # Equivalently: every parameter but the embedding lookup's and the norms' (which do no matmul);
    # a tied embedding is counted once, as the output projection.
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    embedding = 0 if tied else cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, seq_len) == 6 * (num_params(model) - embedding - norms) + attention
    # Longer sequences add only the attention term.
    assert flops_per_token(cfg, 2 * seq_len) - flops_per_token(cfg, seq_len) == attention
