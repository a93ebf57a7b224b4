"""Generation (parallel3d-generate, the model's KV cache) and lm-evaluation-harness on checkpoints.

One tiny Llama trains 10 steps in one process with a Hugging Face tokenizer made here (no hub),
is exported with parallel3d-convert-hf, and must generate, greedily, the ids transformers'
generate gives on the exported folder; lm_eval's loglikelihoods through our adapter must equal
those of lm_eval's own ``hf`` model on that folder. The KV cache must give the full forward's
logits (dense and MoE), and a Qwen3-MoE model the tokens of transformers' Qwen3MoeForCausalLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from chat_files import chat_tokenizer_folder
from conftest import FAST, launch
from data_files import documents, write_jsonl
from omegaconf import OmegaConf

from parallel3d.cli import convert_hf
from parallel3d.cli import generate as generate_cli
from parallel3d.config.compose import compose
from parallel3d.config.schema import ModelConfig
from parallel3d.data.tokenizer import load_tokenizer
from parallel3d.hf import families
from parallel3d.inference.generate import generate, load_model
from parallel3d.models import Transformer
from parallel3d.models.kv_cache import KVCache

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
EOS = "<|endoftext|>"
PROMPT = "alpha beta gamma"


class Trained:
    """The tiny Llama's run (checkpoint at step 10) and its Hugging Face export, made once."""

    def __init__(self, root: Path):
        texts = documents("doc", 200)
        # Qwen3-style special tokens and chat template; <|endoftext|> ends documents (and is the
        # folder's eos_token, so transformers and lm_eval agree on it).
        folder = chat_tokenizer_folder(root / "tok", "qwen3")
        config = json.loads((folder / "tokenizer_config.json").read_text()) | {"eos_token": EOS}
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = folder / "tokenizer.json"
        data = write_jsonl(root / "train.jsonl", texts)
        self.run = launch(root / "run", [*FAST, "checkpoint.every=10", f"data.tokenizer={tokenizer}",
                                         f"data.sources=[{data}]", f"data.cache_dir={root / 'cache'}"])
        self.run.assert_finished(10)
        self.step_dir = self.run.run_dir / "checkpoints" / "step_10"
        self.export = root / "hf"
        assert convert_hf.main(["export", str(self.run.run_dir), str(self.export), "--dtype", "float32"]) == 0
        # What transformers' AutoTokenizer needs besides tokenizer.json (exports without it predate item 5).
        if not (self.export / "tokenizer_config.json").is_file():
            shutil.copyfile(folder / "tokenizer_config.json", self.export / "tokenizer_config.json")
        self.tokenizer = load_tokenizer(str(tokenizer))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the harness gives every run (conftest.env): on two shared cores
    more threads make each small forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    return Trained(tmp_path_factory.mktemp("generate"))


def random_model(overrides: list[str]) -> Transformer:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), compose(overrides).model))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return model.eval()


# -- the KV cache -----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [[], ["model=tiny_moe"]], ids=["dense", "moe"])
def test_kv_cache_gives_the_full_forwards_logits(overrides):
    """A prompt through the cache, then one token at a time: the logits of one full forward."""
    model = random_model(overrides)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_len=24)
        pieces = [model(tokens[:, :10], kv_cache=cache)]
        pieces += [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(10, 24)]
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=2e-6)


def test_the_cache_refuses_tokens_past_its_length():
    model = random_model([])
    with pytest.raises(ValueError, match="holds 4 tokens"), torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=KVCache(max_len=4))


# -- greedy tokens equal transformers' --------------------------------------------------------

def hf_greedy(model, prompt: list[int], new_tokens: int, eos: int | None) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_generate_equals_transformers_greedy(trained, capsys):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(trained.export, dtype=torch.float32).eval()
    prompt, eos = trained.tokenizer.encode(PROMPT), trained.tokenizer.eos_id
    # 32 tokens whatever comes: no stop
    ours = generate(load_model(trained.step_dir), prompt, max_new_tokens=32)
    assert len(ours) == 32
    assert ours == hf_greedy(reference, prompt, 32, eos=None)
    # The command line, from the run_dir, stopping at EOS as transformers does.
    assert generate_cli.main([str(trained.run.run_dir), "--prompt", PROMPT, "--max-new-tokens", "32",
                              "--token-ids"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    assert printed == hf_greedy(reference, prompt, 32, eos=eos)
    assert generate_cli.main([str(trained.step_dir), "--prompt", PROMPT, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == trained.tokenizer.decode([t for t in printed[:4] if t != eos]) + "\n"


def test_chat_prompt_equals_transformers_chat_template(trained, capsys):
    """--chat: the prompt as transformers' apply_chat_template renders a user turn (the assistant's
    turn opened), and generation stops at <|im_end|> as well as at the end of text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(trained.export)
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(trained.export, dtype=torch.float32).eval()
    stops = [trained.tokenizer.eos_id, hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert generate_cli.main([str(trained.run.run_dir), "--prompt", PROMPT, "--chat", "--max-new-tokens", "16",
                              "--token-ids"]) == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == hf_greedy(reference, prompt, 16, eos=stops)


def test_sampling_is_seeded_and_top_p_narrows_it(trained):
    model, prompt = load_model(trained.step_dir), trained.tokenizer.encode(PROMPT)

    def sample(seed, top_p=1.0):
        return generate(model, prompt, max_new_tokens=8, temperature=1.0, top_p=top_p, seed=seed)

    assert sample(1) == sample(1) != sample(2)
    assert sample(2, top_p=1e-6) == generate(model, prompt, max_new_tokens=8)  # the nucleus: the top token


def test_moe_greedy_equals_transformers_qwen3_moe(tmp_path):
    """A Qwen3-MoE model (qk_norm, experts in every block) written as a Hugging Face folder and
    read by transformers' Qwen3MoeForCausalLM: the same 32 greedy tokens."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = random_model(["model=tiny_moe", "model.qk_norm=true", "model.init_std=0.2"])
    weights = {key: t.contiguous() for name, p in model.named_parameters()
               for key, t in families.hf_tensors(name, p.detach(), model.cfg).items()}
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(families.hf_config(model.cfg, torch.float32)))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [5, 17, 300, 42, 7]
    assert generate(model, prompt, max_new_tokens=32) == hf_greedy(reference, prompt, 32, eos=None)


def test_the_command_line_says_what_is_wrong(tmp_path, capsys):
    assert generate_cli.main([str(tmp_path), "--prompt", "x"]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


# -- lm-evaluation-harness --------------------------------------------------------------------

TASKS = {
    "p3d_choice": """task: p3d_choice
dataset_path: json
dataset_kwargs: {data_files: {test: %(data)s}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
""",
    "p3d_rolling": """task: p3d_rolling
dataset_path: json
dataset_kwargs: {data_files: {test: %(data)s}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}}"
metric_list: [{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}]
""",
    "p3d_generate": """task: p3d_generate
dataset_path: json
dataset_kwargs: {data_files: {test: %(data)s}}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs: {until: ["gamma"], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
""",
}


def local_tasks(root: Path) -> Path:
    """Three tasks (each lm_eval request type) over a local jsonl: no hub."""
    words = ["alpha", "beta", "gamma", "lorem", "ipsum"]
    rows = [{"question": f"doc {i}: {' '.join(words[(i + j) % 5] for j in range(6))}",
             "choices": [f" {w}" for w in words[:3]], "answer": i % 3} for i in range(4)]
    data = write_jsonl(root / "qa.jsonl", [""] * len(rows))
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, text in TASKS.items():
        (root / f"{name}.yaml").write_text(text % {"data": data})
    return root


def harness_samples(model: str, model_args: str, tasks: Path) -> tuple[dict, dict]:
    """lm_eval.simple_evaluate's results and each task's per-request outputs."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import parallel3d.inference.lm_eval_adapter  # noqa: F401  (registers the parallel3d model)

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks)), batch_size=1)
    samples = {task: [s["resps"] for s in rows] for task, rows in out["samples"].items()}
    return out["results"], samples


def flat(responses) -> list:
    """Every loglikelihood, greedy flag and generated text, in order, of nested responses."""
    if isinstance(responses, (list, tuple)):
        return [leaf for item in responses for leaf in flat(item)]
    return [responses]


def test_lm_eval_through_the_adapter_equals_the_hf_model(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = local_tasks(tmp_path)
    ours, our_samples = harness_samples("parallel3d", f"checkpoint={trained.run.run_dir}", tasks)
    theirs, their_samples = harness_samples("hf", f"pretrained={trained.export},dtype=float32,device=cpu", tasks)
    for task in TASKS:
        flat_ours, flat_theirs = flat(our_samples[task]), flat(their_samples[task])
        assert len(flat_ours) == len(flat_theirs) > 0
        for a, b in zip(flat_ours, flat_theirs):
            if isinstance(a, float):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-5), task
            else:
                assert a == b, task
    assert ours["p3d_choice"]["acc,none"] == theirs["p3d_choice"]["acc,none"]
    assert ours["p3d_rolling"]["word_perplexity,none"] == pytest.approx(theirs["p3d_rolling"]["word_perplexity,none"],
                                                                        rel=1e-5)
