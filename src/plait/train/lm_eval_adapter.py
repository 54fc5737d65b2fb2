"""plait's model behind lm-evaluation-harness's model interface (``lm_eval.api.model``).

:class:`PlaitLM` is a ``TemplateLM``: the harness's own code turns (context,
continuation) pairs into token ids (trailing spaces of the context moved to the
continuation, an empty context replaced by the prefix token), and :class:`PlaitLM`
answers the three request types the way the harness's ``HFLM`` does for a causal model:

* ``loglikelihood`` — the sum of the continuation's token log-probabilities and whether
  each of its tokens is the arg-max, the sequence left-truncated to ``max_length + 1``
  tokens (:func:`~plait.train.token_scores.score_sequences`, on the model's layout);
* ``loglikelihood_rolling`` — a document cut into the harness's disjoint rolling windows
  of ``max_length`` tokens (``get_rolling_token_windows``, context 1, the prefix token
  first), their log-likelihoods summed;
* ``generate_until`` — greedy decoding (:func:`~plait.train.sample.sample_tokens`) of at
  most ``max_gen_toks`` tokens, stopped at the end-of-text token or once a stop string
  appears, the text cut at the first stop string; sampling is refused.

The harness's ranks are the data-parallel ranks: ``rank`` is this rank's dp index and
``world_size`` the dp degree, so the harness gives each replica its share of the
requests and every tp, pp and cp rank of a replica gets the same share. ``all_gather``,
``gather_object`` and ``barrier`` are collectives over the dp axis through
:mod:`plait.comm` (an object travels pickled as bytes, padded to the longest); results
are gathered on dp index 0 of every replica coordinate, and the caller reports rank 0's.

Tokens: a Hugging Face folder's tokenizer through ``transformers.AutoTokenizer`` (the
tokenization, special tokens and chat template ``HFLM`` uses), else plait's tokenizer
(byte, tiktoken, a bare ``tokenizer.json``: no special tokens, the end-of-text token as
prefix, no chat template).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

from plait import comm
from plait.errors import ConfigError
from plait.model.generate import SampleSettings
from plait.parallel.model import ParallelModel
from plait.train.sample import sample_tokens
from plait.train.token_scores import max_sequence, score_sequences


class PlainTokenizer:
    """plait's tokenizer (byte, tiktoken, a ``tokenizer.json``) with the methods the
    adapter calls on a ``transformers`` tokenizer."""

    chat_template = None
    bos_token_id = None

    def __init__(self, spec: str) -> None:
        from plait.data import make_tokenizer

        self.inner = make_tokenizer(spec)
        self.name_or_path = spec
        self.eos_token_id = self.inner.eos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (plait's tokenizers add no special tokens)."""
        return [int(i) for i in self.inner.encode(text)]

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (an int or a list); the end-of-text token dropped when asked."""
        ids = [ids] if isinstance(ids, int) else list(ids)
        if skip_special_tokens and self.eos_token_id is not None:
            ids = [i for i in ids if i != self.eos_token_id]
        return self.inner.decode(ids)


def eval_tokenizer(spec: str) -> Any:
    """The tokenizer of ``data.tokenizer`` ``spec`` (see the module docstring)."""
    folder = Path(spec.removeprefix("hf:")) if spec.startswith("hf:") else None
    if folder is not None and folder.is_dir() and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    return PlainTokenizer(spec)


class PlaitLM(TemplateLM):
    """A :class:`ParallelModel` as an lm-evaluation-harness ``LM`` (module docstring)."""

    def __init__(
        self,
        model: ParallelModel,
        tokenizer: Any,
        vocab: int,
        max_seq_len: int,
        batch_size: int = 8,
        max_gen_toks: int = 256,
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.max_length = max_sequence(model, max_seq_len)
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        mesh = model.mesh
        self.dp = mesh.axis("dp")
        self._rank, self._world_size, self._device = self.dp.index, self.dp.size, mesh.device
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer {tokenizer.name_or_path} has no end-of-text token.")

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        """The end-of-text token (generation stops there)."""
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context and each document: BOS, else end-of-text."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's path, for the harness's request cache."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids of ``string``: the tokenizer's own special tokens unless told, and
        none when the string already starts with the prefix token (as ``HFLM``)."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return [int(i) for i in self.tokenizer.encode(string, **special)]

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered by the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"--apply-chat-template: the tokenizer {self.tokenizer.name_or_path} has no "
                "chat template."
            )
        return str(
            self.tokenizer.apply_chat_template(
                chat_history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )
        )

    # ------------------------------------------------------------------ requests

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context."""
        seqs = [(ctx + cont)[-(self.max_length + 1) :] for _, ctx, cont in requests]
        scores = score_sequences(self.model, seqs, self.vocab, self.batch_size)
        out = []
        for (_, _, cont), s in zip(requests, scores, strict=True):
            tail = s[-len(cont) :]  # (len(cont), 2)
            out.append((float(tail[:, 0].sum()), bool(tail[:, 1].all())))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over the harness's rolling windows."""
        windows, owner = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for ctx, pred in map(lm_utils.make_disjoint_window, rolling):
                windows.append((None, list(ctx), list(pred)))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[k] += logp
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop string."""
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        out = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise ConfigError(
                    f"plait eval --tasks decodes greedily; the task asks to sample ({gen_kwargs})."
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            new = int(kwargs["max_gen_toks"])
            prompt = self.tok_encode(context)[-(self.max_length - new) :]
            out.append(self._generate(prompt, new, until))
        return out

    def _generate(self, prompt: list[int], new: int, until: Sequence[str]) -> str:
        """Greedy tokens after ``prompt`` until the end-of-text token or a stop string."""
        eot, stops = self.eot_token_id, [u for u in until if u]

        def stop(tokens: list[int]) -> bool:
            if tokens[-1] == eot:
                return True
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(u in text for u in stops)

        sample = sample_tokens(self.model, prompt, SampleSettings(max_new_tokens=new), stop=stop)
        text = self.tokenizer.decode(sample.tokens, skip_special_tokens=True)
        for u in stops:
            text = text.split(u)[0]
        return str(text)

    # ------------------------------------------------------------------ the harness's world

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every dp rank's ``tensor`` concatenated along dim 0 (a scalar as one element)."""
        t = tensor.reshape(-1) if tensor.dim() == 0 else tensor
        out = comm.all_gather(t.to(self._device), self.dp)
        assert isinstance(out, torch.Tensor)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every dp rank's ``obj`` on dp index ``dst`` (None elsewhere), pickled."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        sizes = [int(s) for s in self.all_gather(size).tolist()]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: data.numel()] = data
        every = self.all_gather(buf[None]).cpu()  # (dp, longest)
        if self._rank != dst:
            return None
        return [pickle.loads(bytes(every[i, :n].numpy())) for i, n in enumerate(sizes)]

    def barrier(self) -> None:
        """Wait for every dp rank."""
        comm.barrier(self.dp)
