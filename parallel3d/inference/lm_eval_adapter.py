"""lm-evaluation-harness on a parallel3d model: the model ``parallel3d`` in lm_eval's registry.

    python -m parallel3d.inference.lm_eval_adapter --model parallel3d --model_args checkpoint=RUN_DIR \\
        --tasks hellaswag [any other lm_eval option]

or, in Python, ``import parallel3d.inference.lm_eval_adapter`` (registers it) and
``lm_eval.simple_evaluate(model="parallel3d", model_args="checkpoint=RUN_DIR", tasks=[...])``.
model_args: ``checkpoint`` (a run_dir, checkpoints/ or step_<N> folder, or a Hugging Face folder:
parallel3d/inference/trained.py), ``device``, ``dtype`` (float32, bfloat16), ``max_length``
(default the model's max_seq_len), ``verify``.

The requests are scored as lm_eval's ``hf`` model scores them on the exported folder with its
default settings: strings are encoded as transformers' tokenizer encodes them (the special tokens
its post-processor adds included: Llama 3's BOS; none before a string that starts with the prefix
token), lm_eval's own context/continuation split, the BOS -- else EOS -- token as the prefix of an
empty context and of rolling windows, contexts cut from the left to ``max_length``. One request
per forward (no padding). ``generate_until`` decodes greedily (or with the request's temperature)
with ``parallel3d.inference.generate`` and stops where transformers' generate stops on the
exported folder (its generation_config.json's end tokens), then at the request's ``until``
strings. lm_eval is imported here only: ``pip install parallel3d[eval]``.
"""

from __future__ import annotations

from pathlib import Path

import lm_eval.models  # noqa: F401  (lm_eval's own models, registered before ours: else the registry holds ours alone)
import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from parallel3d.base import DTYPES
from parallel3d.inference.generate import generate
from parallel3d.inference.trained import open_tokenizer, open_trained


@register_model("parallel3d")
class Parallel3dLM(TemplateLM):
    """A trained model and its tokenizer, in one process."""

    def __init__(self, checkpoint: str, device: str | None = None, dtype: str = "float32",
                 max_length: int | None = None, verify: str = "checksum", **kwargs):
        super().__init__()
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        trained = open_trained(Path(checkpoint), device=self._device, dtype=DTYPES[dtype], verify=verify)
        if trained.tokenizer_spec is None:
            raise ValueError(f"{trained.origin} has no tokenizer.json: lm_eval needs the model's tokenizer")
        self.model, self.tok = trained.model, open_tokenizer(trained.tokenizer_spec)
        self.end_ids = trained.end_ids(self.tok)
        self.max_length = int(max_length or self.model.cfg.max_seq_len)

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

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log P(continuation | context) and whether greedy decoding would give the continuation."""
        window = (context + continuation)[-(self.max_length + 1):]
        inputs = torch.tensor([window[:-1]], device=self.device)
        logits = self.model(inputs)[0, -len(continuation):].float()
        target = torch.tensor(continuation, device=self.device)
        logprobs = F.log_softmax(logits, dim=-1)
        greedy = bool((logprobs.argmax(dim=-1) == target).all())
        return float(logprobs.gather(1, target[:, None]).sum()), greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for cache_key, context, continuation in tqdm(requests, disable=disable_tqdm, desc="parallel3d"):
            result = self._score(context, continuation)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole string's log-likelihood over disjoint windows of ``max_length`` tokens (as ``hf``)."""
        results = []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="parallel3d rolling"):
            windows = utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                      prefix_token=self.prefix_token_id,
                                                      max_seq_len=self.max_length, context_len=1)
            scores = [self._score(*utils.make_disjoint_window(w))[0] for w in windows]
            total = sum(scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            results.append(total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for context, gen_kwargs in tqdm([r.args for r in requests], disable=disable_tqdm, desc="parallel3d generate"):
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
            # hf encodes contexts in batches: special tokens added unless the first starts with BOS's text
            bos = self.tok.bos_id
            plain = bos is not None and context.startswith(self._token_text(bos))
            prompt = self.tok_encode(context, add_special_tokens=not plain)[-(self.max_length - max_new):]
            ids = generate(self.model, prompt, max_new_tokens=max_new, temperature=temperature, stop_ids=self.end_ids)
            text = self.tok_decode([i for i in ids if i not in self.end_ids])
            for stop in until:
                text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
        return results


def main() -> None:
    """lm_eval's command line with the ``parallel3d`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
