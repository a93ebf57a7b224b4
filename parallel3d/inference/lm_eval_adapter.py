"""lm-evaluation-harness on a parallel3d model: the model ``parallel3d`` in lm_eval's registry.

    python -m parallel3d.inference.lm_eval_adapter --model parallel3d --model_args checkpoint=RUN_DIR \\
        --tasks hellaswag [any other lm_eval option]

or, in Python, ``import parallel3d.inference.lm_eval_adapter`` (registers it) and
``lm_eval.simple_evaluate(model="parallel3d", model_args="checkpoint=RUN_DIR", tasks=[...])``.
model_args: ``checkpoint`` (a run_dir, checkpoints/ or step_<N> folder, or a Hugging Face folder:
parallel3d/inference/trained.py), ``device``, ``dtype`` (float32, bfloat16), ``max_length``
(default the model's max_seq_len), ``verify``; and lm_eval's own ``batch_size`` (an int, or
``auto``: 16).

The requests are scored as lm_eval's ``hf`` model scores them on the exported folder with its
default settings: strings are encoded as transformers' tokenizer encodes them (the special tokens
its post-processor adds included: Llama 3's BOS; none before a string that starts with the prefix
token), lm_eval's own context/continuation split, the BOS -- else EOS -- token as the prefix of an
empty context and of rolling windows, contexts cut from the left to ``max_length``. Requests are
scored ``batch_size`` at a time, right-padded: causal attention never lets a token see the padding
after it, so each row's logits are those it has alone. ``generate_until`` decodes the requests
that share generation settings ``batch_size`` at a time (left-padded:
``parallel3d.inference.generate.generate_in_batches``), greedily or with the request's
temperature, and stops where transformers' generate stops on the exported folder (its
generation_config.json's end tokens), then at the request's ``until`` strings. lm_eval is
imported here only: ``pip install parallel3d[eval]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lm_eval.models  # noqa: F401  (lm_eval's own models, registered before ours: else the registry holds ours alone)
import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from parallel3d.base import DTYPES
from parallel3d.inference.generate import generate_in_batches
from parallel3d.inference.trained import open_tokenizer, open_trained


AUTO_BATCH = 16  # lm_eval's batch_size=auto: no memory probe, a batch that keeps a CPU busy


@register_model("parallel3d")
class Parallel3dLM(TemplateLM):
    """A trained model and its tokenizer, in one process."""

    def __init__(self, checkpoint: str, device: str | None = None, dtype: str = "float32",
                 max_length: int | None = None, verify: str = "checksum", batch_size: int | str | None = 1,
                 **kwargs):
        super().__init__()
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        trained = open_trained(Path(checkpoint), device=self._device, dtype=DTYPES[dtype], verify=verify)
        if trained.tokenizer_spec is None:
            raise ValueError(f"{trained.origin} has no tokenizer.json: lm_eval needs the model's tokenizer")
        self.model, self.tok = trained.model, open_tokenizer(trained.tokenizer_spec)
        self.end_ids = trained.end_ids(self.tok)
        self.max_length = int(max_length or self.model.cfg.max_seq_len)
        self.batch_size = AUTO_BATCH if str(batch_size).startswith("auto") else int(batch_size or 1)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As ``hf``'s tok_encode: the tokenizer's own special tokens added unless told otherwise or
        the string starts with the prefix token's text."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self._token_text(self.prefix_token_id))
        return self.tok.encode_with_special_tokens(string) if add_special_tokens else self.tok.encode(string)

    def _token_text(self, token_id: int) -> str:
        """A special token's text, as transformers' decode(id) writes it (special tokens kept)."""
        return self.tok.token(token_id) if hasattr(self.tok, "token") else self.tok.decode([token_id])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    def _window(self, context: list[int], continuation: list[int]) -> list[int]:
        """The tokens a request is scored on: context and continuation, cut from the left to max_length + 1."""
        return (context + continuation)[-(self.max_length + 1):]

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """log P(continuation | context) of each (context, continuation) and whether greedy decoding
        would give the continuation: one forward over the windows, right-padded."""
        windows = [self._window(context, continuation)[:-1] for context, continuation in pairs]
        width = max(len(w) for w in windows)
        inputs = torch.tensor([w + [0] * (width - len(w)) for w in windows], device=self.device)
        logits = self.model(inputs)
        results = []
        for row, (window, (_, continuation)) in enumerate(zip(windows, pairs)):
            logprobs = F.log_softmax(logits[row, len(window) - len(continuation):len(window)].float(), dim=-1)
            target = torch.tensor(continuation, device=self.device)
            greedy = bool((logprobs.argmax(dim=-1) == target).all())
            results.append((float(logprobs.gather(1, target[:, None]).sum()), greedy))
        return results

    def _score_all(self, pairs: list[tuple[list[int], list[int]]], desc: str,
                   disable_tqdm: bool) -> list[tuple[float, bool]]:
        """``_score_batch`` over all pairs, batch_size at a time, longest first (less padding), in order."""
        order = sorted(range(len(pairs)), key=lambda i: (-len(self._window(*pairs[i])), i))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        with tqdm(total=len(pairs), disable=disable_tqdm, desc=desc) as bar:
            for first in range(0, len(order), self.batch_size):
                chosen = order[first:first + self.batch_size]
                for i, result in zip(chosen, self._score_batch([pairs[i] for i in chosen])):
                    results[i] = result
                bar.update(len(chosen))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score_all([(context, continuation) for _, context, continuation in requests],
                                  "parallel3d", disable_tqdm)
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole string's log-likelihood over disjoint windows of ``max_length`` tokens (as ``hf``)."""
        strings = [string for (string,) in (r.args for r in requests)]
        owners, pairs = [], []
        for index, string in enumerate(strings):
            windows = utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                      prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            for window in windows:
                owners.append(index)
                pairs.append(utils.make_disjoint_window(window))
        totals = [0.0] * len(strings)
        for owner, (score, _) in zip(owners, self._score_all(pairs, "parallel3d rolling", disable_tqdm)):
            totals[owner] += score
        for string, total in zip(strings, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Requests with the same generation settings decoded together, batch_size at a time."""
        groups: dict[str, list[int]] = {}
        for index, (_, gen_kwargs) in enumerate(r.args for r in requests):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(index)
        results: list[str] = [""] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="parallel3d generate") as bar:
            for indices in groups.values():
                for index, text in zip(indices, self._generate_group([requests[i].args for i in indices])):
                    results[index] = text
                bar.update(len(indices))
        return results

    def _generate_group(self, args: list[tuple[str, dict]]) -> list[str]:
        gen_kwargs = args[0][1]
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.get("max_gen_toks", 256))
        temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        # hf encodes contexts in batches: special tokens added unless the first starts with BOS's text
        bos = self.tok.bos_id
        prompts = []
        for context, _ in args:
            plain = bos is not None and context.startswith(self._token_text(bos))
            prompts.append(self.tok_encode(context, add_special_tokens=not plain)[-(self.max_length - max_new):])
        outputs = generate_in_batches(self.model, prompts, batch_size=self.batch_size, max_new_tokens=max_new,
                                      temperature=temperature, stop_ids=self.end_ids)
        texts = []
        for (context, kwargs), ids in zip(args, outputs):
            text = self.tok_decode([i for i in ids if i not in self.end_ids])
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            texts.append(text)
        return texts


def main() -> None:
    """lm_eval's command line with the ``parallel3d`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
