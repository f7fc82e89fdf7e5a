"""lm-evaluation-harness adapter, registered as `nlearn`: any checkpoint scored on lm-eval's tasks.

From the shell, `nlearn-lm-eval --model nlearn --model_args pretrained=RUN_DIR[,step=N,rolling=window]
--tasks ...` (lm-eval's own flags); from Python, `NlearnLM(pretrained=RUN_DIR)` or `NlearnLM(model=...,
tokenizer=...)` passed to `lm_eval.simple_evaluate(model=...)`. Every request is scored as the start of a
document: after the prefix token (the run's eos, which precedes every document of the packed training
stream). Needs the `eval` extra (`pip install 'nlearn[eval]'`).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nlearn.errors import UserError

try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models register before ours, so they stay found)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ModuleNotFoundError as e:  # only lm-eval itself missing is the user's to fix
    if e.name and e.name.split(".")[0] == "lm_eval":
        raise UserError("the lm-eval adapter needs lm-evaluation-harness: pip install 'nlearn[eval]' "
                        "(or 'lm-eval>=0.4.13,<0.5')") from None
    raise

from nlearn.data.tokenizer import Tokenizer, load_tokenizer
from nlearn.eval.generate import sample_logits
from nlearn.eval.scoring import Scorer, bucket_length

log = logging.getLogger(__name__)

ROLLING_MODES = ("stream", "window")
DEFAULT_LENGTH = 512  # window and chunk length of a model given without a config


def _positive_int(name: str, value, allow_zero: bool = False) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        out = -1
    if out < (0 if allow_zero else 1) or (isinstance(value, float) and value != out):
        raise UserError(f"nlearn model argument {name}={value!r}: expected a "
                        f"{'non-negative' if allow_zero else 'positive'} integer")
    return out


@register_model("nlearn")
class NlearnLM(TemplateLM):
    """An nlearn model for lm-eval: a run directory (`pretrained`, `step`) or a model in memory.

    rolling: `loglikelihood_rolling` mode. "stream" feeds a whole document through the model's state in
      chunks of `chunk_size` (constant memory for recurrent families; a full-attention cache keeps every
      token, which is logged); "window" scores lm-eval's disjoint windows of `max_length` tokens, each from a
      fresh state (comparable with any other lm-eval model).
    chunk_size, max_length: tokens per streaming step and per window (0: the run's train.seq_len).
    batch_size: requests per `loglikelihood` batch. prefix_token_id: what every request follows (eos).
    temperature etc. come per request from lm-eval's `gen_kwargs`; `seed` seeds sampled generation.
    model, tokenizer, config: an nnx model (or `(graphdef, params)`), its sentencepiece tokenizer (an nlearn
      Tokenizer, a .model path or a folder holding `tokenizer.model`) and optionally its config (for seq_len).
    max_batch_size and device are accepted because lm-eval's CLI always passes them; JAX picks the device.
    """

    def __init__(self, pretrained: Optional[str] = None, step: Optional[int] = None, *, model=None,
                 tokenizer=None, config=None, rolling: str = "stream", chunk_size: int = 0, max_length: int = 0,
                 batch_size=1, max_batch_size=None, device=None, prefix_token_id: Optional[int] = None,
                 max_gen_toks: int = 256, seed: int = 0, **unknown):
        super().__init__()
        if unknown:
            raise UserError(f"unknown nlearn model argument(s): {', '.join(sorted(unknown))} (expected pretrained, "
                            "step, rolling, chunk_size, max_length, prefix_token_id, max_gen_toks, seed)")
        if jax.process_count() > 1:
            raise UserError(f"the nlearn lm-eval adapter runs in one process; this job has {jax.process_count()} "
                            "(run lm-eval on one host)")
        if rolling not in ROLLING_MODES:
            raise UserError(f"nlearn model argument rolling={rolling!r}: choose one of {', '.join(ROLLING_MODES)}")
        if str(batch_size).startswith("auto"):
            raise UserError("batch_size=auto is not supported by the nlearn model; pass an integer")
        graphdef, params, config, tokenizer, dtype, self.step = self._load(pretrained, step, model, tokenizer,
                                                                           config)
        self._tok = tokenizer
        seq_len = int(config.train.seq_len) if config is not None else DEFAULT_LENGTH
        self._max_length = _positive_int("max_length", max_length, True) or seq_len
        chunk = _positive_int("chunk_size", chunk_size, True) or seq_len
        self.rolling, self.seed = rolling, int(seed)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self._prefix = tokenizer.eos_id if prefix_token_id is None else _positive_int(
            "prefix_token_id", prefix_token_id, True)
        self.scorer = Scorer(graphdef, params, chunk_size=chunk, batch_size=_positive_int("batch_size", batch_size),
                             dtype=dtype)
        self.cache_grows = self.scorer.cache_grows()
        if rolling == "stream" and self.cache_grows:
            log.warning("nlearn: rolling=stream on a model with full attention: its cache keeps every token of "
                        "a document (memory grows with its length); rolling=window bounds it")

    @staticmethod
    def _load(pretrained, step, model, tokenizer, config):
        """(graphdef, params, config or None, Tokenizer, compute dtype, step or None) from the arguments."""
        if (pretrained is None) == (model is None):
            raise UserError("the nlearn model needs exactly one of pretrained=<run directory> or model=<nnx model>")
        if pretrained is not None:
            from nlearn import config as config_lib
            from nlearn.tasks.haystack import text_tokenizer
            from nlearn.eval.restore import load_run_config, restore_params

            config = load_run_config(str(pretrained))
            config_lib.validate(config)
            setup, restored, params = restore_params(
                config, str(pretrained), None if step is None else _positive_int("step", step, True))
            tokenizer = tokenizer if tokenizer is not None else text_tokenizer(config)
            if tokenizer is None:
                raise UserError(f"run {pretrained!r} was trained on token ids ({config.data.source!r}), not text; "
                                "lm-eval's tasks need a text tokenizer")
            graphdef, dtype, step = setup.graphdef, setup.dtype, int(restored)
        else:
            if isinstance(model, tuple):
                graphdef, params = model
            else:
                graphdef, params = nnx.split(model, nnx.Param)
                params = nnx.to_pure_dict(params)
            if tokenizer is None:
                raise UserError("model=... needs tokenizer=<sentencepiece .model path or nlearn Tokenizer>")
            dtype = jnp.float32
        if isinstance(tokenizer, str):  # a .model file, or a folder holding one (nlearn-tokenizer --hf_dir)
            tokenizer = load_tokenizer(os.path.join(tokenizer, "tokenizer.model") if os.path.isdir(tokenizer)
                                       else tokenizer)
        if not isinstance(tokenizer, Tokenizer):
            raise UserError(f"tokenizer must be an nlearn Tokenizer or a .model path, got {type(tokenizer).__name__}")
        return graphdef, params, config, tokenizer, dtype, step

    # ------------------------------------------------------------------ what lm-eval reads

    @property
    def eot_token_id(self) -> int:
        return self._tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self._tok.path or "nlearn-sentencepiece"

    def get_model_info(self) -> dict:
        return {"nlearn_step": self.step, "nlearn_rolling": self.rolling,
                "nlearn_chunk_size": self.scorer.chunk_size, "nlearn_max_length": self.max_length,
                "nlearn_cache_grows": self.cache_grows}

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self._tok.encode(string).tolist()

    def tok_decode(self, tokens) -> str:
        return self._tok.decode(tokens)

    # ------------------------------------------------------------------ requests

    def _encode_pair(self, context: str, continuation: str):
        """lm-eval's split of the pair's tokens, with the prefix before the context (as empty contexts get)."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        return [self.prefix_token_id] + context_enc, continuation_enc

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        scored = [i for i, (_, _, cont) in enumerate(requests) if cont]
        results = self.scorer.pairs([(requests[i][1], requests[i][2]) for i in scored])
        out = [(0.0, True)] * len(requests)  # an empty continuation has probability one
        for i, result in zip(scored, results):
            out[i] = result
            if requests[i][0] is not None:
                self.cache_hook.add_partial("loglikelihood", requests[i][0], result)
        return out

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """lm-eval's disjoint windows of a document's tokens (`max_length` inputs each, the first after the
        prefix): every token is predicted in exactly one window."""
        return list(map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
            token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        docs = [self.tok_encode(req.args[0]) for req in requests]
        if self.rolling == "stream":
            out = [float(self.scorer.document([self.prefix_token_id] + doc)[0].sum()) if doc else 0.0
                   for doc in docs]
        else:
            windows = [self.rolling_windows(doc) for doc in docs]
            flat = self.scorer.pairs([w for doc_windows in windows for w in doc_windows])
            out, at = [], 0
            for doc_windows in windows:
                out.append(float(sum(lp for lp, _ in flat[at: at + len(doc_windows)])))
                at += len(doc_windows)
        for req, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for index, req in enumerate(requests):
            context, gen_kwargs = req.args
            text = self.generate(context, dict(gen_kwargs or {}), index)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def generate(self, context: str, gen_kwargs: dict, index: int = 0) -> str:
        """One continuation of `context` through the decode cache: greedy unless `do_sample` (then
        `temperature`, `top_k`), cut before the first `until` string, at most `max_gen_toks` tokens."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks", self.max_gen_toks))
        temperature = float(gen_kwargs.get("temperature", 1.0)) if gen_kwargs.get("do_sample") else 0.0
        top_k = int(gen_kwargs.get("top_k") or 0)
        streamer = self.scorer.streamer
        prompt = [self.prefix_token_id] + self.tok_encode(context)
        cache = streamer.init_cache(1, bucket_length(len(prompt) + max_new, streamer.chunk_size))
        logits, cache = streamer.prefill(np.asarray([prompt], np.int32), cache)
        rng, new = jax.random.fold_in(jax.random.key(self.seed), index), []
        for i in range(max_new):
            rng, key = jax.random.split(rng)
            token = int(sample_logits(logits, key, temperature, top_k)[0])
            if token == self.eot_token_id:
                break
            new.append(token)
            if any(stop in self.tok_decode(new) for stop in until) or i == max_new - 1:
                break
            logits, cache = streamer.prefill(np.asarray([[token]], np.int32), cache)
        text = self.tok_decode(new)
        for stop in until:
            text = text.split(stop)[0]
        return text
