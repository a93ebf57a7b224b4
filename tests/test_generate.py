"""Generation (parallel3d-generate, the model's KV cache), lm-evaluation-harness and
parallel3d-evaluate on a fine-tuned model, as a user runs them.

One SFT run serves them all: a tiny Llama 3 Instruct made here as a Hugging Face folder (its
tokenizer adds BOS, eos is <|end_of_text|>, turns end with <|eot_id|>, generation_config.json
stops at both) fine-tuned on chat records in one process, with a checkpoint, held-out chats and
``train.save_model`` (run_dir/hf/). Greedy generation from the checkpoint, from the exported folder
and from a run_dir that kept only hf/ must give the ids transformers' generate gives on that
folder with its own end tokens; lm_eval's loglikelihoods through our adapter must equal those of
lm_eval's own ``hf`` model on it; parallel3d-evaluate at dp2 must give the val_loss training
logged. The KV cache must give the full forward's logits (dense and MoE), a left-padded batch the
ids of each prompt alone (also from a --prompts-file, against transformers' per prompt; and lm_eval
in batches the hf model's one-by-one loglikelihoods), and a Qwen3-MoE model the tokens of
transformers' Qwen3MoeForCausalLM.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.chat_files import chat_records, llama3_instruct_folder, write_jsonl
from harness.runs import RUN_TIMEOUT_S, env, launch, relative_error
from omegaconf import OmegaConf
from harness.tolerance import ONE_PASS

from parallel3d.cli import generate as generate_cli
from parallel3d.config.compose import compose
from parallel3d.config.schema import ModelConfig
from parallel3d.data.tokenizer import load_tokenizer
from parallel3d.hf import families
from parallel3d.inference.generate import generate, load_model
from parallel3d.inference.trained import open_trained
from parallel3d.models import Transformer
from parallel3d.models.kv_cache import KVCache

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROMPT = "What is the capital of France?"
STEPS = 20


class Trained:
    """The SFT run (checkpoint at its last step, val_loss there) and its Hugging Face export, made once."""

    def __init__(self, root: Path):
        self.base = llama3_instruct_folder(root / "llama3")
        data = write_jsonl(root / "chats.jsonl", chat_records(90))
        # Held-out chats that also carry a 'text' field: scored on their assistant tokens, not as text.
        heldout = write_jsonl(root / "heldout.jsonl", [r | {"text": "not what is scored"}
                                                       for r in chat_records(40, seed=1)])
        self.run = launch(root / "run", [
            f"checkpoint.init_from={self.base}", "data.format=chat", f"data.sources=[{data}]",
            f"data.cache_dir={root / 'cache'}", f"eval.sources=[{heldout}]", "eval.batches=1", f"eval.every={STEPS}",
            f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8", "train.seq_len=64",
            "optim.lr=3e-3", "optim.warmup_steps=2", "optim.eps=1e-6", f"checkpoint.every={STEPS}",
            "train.save_model=true"])
        self.run.assert_finished(STEPS)
        self.step_dir = self.run.run_dir / "checkpoints" / f"step_{STEPS}"
        self.export = self.run.run_dir / "hf"
        self.tokenizer = load_tokenizer(str(self.base))


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


@pytest.mark.parametrize("overrides", [[], ["model=tiny_moe"], ["model=tiny_mla"]], ids=["dense", "moe", "mla"])
def test_a_left_padded_batch_generates_what_each_prompt_does_alone(overrides):
    """Prompts of 1 to 30 tokens, decoded 5 at a time (left-padded, rows leaving the batch as they
    stop at their own end ids): each row's ids are those of the prompt alone, greedy and sampled."""
    from parallel3d.inference.generate import generate_in_batches

    model = random_model([*overrides, "model.init_std=0.2"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 30, 7, 19, 3, 12, 25, 9, 2, 16, 30)]
    stops = {generate(model, prompts[1], max_new_tokens=5)[-1]}  # an id one row reaches, not every row
    alone = [generate(model, p, max_new_tokens=20, stop_ids=stops) for p in prompts]
    assert generate_in_batches(model, prompts, batch_size=5, max_new_tokens=20, stop_ids=stops) == alone
    assert 0 < sum(len(ids) < 20 for ids in alone) < len(prompts)  # some rows stop early, some run on
    sampled = [generate(model, p, max_new_tokens=6, temperature=1.0, seed=4 + i) for i, p in enumerate(prompts)]
    assert generate_in_batches(model, prompts, batch_size=4, max_new_tokens=6, temperature=1.0, seed=4) == sampled


@pytest.mark.fast
def test_the_cache_refuses_tokens_past_its_length():
    model = random_model([])
    with pytest.raises(ValueError, match="holds 4 tokens"), torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=KVCache(max_len=4))


# -- greedy tokens equal transformers' --------------------------------------------------------

def hf_greedy(model, prompt: list[int], new_tokens: int, eos="folder") -> list[int]:
    """transformers' greedy ids after ``prompt``: stopping where the folder's generation_config.json
    says, or at ``eos`` (None: nowhere)."""
    stop = {} if eos == "folder" else {"eos_token_id": eos}
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **stop)
    return out[0, len(prompt):].tolist()


def printed_ids(capsys) -> list[int]:
    return [int(t) for t in capsys.readouterr().out.split()]


def test_generate_equals_transformers_greedy(trained, capsys):
    """Plain generation stops where the exported folder says (<|eot_id|>, which is not eos), as
    transformers' generate does on it, from the checkpoint, the folder and a run_dir with only hf/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(trained.export, dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(trained.export)(PROMPT)["input_ids"]  # BOS first, as training's
    assert prompt == [trained.tokenizer.bos_id, *trained.tokenizer.encode(PROMPT)]
    # 32 tokens whatever comes: no stop
    ours = generate(load_model(trained.step_dir), prompt, max_new_tokens=32)
    assert len(ours) == 32
    assert ours == hf_greedy(reference, prompt, 32, eos=None)
    expected = hf_greedy(reference, prompt, 32)
    eot = trained.tokenizer.token_id("<|eot_id|>")
    assert expected[-1] == eot != trained.tokenizer.eos_id and len(expected) < 32  # the run exercises the stop
    only_hf = trained.run.run_dir.parent / "only_hf"  # a run_dir that kept no checkpoint, only its export
    shutil.copytree(trained.export, only_hf / "hf", dirs_exist_ok=True)
    for model in (trained.run.run_dir, trained.export, only_hf):
        assert generate_cli.main([str(model), "--prompt", PROMPT, "--max-new-tokens", "32", "--token-ids"]) == 0
        assert printed_ids(capsys) == expected, model
    assert generate_cli.main([str(trained.step_dir), "--prompt", PROMPT, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == trained.tokenizer.decode([t for t in expected[:4] if t != eot]) + "\n"
    batched_prompts_equal_transformers(trained, reference, only_hf, capsys)


PROMPTS = [PROMPT, "Tell me a joke about the lazy dog", "Why", "The quick brown fox jumps over the lazy dog. " * 3]


def batched_prompts_equal_transformers(trained, reference, only_hf, capsys):
    """--prompts-file at --batch-size 3: one line per prompt, in order, each the ids of that prompt
    alone (ours and transformers'), each stopping at any of the end ids on its own: the run's
    (where this chat-tuned model ends a plain prompt within two tokens), then those of a folder of
    the base model whose end ids are two tokens the rows reach at different steps."""
    prompts = [[trained.tokenizer.bos_id, *trained.tokenizer.encode(text)] for text in PROMPTS]
    prompts.insert(2, prompts[0][:4])  # a prompt given as ids
    records = [{"prompt": text} for text in PROMPTS]
    records.insert(2, {"prompt_ids": prompts[2]})
    file = write_jsonl(only_hf.parent / "prompts.jsonl", records)
    opened = open_trained(trained.run.run_dir)  # its newest checkpoint
    stops = opened.end_ids(trained.tokenizer)
    expected = [hf_greedy(reference, ids, 16) for ids in prompts]
    assert [generate(opened.model, ids, max_new_tokens=16, stop_ids=stops) for ids in prompts] == expected  # alone
    # the untrained base model (it does not end every prompt at once) in a folder whose end ids are
    # two tokens its rows reach at different steps
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(trained.base, dtype=torch.float32).eval()
    free = [hf_greedy(base, ids, 16, eos=None) for ids in prompts]
    ends = sorted({free[0][6], free[3][11]})
    folder = only_hf.parent / "other_ends"
    shutil.copytree(trained.base, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    other = [hf_greedy(base, ids, 16, eos=ends) for ids in prompts]
    assert len({len(ids) for ids in other}) > 2 and min(map(len, other)) < 16, (free, other)  # own steps
    for model, ids in ((trained.run.run_dir, expected), (trained.export, expected), (only_hf, expected),
                       (folder, other)):
        assert generate_cli.main([str(model), "--prompts-file", str(file), "--batch-size", "3",
                                  "--max-new-tokens", "16", "--token-ids"]) == 0
        assert [[int(t) for t in line.split()] for line in capsys.readouterr().out.splitlines()] == ids, model
    assert generate_cli.main([str(folder), "--prompts-file", str(file), "--max-new-tokens", "16"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [
        trained.tokenizer.decode([t for t in ids if t not in ends]) for ids in other]


def test_chat_prompt_equals_transformers_chat_template(trained, capsys):
    """--chat: the prompt as transformers' apply_chat_template renders a user turn (the assistant's
    turn opened), and generation stops where transformers' generate stops."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(trained.export)
    reference = AutoModelForCausalLM.from_pretrained(trained.export, dtype=torch.float32).eval()
    for text in (PROMPT, "Tell me a joke about the lazy dog"):
        prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]
        for model in (trained.run.run_dir, trained.export):
            assert generate_cli.main([str(model), "--prompt", text, "--chat", "--max-new-tokens", "16",
                                      "--token-ids"]) == 0
            assert printed_ids(capsys) == hf_greedy(reference, prompt, 16), (model, text)


def test_the_run_says_what_it_tokenizes(trained):
    """First use of data.sources inside a run: a line before the work and one per shard after it."""
    out = trained.run.stdout
    assert out.count("parallel3d: tokenizing 1 of 1 shards into ") == 2  # the chats, then the held-out ones
    assert f"parallel3d: tokenized {trained.run.run_dir.parent / 'chats.jsonl'} (90 record, " in out


@pytest.mark.fast
def test_end_tokens_are_the_folders(tmp_path):
    """A folder's end tokens are generation_config.json's eos_token_id (an id or a list), else
    config.json's, as transformers reads them; a run's are those its export writes."""
    from parallel3d.inference.trained import folder_end_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert folder_end_ids(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert folder_end_ids(tmp_path) == {3, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert folder_end_ids(tmp_path) == {5}


def test_help_says_what_it_reads(capsys):
    with pytest.raises(SystemExit):
        generate_cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Hugging Face folder" in text and "run_dir/hf/" in text and "generation_config.json" in text


def test_sampling_is_seeded_and_top_p_narrows_it(trained):
    model, prompt = load_model(trained.step_dir), trained.tokenizer.encode_with_special_tokens(PROMPT)

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


@pytest.mark.fast
def test_the_command_line_says_what_is_wrong(tmp_path, capsys):
    assert generate_cli.main([str(tmp_path), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "no complete checkpoint there and no Hugging Face folder (hf/" in err and "Fix: name" in err
    assert generate_cli.main([str(tmp_path / "typo"), "--prompt", "x"]) == 1
    assert f"{tmp_path / 'typo'}: no such file or folder" in capsys.readouterr().err
    prompts = tmp_path / "prompts.jsonl"  # refused before any model is read
    prompts.write_text('{"prompt": "a"}\n\n{"text": "b"}\n')
    assert generate_cli.main([str(tmp_path), "--prompts-file", str(prompts)]) == 1
    err = capsys.readouterr().err
    assert f'{prompts} line 3: not a JSON object with "prompt" (text) or "prompt_ids"' in err and "Fix: " in err
    assert len(err.strip().splitlines()) == 1


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


def harness_samples(model: str, model_args: str, tasks: Path, batch_size: int = 1) -> tuple[dict, dict]:
    """lm_eval.simple_evaluate's results and each task's per-request outputs."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import parallel3d.inference.lm_eval_adapter  # noqa: F401  (registers the parallel3d model)

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks)), batch_size=batch_size)
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
    # ours in batches of 3 (padded, a partial last batch), lm_eval's hf model one request at a time
    ours, our_samples = harness_samples("parallel3d", f"checkpoint={trained.run.run_dir}", tasks, batch_size=3)
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


# -- parallel3d-evaluate ------------------------------------------------------------------------

@pytest.mark.multirank
def test_evaluate_an_sft_checkpoint_at_dp2(trained):
    """parallel3d-evaluate on the SFT run's checkpoint at dp2: the held-out chats rendered and
    scored on their assistant tokens as training did (not as the 'text' they also carry), so the
    val_loss training logged at that step, in a metrics line of its own run_dir."""
    run_dir = trained.run.run_dir
    logged = next(r["val_loss"] for r in trained.run.metrics if r["step"] == STEPS)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "parallel3d.cli.evaluate", str(trained.step_dir), "parallel.dp_shard=2",
                           "train.micro_batch_size=2"],
                          capture_output=True, text=True, env=env(), cwd=run_dir.parent, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_dir / "eval" / f"step_{STEPS}" / "metrics.jsonl"
    [line] = [json.loads(row) for row in out.read_text().splitlines()]
    assert line["step"] == STEPS and line["layout"]["dp_shard"] == 2
    assert relative_error([line["val_loss"]], [logged]) <= ONE_PASS  # one pass over the held-out data
    assert f"evaluated step_{STEPS}" in proc.stdout  # the progress line of a long evaluation
    assert "FutureWarning" not in proc.stderr  # our collectives use torch's current names
