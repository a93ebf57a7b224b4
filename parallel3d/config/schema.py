"""Structured configuration: the schema every Hydra config and recipe is checked against.

The dataclasses below are registered in Hydra's ConfigStore as ``schema``; ``conf/config.yaml``
lists it first in its defaults, so a misspelled key or a value of the wrong type anywhere in a
config group, a recipe or on the command line is a composition error, not a silent no-op.

Recipes live in ``recipes/`` (one YAML file per recipe) and are registered as the config group
``recipe``, so ``recipe=NAME`` selects one. They follow Hydra's "experiment" pattern: a recipe is
a global package that overrides the group defaults and sets values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RopeScaling:
    """RoPE scaling for long contexts: Llama 3.1's frequency-dependent one, or YaRN (DeepSeek-V3)."""

    type: str = "llama3"  # llama3 | yarn
    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_seq_len: int = 8192
    beta_fast: float = 32.0  # yarn: rotations per context below which a channel pair is interpolated
    beta_slow: float = 1.0  # yarn: ... and above which it is kept (a linear ramp between)
    mscale: float = 1.0  # yarn: cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 0.0  # yarn: softmax scale times mscale(factor, mscale_all_dim)^2; 0: neither
    truncate: bool = True  # yarn: the ramp's ends rounded out to whole channel pairs (transformers' default)
    attention_factor: Optional[float] = None  # yarn: what cos/sin are scaled by; None: from the mscales


@dataclass
class MoEConfig:
    """Mixture of experts in the feed-forward of some blocks (parallel3d/models/moe.py, docs/moe.md)."""

    num_experts: int = 0  # 0: a dense model
    top_k: int = 2  # experts each token is routed to
    expert_ffn_dim: int = 0  # hidden size of one expert; 0: model.ffn_dim
    shared_experts: int = 0  # experts every token goes through (one SwiGLU of shared_experts x expert_ffn_dim)
    every: int = 1  # MoE in blocks every-1, 2*every-1, ...; the others stay dense
    aux_loss_coef: float = 0.0  # sequence-wise load-balancing loss added to the training loss
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3: aux-loss-free balancing bias)
    bias_update_rate: float = 1e-3  # sigmoid router: bias step per optimizer step towards even load
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes at most ceil(cf*tokens*top_k/E) per forward
    # DeepSeek-V3 (docs/mla.md): experts in n_group groups; a token picks from its topk_group best groups only
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this
    first_dense_layers: int = 0  # the first N blocks stay dense (DeepSeek's first_k_dense_replace)


@dataclass
class LoRAConfig:
    """Low-rank adapters on a frozen base (parallel3d/models/lora.py, docs/finetune.md, LoRA)."""

    rank: int = 0  # 0: off (every parameter trains)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (training only)
    # Projections that get adapters where the model has them: wq wk wv wo (attention), wq_a wq_b wkv_a
    # wkv_b (multi-head latent attention), w1 w2 w3 (SwiGLU, shared experts included), or Hugging
    # Face's names for them (q_proj ... kv_b_proj, gate_proj down_proj up_proj).
    targets: list[str] = field(default_factory=lambda: ["wq", "wq_a", "wq_b", "wk", "wv", "wkv_a", "wkv_b", "wo",
                                                        "w1", "w2", "w3"])


@dataclass
class ModelConfig:
    name: str = "tiny"
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    head_dim: int = 0  # channels per attention head; 0: dim // n_heads (Qwen3 sets 128 explicitly)
    qk_norm: bool = False  # Qwen3: RMSNorm of each query and key head before RoPE
    # gqa: grouped-query attention; mla: DeepSeek's multi-head latent attention (models/mla.py, docs/mla.md)
    attention: str = "gqa"
    q_lora_rank: int = 0  # mla: rank of the query's low-rank projection; 0: a full-rank wq
    kv_lora_rank: int = 512  # mla: width of the compressed key/value latent
    qk_nope_head_dim: int = 128  # mla: channels per query/key head without RoPE
    qk_rope_head_dim: int = 64  # mla: channels per head with RoPE (the key's shared by all heads)
    v_head_dim: int = 128  # mla: channels per value head
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    init_std: float = 0.02
    activation_checkpoint: str = "none"  # none | full | selective (every Nth block) | op (save matmuls)
    activation_checkpoint_every: int = 2
    compile: bool = False  # torch.compile each transformer block and the loss


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.dim // m.n_heads


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: every rank left over after dp_replicate, tp and pp
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: ranks that split each sequence (parallel/context.py)
    cp_method: str = "alltoall"  # alltoall (Ulysses, heads) | ring (k/v blocks around the cp ranks)
    ep: int = 1  # expert parallelism: MoE experts split over ep of the dp_shard ranks (parallel/expert.py)
    # 0 = DDP, 1 = + optimizer state sharded, 2 = + gradients (SHARD_GRAD_OP), 3 = + parameters
    zero_stage: int = 3
    # Hugging Face Accelerate's names, for users who arrive with them. When set, it decides
    # zero_stage: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2.
    fsdp_sharding_strategy: Optional[str] = None
    sequence_parallel: bool = True  # under tp: split norms and the residual stream along the sequence
    fsdp_wrap: str = "block"  # block: one FSDP unit per transformer block; size: by fsdp_min_params
    fsdp_min_params: int = 100_000_000
    fsdp_prefetch: int = 0  # explicit forward/backward prefetch of N blocks; 0 = FSDP's default
    cpu_offload: bool = False
    pp_schedule: str = "1F1B"
    # Microbatches per schedule step; default: all of a rank's micro batches in one step. Fewer
    # (a divisor) runs several schedule steps per optimizer step: gradient accumulation.
    pp_microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None  # looped schedules: default 2; V schedules: always 2
    pp_layers_per_stage: Optional[list[int]] = None  # blocks per stage; default: even, embedding/output count as 1


@dataclass
class TrainConfig:
    steps: int = 40
    global_batch_size: int = 16  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: int = 2  # sequences per forward/backward on one rank
    seq_len: int = 64
    seed: int = 0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (the norm is still logged)
    device: str = "auto"  # auto | cpu | cuda
    param_dtype: str = "float32"  # compute dtype of parameters: float32 | bfloat16 | float16
    reduce_dtype: str = "float32"  # dtype of gradient reduction across data-parallel ranks
    dist_timeout_s: int = 300  # a collective that waits longer fails instead of hanging
    save_model: bool = False  # write a Hugging Face folder run_dir/hf/ (weights, config, tokenizer) at the end
    # Float8 matmuls through torchao (docs/float8.md): none | tensorwise | rowwise. Emulated on the CPU.
    float8: str = "none"
    float8_skip_small: bool = True  # skip linears torchao's H100 tables say lose in float8 (false: all but the head)
    float8_fsdp_all_gather: bool = False  # FSDP all-gathers weights in float8 (tensorwise; scales precomputed)
    # A step with a non-finite loss or grad norm, or a grad-norm spike, is bad (parallel3d/runtime/guard.py,
    # docs/troubleshooting.md): stop (one line naming it, exit 3) | skip (no update on any rank).
    on_bad_step: str = "stop"
    spike_factor: float = 0.0  # bad: grad norm > this x the median of the last 100 good steps; 0 = off
    max_bad_steps: int = 5  # under skip: this many bad steps in a row roll back to the newest checkpoint


@dataclass
class MuonConfig:
    """``optim.name=muon``: torch.optim.Muon's settings for the blocks' matrices (docs/optimizers.md);
    AdamW, with the keys above, takes every other parameter."""

    lr: Optional[float] = None  # peak lr of the Muon group; null: optim.lr (the schedule drives both)
    weight_decay: Optional[float] = None  # decoupled, lr-scaled as AdamW's; null: optim.weight_decay
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    eps: float = 1e-7
    ns_steps: int = 5
    # match_rms_adamw: update RMS as AdamW's, so optim.lr serves both; original: Keller Jordan's
    # sqrt(max(1, rows/cols)), which wants its own, larger, optim.muon.lr (e.g. 0.02).
    adjust_lr_fn: str = "match_rms_adamw"


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon for the blocks' matrices, AdamW for the rest)
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Parameter-name glob patterns exempt from weight decay: norm gains (and biases, which the
    # Llama model has none of). Add "*tok_embeddings*" to exempt the embedding too (docs/configuration.md).
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias"])
    implementation: str = "auto"  # auto (fused where torch has the kernel) | fused | foreach | for_loop
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1  # final lr / peak lr for cosine and wsd
    decay_fraction: float = 0.2  # wsd: the last fraction of steps decays linearly
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib: the Python standard library's source; file: a prepared token file
    path: Optional[str] = None  # token file written by parallel3d-prepare-data (source=file)
    tokenizer: str = "byte"  # byte, a Hugging Face tokenizer.json or its folder; init_from=HF_DIR: that folder
    max_bytes: int = 8_000_000  # stdlib corpus: stop after this much text
    cache_dir: str = "~/.cache/parallel3d"  # also where data.sources are tokenized to (keyed by content)
    # Files to train on (docs/data.md): .jsonl/.jsonl.gz/.json, .parquet, folders or globs of them,
    # datasets.save_to_disk folders, text folders. Empty: data.source (stdlib or a token file).
    sources: list[str] = field(default_factory=list)
    weights: Optional[list[float]] = None  # one per source; default: proportional to each source's tokens
    text_field: str = "text"
    document_masking: bool = False  # attention stays inside each document (block-causal)
    reset_positions: bool = False  # RoPE positions restart at each document
    # Resume a checkpoint trained with another tokenizer (its embeddings index other tokens): refused unless set.
    allow_tokenizer_change: bool = False
    # Instruction data (docs/finetune.md): text | prompt_response (two fields) | chat (a "messages" list)
    format: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    chat_template: Optional[str] = None  # a Jinja file; default: the tokenizer folder's own template
    train_on: str = "assistant"  # prompt_response/chat: assistant (replies and their end of turn) | all
    packing: bool = True  # several samples per row (each attends only to itself); false: one sample per row
    truncation: str = "truncate"  # a sample over train.seq_len + 1 tokens: truncate (keep its start) | drop


@dataclass
class EvalConfig:
    """Held-out data for validation loss (parallel3d/data/corpus.py open_eval_corpus)."""

    sources: list[str] = field(default_factory=list)  # held-out files, read like data.sources
    fraction: float = 0.0  # else: this fraction of data.sources' documents, held out by a stable hash
    every: int = 0  # evaluate every N steps and at the last step; 0: at the last step only
    batches: int = 4  # global batches per evaluation


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "parallel3d"
    entity: Optional[str] = None
    name: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    mode: Optional[str] = None  # online | offline | disabled; None: offline unless an API key is set


@dataclass
class LoggingConfig:
    log_every: int = 1
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = False  # the metrics also as TensorBoard scalars under run_dir/tensorboard/ (rank 0)
    # A rank whose step time is over straggler_factor x the ranks' median for straggler_steps
    # logged steps in a row is named on the console (docs/observability.md); 0 turns it off.
    straggler_factor: float = 2.0
    straggler_steps: int = 3


@dataclass
class ProfileConfig:
    """torch.profiler traces and CUDA memory snapshots of chosen steps (docs/observability.md)."""

    steps: list[int] = field(default_factory=list)  # [first, last] step to record; empty: off
    ranks: Optional[list[int]] = None  # the ranks that record; None: all
    record_shapes: bool = False
    with_stack: bool = False
    memory: bool = False  # CUDA memory history of the profiled steps, and a snapshot on out-of-memory
    top_ops: int = 10  # operators in each rank's summary


@dataclass
class DebugConfig:
    """Test-only faults, to show that the run notices them."""

    nan_steps: list[int] = field(default_factory=list)  # every rank's loss and gradients NaN at these steps
    slow_rank: Optional[int] = None  # this rank computes slow_rank_s longer every step
    slow_rank_s: float = 0.2
    # One process only: every gradient, after backward, gets Gaussian noise of this size relative to
    # its tensor's root mean square (seeded by train.seed, grad_noise_draw and the step). The parity
    # tests train their one-process reference once with it to measure how far float32 round-off
    # carries (tests/harness/tolerance.py); another draw is another sample of that noise.
    grad_noise: float = 0.0
    grad_noise_draw: int = 0
    # Fault tolerance (ft.enabled): this group's part of the cross-group all-reduce fails at these steps
    # (every group then discards the step, under DiLoCo the sync's period, and trains it again); a step
    # after one with fewer than ft.replicas groups waits ft_alone_sleep_s first (survivors slow enough
    # for a restarted group to rejoin them while they keep stepping).
    ft_fail_steps: list[int] = field(default_factory=list)
    ft_alone_sleep_s: float = 0.0


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (and at the last step); 0: no checkpoints
    keep_last: int = 3  # complete checkpoints kept, newest first; 0 keeps all
    async_save: bool = False  # write in a background thread while training goes on
    # auto: continue from the newest complete checkpoint in run_dir/checkpoints; none: start
    # afresh; or a path to a checkpoint (step_<N>/), a checkpoints/ folder or a run_dir.
    resume: str = "auto"
    # Initial weights for a fresh start: a checkpoint (a seed checkpoint, say) or a Hugging Face
    # folder (config.json + *.safetensors), which then also defines model.* and data.tokenizer
    # (parallel3d/config/hf_folder.py). Model weights only; ignored when resuming.
    init_from: Optional[str] = None
    create_seed: bool = False  # initialize, save checkpoints/step_0 (weights only) and stop
    # Before a checkpoint is loaded its files are checked against its manifest.json: checksum
    # (sizes and hashes), size (sizes only), none. One that fails is never loaded.
    verify: str = "checksum"


@dataclass
class SlurmConfig:
    """How ``parallel3d-slurm`` writes the batch job; training itself ignores these keys."""

    nodes: int = 1
    gpus_per_node: int = 8  # 0: a CPU cluster (then set nproc_per_node)
    nproc_per_node: Optional[int] = None  # ranks per node; default: gpus_per_node
    cpus_per_task: Optional[int] = None  # cores for each node's torchrun (one task per node)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = "04:00:00"
    job_name: Optional[str] = None  # default: the recipe's name
    exclusive: bool = True  # whole nodes: no other job shares their GPUs or network
    # Preemption and node failure requeue the job; so does the time limit (the script asks for
    # its own requeue shortly before). Every attempt resumes from the newest checkpoint in run_dir.
    requeue: bool = True
    requeue_grace_s: int = 180  # seconds before the time limit at which the job requeues itself
    max_restarts: int = 0  # torchrun restarts of the workers inside one allocation
    rdzv_port: int = 29500  # c10d rendezvous on the allocation's first node
    network_interface: Optional[str] = None  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, e.g. ib0
    env: dict[str, str] = field(default_factory=dict)  # exported before srun
    setup: list[str] = field(default_factory=list)  # shell lines before srun: module load, venv ...
    srun_args: list[str] = field(default_factory=list)  # e.g. pyxis: --container-image=...
    extra_sbatch: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. --mem=0
    python: Optional[str] = None  # the interpreter on the nodes; default: the one submitting


@dataclass
class DilocoConfig:
    """``ft.semi_sync=diloco``: each group takes inner_steps optimizer steps alone, then the groups
    average how far they moved (the pseudo-gradient) and take one outer Nesterov step together."""

    inner_steps: int = 20  # local steps between two synchronizations (H)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


@dataclass
class FTConfig:
    """Fault tolerance across replica groups through torchft (parallel3d/ft/, docs/fault-tolerance.md):
    each group is its own torchrun job with its own run_dir; the groups average gradients every step."""

    enabled: bool = False
    lighthouse: Optional[str] = None  # http://HOST:PORT of parallel3d-lighthouse; None: $TORCHFT_LIGHTHOUSE
    replica_id: int = 0  # this group's index, 0..replicas-1: it trains that slice of every global batch
    replicas: int = 2  # replica groups of the run: the global batch is cut into this many slices
    min_replicas: int = 1  # a step commits only with at least this many groups in its quorum
    semi_sync: str = "none"  # none: gradients averaged every step | diloco: every ft.diloco.inner_steps
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    timeout_s: float = 60.0  # a cross-group collective, a commit vote or a heal that takes longer fails the step
    quorum_timeout_s: float = 60.0  # no quorum from the lighthouse within this: one line, exit
    connect_timeout_s: float = 10.0  # reaching the lighthouse and the peers' managers


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    run_dir: str = "${hydra:runtime.output_dir}"
    recipe: Optional[str] = None  # the recipe's name, set by the recipe itself


