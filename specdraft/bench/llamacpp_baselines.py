"""llama.cpp baselines for ``specdraft bench --baselines llamacpp`` (through llama-cpp-python).

A CPU user who wants the same model fast runs llama.cpp on the GGUF file, so the bench runs it beside
specdraft on the same prompts:

- ``llamacpp_plain``: ``Llama.generate`` on the target's own GGUF file (the file an alias ships or
  the ``.gguf`` path given), with the same thread count (``n_threads`` = ``n_threads_batch`` =
  torch's), fed the same token ids the engine gets (the chat template applied by specdraft's
  tokenizer; llama.cpp adds no BOS to ids), greedy (``temp=0``: its greedy sampler, an argmax) or
  sampling with the same temperature / top-k / top-p and the prompt's seed.
- ``llamacpp_spec``: the same with llama-cpp-python's own speculative decoding,
  ``LlamaPromptLookupDecoding`` as ``draft_model``: up to k tokens per step with a fixed ``--k``
  (its default of 10 with ``auto``/``heuristic``), matching n-grams up to the ``lookup:N`` draft's
  N (its default 2 otherwise). The Python API has no draft-model speculation, so this is the one
  speculative method it offers.

Every call starts from an empty cache (``Llama.reset``), so llama.cpp prefills each prompt as the
engine does and never reuses the previous method's cache for the same prompt. Each method has its
own ``Llama`` (both map the same file): a ``draft_model`` makes llama-cpp-python keep every
position's logits (``logits_all``), which its plain decoding does not need. The context is sized to
the run's prompt budget plus the generation budget (:meth:`LlamaCppBaselines.load`).

Agreement (greedy, :func:`agreement`: the leading tokens llama.cpp's output shares with specdraft's
plain output) is low on open-ended prompts (0.16 in ``results/llamacpp-2026-12-01``) although both
compute the same model from the same ids: llama.cpp tokenizes the chat-templated text to exactly the
ids fed here (no BOS added; ``tests/bench/test_llamacpp.py``), and fed the same prefixes (teacher
forcing) its argmax agrees with the quantized runtime's at 0.95-0.98 of the positions of four
prompts (each against the exactly de-quantized fp32 model: llama.cpp 0.98-1.00, the quantized runtime
0.95-0.97). On specdraft's own greedy outputs, fed as a prefix, llama.cpp's argmax was specdraft's
token at every position of two Spec-Bench answers (:meth:`LlamaCppBaselines.forced_matches`, the
JSON's ``llamacpp_forced_agreement``), yet its own generation parted at token 3 and 6: there the top
two logits were 0.1 apart, and llama.cpp's one-token decode steps round differently from its batched
evaluation (it is not batch-invariant), so such near-ties flip. ``--baselines bf16`` reports the
free-running agreement of the bf16 runtime's output.

Prefill and decode-only rates (:class:`StepTimes`, ``benchmarks/bench_quant.py``): the issue's decode
target compares specdraft's plain decode rate with llama.cpp's decode-only rate, without
llama-bench (a cmake build). :meth:`LlamaCppBaselines.step_times` drives llama-cpp-python's low-level
API as :func:`runtime_step_times` drives a specdraft runtime: the prompt's ids evaluated in one call
(the prefill, timed), then one token at a time, greedy (the argmax of the last logits, inside the
timed step on both sides), each step timed; no sampler, no engine, no detokenizer on either side.

llama-cpp-python is an optional extra (``make peers``, ~10 minutes of building on 2 cores); without
it ``--baselines llamacpp`` stops with one line saying so (:func:`require`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdraft.errors import SpecdraftError
from specdraft.verify import SamplingParams

LLAMACPP_METHODS = ("llamacpp_plain", "llamacpp_spec")
INSTALL_HINT = "run `make peers` (or pip install 'llama-cpp-python==0.3.36')"
DEFAULT_LOOKUP_TOKENS = 10  # llama-cpp-python's num_pred_tokens default
DEFAULT_LOOKUP_NGRAM = 2  # llama-cpp-python's max_ngram_size default


def require():
    """The ``llama_cpp`` module, or a :class:`SpecdraftError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SpecdraftError(
            f"--baselines llamacpp needs llama-cpp-python, not installed here: {INSTALL_HINT}"
        ) from e
    return llama_cpp


@dataclass
class StepTimes:
    """One prompt's prefill and one-token decode steps, greedy (:func:`runtime_step_times`,
    :meth:`LlamaCppBaselines.step_times`).

    Attributes:
        prompt_tokens: tokens evaluated by the prefill.
        prefill_s: seconds of the prefill call (it gives the first new token's logits).
        decode_s: seconds of each one-token step after it (one per new token but the first).
        tokens: the new tokens, the first (from the prefill's logits) included.
    """

    prompt_tokens: int
    prefill_s: float
    decode_s: list[float]
    tokens: list[int]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.decode_s) / sum(self.decode_s)


def _timed_steps(prefill, step, ids: list[int], new_tokens: int) -> StepTimes:
    """``prefill(ids)`` then ``step(token)`` ``new_tokens - 1`` times, each returning the next
    greedy token and timed on its own."""
    t0 = time.perf_counter()
    tokens = [prefill(ids)]
    prefill_s = time.perf_counter() - t0
    decode_s = []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        tokens.append(step(tokens[-1]))
        decode_s.append(time.perf_counter() - t0)
    return StepTimes(len(ids), prefill_s, decode_s, tokens)


def runtime_step_times(runtime, ids: list[int], new_tokens: int) -> StepTimes:
    """A specdraft runtime's prefill and one-token forwards over ``ids`` (batch 1, greedy), as
    the engine calls them: the last position's logits only."""
    import torch

    state = runtime.new_state(1, len(ids) + new_tokens)
    done = [0]  # tokens in the cache

    @torch.inference_mode()
    def forward(tokens: list[int]) -> int:
        positions = torch.arange(done[0], done[0] + len(tokens)).unsqueeze(0)
        last = torch.tensor([[len(tokens) - 1]])
        out = runtime.forward(state, torch.tensor([tokens]), positions, logits_index=last)
        done[0] += len(tokens)
        return int(out.logits[0, -1].argmax())

    return _timed_steps(forward, lambda t: forward([t]), ids, new_tokens)


@dataclass
class LlamaCppBaselines:
    """llama.cpp plain and prompt-lookup decoding of one GGUF file.

    Attributes:
        gguf: the GGUF file (the target's).
        threads: llama.cpp threads for decoding and for prompt processing.
        eos_ids: stop tokens, the engine's.
        lookup_tokens: ``num_pred_tokens`` of the prompt-lookup draft.
        lookup_ngram: ``max_ngram_size`` of the prompt-lookup draft.
        n_ctx: the context llama.cpp allocates (set by :meth:`load`; 0 before).
        models: the loaded ``Llama`` per method (filled by :meth:`load`).
    """

    gguf: str
    threads: int
    eos_ids: tuple[int, ...]
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS
    lookup_ngram: int = DEFAULT_LOOKUP_NGRAM
    n_ctx: int = 0
    models: dict[str, object] = field(default_factory=dict)
    methods: tuple[str, ...] = LLAMACPP_METHODS

    @property
    def note(self) -> str:
        """One line for the run's config: the version, the file and the draft's settings."""
        llama_cpp = require()
        return (
            f"llama-cpp-python {llama_cpp.__version__} on {self.gguf}, {self.threads} threads, "
            f"n_ctx {self.n_ctx}; spec: LlamaPromptLookupDecoding(num_pred_tokens={self.lookup_tokens}, "
            f"max_ngram_size={self.lookup_ngram})"
        )

    def load(self, n_ctx: int) -> None:
        """Load both ``Llama`` objects with room for ``n_ctx`` tokens (prompt + new tokens + draft)."""
        llama_cpp = require()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.n_ctx = n_ctx
        common = {
            "model_path": self.gguf,
            "n_ctx": n_ctx,
            "n_threads": self.threads,
            "n_threads_batch": self.threads,
            "n_gpu_layers": 0,
            "verbose": False,
        }
        try:
            self.models = {
                "llamacpp_plain": llama_cpp.Llama(**common, logits_all=False),
                "llamacpp_spec": llama_cpp.Llama(
                    **common,
                    logits_all=True,  # as a draft_model forces; sizes its logits buffer to n_ctx rows
                    draft_model=LlamaPromptLookupDecoding(
                        max_ngram_size=self.lookup_ngram, num_pred_tokens=self.lookup_tokens
                    ),
                ),
            }
        except (ValueError, RuntimeError) as e:
            raise SpecdraftError(f"llama.cpp cannot load {self.gguf}: {e}") from e

    def run(self, method: str, ids: list[int], max_new_tokens: int, params: SamplingParams) -> list[int]:
        """Decode one prompt with ``method`` (one of :data:`LLAMACPP_METHODS`); returns the new tokens."""
        if method not in LLAMACPP_METHODS:
            raise ValueError(f"unknown baseline {method!r}")
        if not self.models:
            raise RuntimeError("LlamaCppBaselines.load() first")
        llm = self.models[method]
        if len(ids) + max_new_tokens + self.lookup_tokens + 1 > self.n_ctx:
            raise SpecdraftError(
                f"{len(ids)} prompt + {max_new_tokens} new tokens do not fit llama.cpp's n_ctx {self.n_ctx}"
            )
        if params.greedy:
            sampling = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
        else:
            sampling = {"temp": params.temperature, "top_k": params.top_k or 0, "top_p": params.top_p}
            sampling["min_p"] = 0.0
            llm.set_seed(params.seed or 0)
        llm.reset()  # an empty cache: prefill every prompt, as the engine does
        out: list[int] = []
        for token in llm.generate(ids, repeat_penalty=1.0, reset=True, **sampling):
            out.append(int(token))
            if len(out) >= max_new_tokens or out[-1] in self.eos_ids:
                break
        return out

    def step_times(self, ids: list[int], new_tokens: int) -> StepTimes:
        """llama.cpp's prefill and one-token ``eval`` calls over ``ids`` from an empty cache,
        greedy (the argmax of ``llama_get_logits``), on the plain model (:class:`StepTimes`)."""
        import numpy as np

        llama_cpp = require()
        llm = self.models["llamacpp_plain"]
        if len(ids) + new_tokens > self.n_ctx:
            raise SpecdraftError(
                f"{len(ids)} + {new_tokens} tokens do not fit llama.cpp's n_ctx {self.n_ctx}"
            )

        def evaluate(tokens: list[int]) -> int:
            llm.eval(tokens)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))
            return int(logits.argmax())

        llm.reset()
        return _timed_steps(evaluate, lambda t: evaluate([t]), ids, new_tokens)

    def forced_matches(self, ids: list[int], tokens: list[int]) -> int:
        """How many of ``tokens`` (specdraft's greedy output after ``ids``) are llama.cpp's argmax
        too when it is fed the same prefix (teacher forcing, one batched evaluation): agreement of
        the two models position by position, without the free-running outputs parting at the first
        near-tie. Uses the ``logits_all`` model (the lookup one)."""
        import numpy as np

        if not tokens:
            return 0
        llm = self.models["llamacpp_spec"]
        llm.reset()
        llm.eval(ids + tokens[:-1])
        rows = np.asarray(llm.scores[len(ids) - 1 : len(ids) + len(tokens) - 1])  # (len(tokens), V)
        return int((rows.argmax(-1) == np.asarray(tokens)).sum())


def build_llamacpp_baselines(
    target: str, threads: int, eos_ids: tuple[int, ...], k: int | None, draft_spec: str
) -> LlamaCppBaselines:
    """The llama.cpp baselines for a target given by name (an alias shipping a GGUF, or a ``.gguf`` path).

    Args:
        target: the target's name, as ``--target`` took it.
        threads: thread count (torch's, the engine's).
        eos_ids: the engine's stop tokens.
        k: fixed draft length, or None for llama-cpp-python's default lookup length.
        draft_spec: the run's draft; ``lookup:N`` sets the n-gram size of llama.cpp's lookup.

    Raises:
        SpecdraftError: llama-cpp-python is not installed, or the target is not a GGUF file.
    """
    from specdraft.models.quant import gguf_path
    from specdraft.registry import DraftSpec

    require()
    try:
        path = gguf_path(target)
    except SpecdraftError as e:
        raise SpecdraftError(f"--baselines llamacpp runs the target's GGUF file: {e}") from e
    spec = DraftSpec.parse(draft_spec)
    ngram = int(spec.arg) if spec.kind == "lookup" and spec.arg else DEFAULT_LOOKUP_NGRAM
    return LlamaCppBaselines(str(path), threads, tuple(eos_ids), k or DEFAULT_LOOKUP_TOKENS, ngram)


def agreement(reference: list[int], tokens: list[int]) -> tuple[int, int | None]:
    """Greedy token agreement of ``tokens`` with ``reference`` (specdraft's plain output).

    Returns:
        The number of leading tokens they share, and the first index where they differ (None when equal).
    """
    n = 0
    for a, b in zip(reference, tokens):
        if a != b:
            return n, n
        n += 1
    return n, (None if len(reference) == len(tokens) else n)
