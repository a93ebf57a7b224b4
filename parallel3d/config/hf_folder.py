"""A Hugging Face folder as the whole model: ``checkpoint.init_from=HF_DIR`` and nothing else.

``read_model`` turns the folder's ``config.json`` into every ``model.*`` key that changes the
numbers (sizes, heads, RoPE, norm eps, tied embeddings, q/k norm by family, MoE routing), and
refuses, naming the field, what the model here cannot compute (biases, sliding windows, other
RoPE types, other families). ``apply_hf_folder`` writes those keys and the folder's tokenizer into
a composed config: at composition time, before validation and before any process group, so dry
runs and the planner see the model that will train. A key the user set (``user_keys``: the
command line or the recipe, see config.user_set_keys) that disagrees is refused, naming both values.

This module reads JSON and config trees only (no model code), so config.compose can call it.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

from omegaconf import OmegaConf

from parallel3d.base import ConfigError
from parallel3d.data.tokenizer import tokenizer_file, tokenizer_folder

DEEPSEEK = "deepseek_v3"  # parallel3d/hf/deepseek.py: its names and config.json out
FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", DEEPSEEK)
# transformers' defaults for the keys a config.json may leave out (LlamaConfig, Qwen3Config, ...).
_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
                  "norm_topk_prob": False, "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "router_aux_loss_coef": 0.001},
}
# Fields the model here cannot honour: (config.json key, is it on?)
_UNSUPPORTED = (
    ("attention_bias", bool), ("mlp_bias", bool), ("use_sliding_window", bool),
    ("hidden_act", lambda v: v not in (None, "silu")), ("mlp_only_layers", bool),
    ("router_jitter_noise", bool), ("layer_types", lambda v: any(t != "full_attention" for t in v or [])),
)


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hf_folder(cfg) -> Path | None:
    """The Hugging Face folder ``checkpoint.init_from`` names, or None (unset, or one of our checkpoints)."""
    init_from = cfg.checkpoint.init_from
    if not init_from:
        return None
    path = Path(str(init_from)).expanduser()
    return path if is_hf_dir(path) else None


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def read_model(path: Path) -> dict[str, tuple[str, object]]:
    """``{model key: (config.json key, value)}`` for every model key the folder decides.
    Raises ConfigError (``checkpoint.init_from``) for a field the model cannot honour."""
    hf = read_config(path)
    fam = hf.get("model_type")
    if fam not in FAMILIES:
        _refuse(path, f"its config.json has model_type={fam}", f"use a {', '.join(FAMILIES)} model")
    for key, is_on in _UNSUPPORTED:
        if hf.get(key) is not None and is_on(hf[key]):
            _refuse(path, f"its config.json has {key}={json.dumps(hf[key])}, which parallel3d's {fam} cannot "
                          f"compute", "use a model without it")
    if fam == "mixtral" and hf.get("sliding_window") is not None:
        _refuse(path, f"its config.json has sliding_window={hf['sliding_window']}, which parallel3d's mixtral "
                      f"cannot compute (full attention only)", "use a model without it")

    if fam == DEEPSEEK:
        return _deepseek(hf, path)

    def get(key: str):
        return hf[key] if hf.get(key) is not None else _DEFAULTS[fam].get(key)

    try:
        return _dense(hf, fam, get, path) | _moe(hf, fam, get)
    except KeyError as e:
        _refuse(path, f"its config.json has no {e.args[0]}", "use a complete config.json (as save_pretrained writes)")


def _dense(hf: dict, fam: str, get, path: Path) -> dict[str, tuple[str, object]]:
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf, path, get("rope_theta"))
    return {
        "dim": ("hidden_size", hf["hidden_size"]), "n_layers": ("num_hidden_layers", hf["num_hidden_layers"]),
        "n_heads": ("num_attention_heads", heads),
        "n_kv_heads": ("num_key_value_heads", hf.get("num_key_value_heads") or heads),
        "head_dim": ("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads),
        "ffn_dim": ("intermediate_size", hf["intermediate_size"]), "vocab_size": ("vocab_size", hf["vocab_size"]),
        "norm_eps": ("rms_norm_eps", get("rms_norm_eps")), "rope_theta": ("rope_theta", theta),
        "rope_scaling": ("rope_scaling", scaling),
        "max_seq_len": ("max_position_embeddings", get("max_position_embeddings")),
        "tie_embeddings": ("tie_word_embeddings", bool(hf.get("tie_word_embeddings", False))),
        "qk_norm": (_implied(fam, "qk_norm"), fam in ("qwen3", "qwen3_moe")),
        "attention": (_implied(fam, "attention"), "gqa"),
    }


def _moe(hf: dict, fam: str, get) -> dict[str, tuple[str, object]]:
    if fam == "qwen3_moe":
        experts = "num_experts" if "num_experts" in hf else "num_local_experts"
        return {"moe.num_experts": (experts, hf[experts]), "moe.top_k": ("num_experts_per_tok", hf["num_experts_per_tok"]),
                "moe.expert_ffn_dim": ("moe_intermediate_size", hf["moe_intermediate_size"]),
                "moe.every": ("decoder_sparse_step", get("decoder_sparse_step")),
                "moe.norm_topk_prob": ("norm_topk_prob", get("norm_topk_prob")),
                "moe.aux_loss_coef": ("router_aux_loss_coef", get("router_aux_loss_coef")),
                "moe.shared_experts": (_implied(fam, "shared_experts"), 0),
                "moe.router": (_implied(fam, "router"), "softmax")}
    if fam == "mixtral":
        return {"moe.num_experts": ("num_local_experts", hf["num_local_experts"]),
                "moe.top_k": ("num_experts_per_tok", hf["num_experts_per_tok"]),
                "moe.expert_ffn_dim": ("intermediate_size", hf["intermediate_size"]),
                "moe.every": (_implied(fam, "every"), 1), "moe.norm_topk_prob": (_implied(fam, "norm_topk_prob"), True),
                "moe.aux_loss_coef": ("router_aux_loss_coef", get("router_aux_loss_coef")),
                "moe.shared_experts": (_implied(fam, "shared_experts"), 0),
                "moe.router": (_implied(fam, "router"), "softmax")}
    return {"moe.num_experts": (_implied(fam, "num_experts"), 0)}


# Our DeepSeek-V3 keys and the config.json keys they come from (deepseek_fields reads them).
_DEEPSEEK_KEYS = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "ffn_dim": "intermediate_size", "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "max_seq_len": "max_position_embeddings", "tie_embeddings": "tie_word_embeddings", "rope_scaling": "rope_scaling",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "moe.num_experts": "n_routed_experts",
    "moe.top_k": "num_experts_per_tok", "moe.expert_ffn_dim": "moe_intermediate_size",
    "moe.shared_experts": "n_shared_experts", "moe.n_group": "n_group", "moe.topk_group": "topk_group",
    "moe.norm_topk_prob": "norm_topk_prob", "moe.routed_scaling_factor": "routed_scaling_factor",
    "moe.first_dense_layers": "first_k_dense_replace",
}


def _deepseek(hf: dict, path: Path) -> dict[str, tuple[str, object]]:
    """A deepseek_v3 config.json's model keys (deepseek_fields), each with its source key."""
    if hf.get("quantization_config"):  # float8 blocks with scales: read as plain weights they would be wrong
        _refuse(path, f"its weights are quantized ({hf['quantization_config'].get('quant_method', '?')})",
                "use a bfloat16 or float32 copy of the model (DeepSeek's fp8_cast_bf16 script writes one)")
    if hf.get("rope_interleave") is False:
        _refuse(path, "its config.json has rope_interleave=false; parallel3d's MLA rotates interleaved pairs",
                "use a folder with interleaved RoPE (DeepSeek-V3's own)")
    try:
        fields = deepseek_fields(hf, path)
    except KeyError as e:
        _refuse(path, f"its config.json has no {e.args[0]}", "use a complete config.json (as save_pretrained writes)")
    moe = fields.pop("moe", {"num_experts": 0})
    flat = {**fields, **{f"moe.{key}": value for key, value in moe.items()}}
    return {key: (_DEEPSEEK_KEYS.get(key) or _implied(DEEPSEEK, key), value) for key, value in flat.items()}


def deepseek_fields(config: dict, path: Path) -> dict:
    """A deepseek_v3 ``config.json`` as our model fields (dotted ``model.`` keys without the prefix):
    what ``checkpoint.init_from=HF_DIR`` needs to build the model from the folder alone."""
    layers = config["num_hidden_layers"]
    theta, scaling = _rope(config, path, 10000.0, kinds=("yarn",))
    dense_layers = config.get("first_k_dense_replace", 0)
    fields = {
        "attention": "mla", "dim": config["hidden_size"], "n_layers": layers,
        "n_heads": config["num_attention_heads"], "n_kv_heads": config["num_attention_heads"],
        "ffn_dim": config["intermediate_size"], "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6), "rope_theta": theta,
        "max_seq_len": config.get("max_position_embeddings", 4096),
        "tie_embeddings": config.get("tie_word_embeddings", False),
        "q_lora_rank": config.get("q_lora_rank") or 0, "kv_lora_rank": config["kv_lora_rank"],
        "qk_nope_head_dim": config["qk_nope_head_dim"], "qk_rope_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"], "rope_scaling": scaling,
    }
    if dense_layers < layers:
        fields["moe"] = {
            "num_experts": config["n_routed_experts"], "top_k": config["num_experts_per_tok"],
            "expert_ffn_dim": config["moe_intermediate_size"], "shared_experts": config.get("n_shared_experts", 0),
            "router": "sigmoid", "n_group": config.get("n_group") or 1, "topk_group": config.get("topk_group") or 1,
            "norm_topk_prob": config.get("norm_topk_prob", True),
            "routed_scaling_factor": config.get("routed_scaling_factor", 1.0), "first_dense_layers": dense_layers,
        }
    return fields


def _implied(fam: str, name: str) -> str:
    """How a refusal names a value the family implies: ``model_type=qwen3, so qk_norm``."""
    return f"model_type={fam}, so {name}"


def _rope(hf: dict, path: Path, default_theta: float, kinds=("llama3", "yarn")) -> tuple[float, dict | None]:
    """RoPE theta and scaling (of the types ``kinds``), from transformers 5's ``rope_parameters`` or the
    older top-level ``rope_theta`` and ``rope_scaling``, every field that changes the numbers as
    transformers reads it (``modeling_rope_utils``)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or default_theta)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind not in kinds:
        _refuse(path, f"its config.json has rope type {kind}", f"use a model with default or {' or '.join(kinds)} RoPE")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:  # RoPE on part of each head: not here
        _refuse(path, f"its config.json has partial_rotary_factor={scaling['partial_rotary_factor']}",
                "use a model that rotates whole heads")
    original = int(scaling["original_max_position_embeddings"])
    if kind == "llama3":
        return theta, {"type": "llama3", "factor": float(scaling["factor"]), "original_max_seq_len": original,
                       "low_freq_factor": float(scaling["low_freq_factor"]),
                       "high_freq_factor": float(scaling["high_freq_factor"])}
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original  # transformers' fallback
    attention_factor = scaling.get("attention_factor")
    return theta, {"type": "yarn", "factor": float(factor), "original_max_seq_len": original,
                   "beta_fast": float(scaling.get("beta_fast") or 32.0), "beta_slow": float(scaling.get("beta_slow") or 1.0),
                   "mscale": float(scaling.get("mscale") or 0.0), "mscale_all_dim": float(scaling.get("mscale_all_dim") or 0.0),
                   "truncate": bool(scaling.get("truncate", True)),
                   "attention_factor": None if attention_factor is None else float(attention_factor)}


def _refuse(path: Path, problem: str, fix: str):
    raise ConfigError("checkpoint.init_from", path, problem, fix)


def _effective(key: str, value, model) -> object:
    """A value as the model uses it: head_dim 0 and expert_ffn_dim 0 stand for their defaults, and
    ffn_dim is unused where every block is a MoE."""
    if key == "ffn_dim" and model.get("moe.num_experts") and model.get("moe.every") == 1:
        return None
    if key == "head_dim":
        return value or model["dim"] // model["n_heads"]
    if key == "moe.expert_ffn_dim":
        return value or model["ffn_dim"]
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def disagreements(path: Path, model_cfg, keys=None) -> list[tuple[str, str, object, object]]:
    """``(model key, config.json key, folder's value, model_cfg's value)`` for each of ``keys``
    (default: all the folder decides) on which ``model_cfg`` (a ModelConfig or DictConfig) differs."""
    decided = read_model(path)
    tree = model_cfg if OmegaConf.is_config(model_cfg) else OmegaConf.structured(model_cfg)
    ours = {key: OmegaConf.select(tree, key) for key in decided}
    theirs = {key: value for key, (_, value) in decided.items()}
    return [(key, hf_key, value, ours[key]) for key, (hf_key, value) in decided.items()
            if (keys is None or key in keys)
            and _differs(_effective(key, ours[key], ours), _effective(key, value, theirs))]


def _differs(ours, theirs) -> bool:
    """A value of ours against the folder's; a section (rope_scaling) on the keys the folder gives:
    ours also carries the defaults of keys its type does not read."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return any(ours.get(key) != value for key, value in theirs.items())
    return ours != theirs


def check_agrees(path: Path, model_cfg) -> None:
    """Refuse a model config that is not the folder's (one line naming the first key)."""
    for key, hf_key, theirs, ours in disagreements(path, model_cfg):
        _refuse(path, f"its config.json has {hf_key}={theirs} but model.{key}={ours}",
                f"drop model.{key} (the folder defines the model)")


@contextlib.contextmanager
def named_in_folder(cfg):
    """Validation of the model inside: a refused model key that the Hugging Face folder decided is
    named as its config.json field, and so is the fix (setting the model key would only disagree
    with the folder): ``model.moe.n_group=4: ... Fix: set model.moe.n_group to one of 1, 2`` becomes
    ``checkpoint.init_from=DIR: its config.json has n_group=4: ... Fix: in DIR/config.json, set n_group ...``."""
    try:
        yield
    except ConfigError as e:
        path = hf_folder(cfg)
        decided = read_model(path) if path is not None and e.key.startswith("model.") else {}
        hf_key = decided.get(e.key.removeprefix("model."), ("",))[0]
        if not hf_key or " " in hf_key:  # not the folder's, or a value its family implies
            raise
        fix = e.fix
        for key, (source, _) in sorted(decided.items(), key=lambda item: -len(item[0])):
            if " " not in source:
                fix = fix.replace(f"model.{key}", source)
        raise ConfigError("checkpoint.init_from", path, f"its config.json has {hf_key}={e.value}: {e.problem}",
                          f"in {path / 'config.json'}, {fix}") from e


def apply_hf_folder(cfg, user_keys: set[str]):
    """``cfg`` with the model and tokenizer of the Hugging Face folder ``checkpoint.init_from``
    names (a copy; ``cfg`` itself when it names none). ``user_keys``: dotted keys the user set
    (``model`` alone: a model group chosen on the command line, every model key)."""
    path = hf_folder(cfg)
    if path is None:
        return cfg
    explicit = [k.removeprefix("model.") for k in user_keys if k.startswith("model.")]
    keys = None if "model" in user_keys else {key for key in read_model(path)
                                               if any(k == key or k.startswith(key + ".") for k in explicit)}
    for key, hf_key, theirs, ours in disagreements(path, cfg.model, keys):
        _refuse(path, f"its config.json has {hf_key}={theirs} but model.{key}={ours} was set",
                f"drop model.{key}")
    cfg = copy.deepcopy(cfg)
    values = {"name": path.name, "moe": {}}
    for key, (_, value) in read_model(path).items():
        section, _, name = key.rpartition(".")
        (values["moe"] if section else values)[name] = value
    cfg.model = OmegaConf.merge(cfg.model, values)
    _apply_tokenizer(cfg, path, "data.tokenizer" in user_keys)
    return cfg


def _apply_tokenizer(cfg, path: Path, user_set: bool) -> None:
    if not (path / "tokenizer.json").is_file():
        return  # no tokenizer in the folder: data.tokenizer as configured
    spec = str(cfg.data.tokenizer)
    if not user_set:
        cfg.data.tokenizer = str(path)
    elif spec == "byte" or tokenizer_folder(spec).resolve() != path.resolve() or not tokenizer_file(spec).is_file():
        _refuse(path, f"its tokenizer is {path / 'tokenizer.json'} but data.tokenizer={spec} was set",
                "drop data.tokenizer")


def loaded_line(path: Path, *, n_params: int, tokenizer: str) -> str:
    """The console line that says what was loaded from where."""
    hf = read_config(path)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return (f"parallel3d: model {hf['model_type']} {n_params / 1e6:.2f}M params ({dtype} weights) from {path}, "
            f"tokenizer {tokenizer}")
