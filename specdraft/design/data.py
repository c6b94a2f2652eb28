"""Training data for a draft: the target's own greedy responses to training prompts, cached.

Prompts come from the training sets only (``gsm8k/train.jsonl`` questions and
``hellaswag_prompts.jsonl`` contexts, alternating; found by :func:`~specdraft.bench.prompts.data_file`:
``$SPECDRAFT_DATA``, ``../shared/data``, else the slices shipped in ``specdraft/data``); Spec-Bench is
evaluation-only and is never read here. A fixed slice of each file (:data:`VAL_PER_SOURCE` prompts
from its end after a seeded shuffle) is held out for validation.

A third source, ``self``, widens the topics beyond grade-school maths and story endings: user
requests the target writes itself (Magpie, Xu et al. 2024): given only its chat template up to the
start of a user turn, an instruct model samples a plausible user message (temperature 1, top-p 0.95).
They are cached per target and seed (:func:`self_prompts`); validation requests come from their
own seeds. A fourth, ``tasks``, asks for what those texts alone never do: the same training texts
(GSM8K questions, HellaSwag contexts) wrapped in task instructions whose answers reuse the prompt
(summarize, translate, rewrite, list what is mentioned, read and answer; :data:`TASKS`), the kinds of
request a general assistant gets. Sources are interleaved round-robin (``sources=("gsm8k",
"hellaswag", "self")``: a third each).

The target answers each prompt (chat template, greedy) through the :class:`~specdraft.engine.Engine`
in a continuously refilled batch. A thin recording wrapper around the target runtime keeps, for every
response token, what distillation needs:

- ``topk_idx`` / ``topk_logp``: the target's K most likely next tokens and their log-probabilities
  (normalised over the full vocabulary, so ``1 - sum(exp(topk_logp))`` is the tail mass);
- ``hidden`` (optional): the target's final hidden state at the position that predicts the token
  (after the final norm), for feature-conditioned drafts;
- ``prompt_hidden`` (optional): the same at the prompt's positions ``0 .. prompt_len - 2`` (from the
  prefill), for feature drafts that read the prompt's pairs too.

Response token j of a sequence sits at index ``prompt_len + j`` of ``tokens`` and was predicted by
the target at position ``prompt_len + j - 1``.

Sequences are written in shards (safetensors, written to a temporary name and renamed) under
``<cache>/design/data-<key>/``, ``<key>`` hashing the target, the prompt selection and the
recording options. A killed generation resumes: finished shards are kept and their prompts skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft import durable
from specdraft.bench.prompts import data_file, is_shipped_slice
from specdraft.durable import read_rows, repair_tail
from specdraft.engine import Engine, Request
from specdraft.errors import SpecdraftError
from specdraft.policy import FixedK

FORMAT = 1
VAL_PER_SOURCE = 200
SOURCES = ("gsm8k", "hellaswag")  # the default
ALL_SOURCES = ("gsm8k", "hellaswag", "self", "tasks")
TASKS = (  # the ``tasks`` source's instructions, one per prompt (seeded)
    "Summarize the following text in one or two sentences.\n\n{text}",
    "Translate the following text into French.\n\n{text}",
    "Translate the following text into German.\n\n{text}",
    "Rewrite the following text in a formal tone.\n\n{text}",
    "List the people, objects and numbers mentioned in the following text.\n\n{text}",
    "Read the passage, then say what it is about and what is likely to happen next.\n\nPassage: {text}",
)
TASK_TEXTS = ("hellaswag", "gsm8k")  # the files whose training texts ``tasks`` wraps
SELF_MAX_TOKENS = 96  # cap on a self-written request


# ------------------------------------------------------------------------------------ prompts
SOURCE_FILES = {"gsm8k": "gsm8k/train.jsonl", "hellaswag": "hellaswag_prompts.jsonl"}  # in a data directory


def _read_source(name: str, root: Path | None) -> list[str]:
    path = root / SOURCE_FILES[name] if root else data_file(SOURCE_FILES[name])
    if not path.is_file():
        raise SpecdraftError(f"training prompts not found: {path} (set SPECDRAFT_DATA to the data directory)")
    key = "question" if name == "gsm8k" else "prompt"
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SpecdraftError(f"{path}:{lineno}: expected a JSON object with {key!r}") from None
            out.append(text)
    return out


def parse_sources(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``"gsm8k,hellaswag,self"`` (or a sequence) -> a checked tuple of source names."""
    names = tuple(x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if x.strip())
    bad = [x for x in names if x not in ALL_SOURCES]
    if bad or not names or len(set(names)) != len(names):
        raise SpecdraftError(
            f"bad prompt sources {spec!r}: a comma-separated subset of {', '.join(ALL_SOURCES)}"
        )
    return names


def training_prompts(
    n: int,
    split: str = "train",
    seed: int = 0,
    root: Path | None = None,
    sources: tuple[str, ...] = SOURCES,
    pipe=None,
    runtime=None,
    progress: bool = False,
) -> list[str]:
    """``n`` training prompts, round-robin over ``sources``, in a seeded order.

    Args:
        n: how many (capped by what the split holds).
        split: ``train``, or ``val`` (the held-out last :data:`VAL_PER_SOURCE` of each file).
        seed: shuffles each file before the split (the split itself is the same for every seed
            0 run; other seeds give other splits).
        root: data directory (default: :func:`~specdraft.bench.prompts.data_file`, i.e.
            ``$SPECDRAFT_DATA``, ``../shared/data``, then the slices shipped in ``specdraft/data``).
        sources: which of :data:`ALL_SOURCES`; ``self`` needs ``pipe`` (the target writes them,
            with ``runtime`` if given, else the pipeline's).
    """
    if split not in ("train", "val"):
        raise SpecdraftError(f"unknown split {split!r}: use train or val")
    sources = parse_sources(sources)
    per_source = []
    share = -(-n // len(sources))  # prompts each source must supply
    for name in sources:
        if name == "self":
            if pipe is None:
                raise SpecdraftError("the 'self' prompt source needs the target (pipe=)")
            per_source.append(
                self_prompts(pipe, share, split=split, seed=seed, runtime=runtime, progress=progress)
            )
            continue
        per_source.append(
            _task_prompts(split, seed, root) if name == "tasks" else _split(name, split, seed, root)
        )
    mixed = [t for group in zip(*per_source) for t in group]
    return mixed[:n]


def _split(name: str, split: str, seed: int, root: Path | None) -> list[str]:
    """A file source's texts of ``split``, in the seeded order (validation: the last
    :data:`VAL_PER_SOURCE` after the shuffle)."""
    texts = _read_source(name, root)
    random.Random(f"{seed}-{name}").shuffle(texts)
    return texts[-VAL_PER_SOURCE:] if split == "val" else texts[:-VAL_PER_SOURCE]


def _task_prompts(split: str, seed: int, root: Path | None) -> list[str]:
    """The ``tasks`` source: :data:`TASK_TEXTS`' texts of ``split`` (their validation texts stay
    held out) interleaved, reshuffled, each wrapped in a seeded choice of :data:`TASKS`."""
    texts = [t for group in zip(*(_split(s, split, seed, root) for s in TASK_TEXTS)) for t in group]
    rng = random.Random(f"{seed}-tasks")
    rng.shuffle(texts)
    return [rng.choice(TASKS).format(text=t) for t in texts]


def self_prompts(
    pipe,
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    batch_size: int = 32,
    cache: Path | None = None,
    runtime=None,
    min_words: int = 3,
    max_tokens: int = SELF_MAX_TOKENS,
    max_tries: int | None = None,
    progress: bool = True,
) -> list[str]:
    """``n`` user requests written by the target itself (Magpie), cached; see the module docstring.

    Request i is sampled with its own seed (``seed``, ``split``, i), so it does not depend on the
    batch it was decoded in. Requests that do not end within ``max_tokens`` tokens, have
    fewer than ``min_words`` words, or repeat an earlier one are skipped (the next seed is drawn
    instead); after ``max_tries`` samples (default ``20 n + 64``) without enough, an error says so.
    The cache (one JSON line per sample, kept or not) makes a killed run resume where it stopped.
    """
    from tqdm import tqdm

    from specdraft.verify import SamplingParams

    tok = pipe.tokenizer
    prefix = _self_prompt_prefix(tok)
    path = _self_prompts_path(pipe, prefix, seed=seed, split=split, max_tokens=max_tokens, cache=cache)
    kept, tried = _read_self_prompts(path)
    if len(kept) >= n:
        return kept[:n]
    base = (seed * 7919 + (0 if split == "train" else 1_000_003)) * 1_000_000
    engine = Engine(runtime or pipe.runtime, None, FixedK(0))
    seen = set(kept)
    bar = tqdm(
        total=n,
        initial=len(kept),
        desc=f"self prompts ({split})",
        unit="req",
        disable=not progress,
        dynamic_ncols=True,
    )
    with path.open("a", encoding="utf-8") as f:
        limit = max_tries if max_tries is not None else 20 * n + 64
        while len(kept) < n:
            if tried >= limit:
                raise SpecdraftError(
                    f"the target wrote only {len(kept)} usable requests in {tried} samples "
                    f"(wanted {n}); is it an instruct model?"
                )
            todo = range(tried, tried + max(batch_size, 1))
            params = [SamplingParams(temperature=1.0, top_p=0.95, seed=base + i) for i in todo]
            reqs = [Request(list(prefix), max_tokens, p, pipe.eos_ids) for p in params]
            rid = engine.add(reqs)
            out = {r: [] for r in rid}
            while engine.active:
                for ev in engine.step():
                    out[ev.request_id] += ev.tokens
            for i, r in zip(todo, rid):
                toks = out[r]
                ended = bool(toks) and toks[-1] in pipe.eos_ids
                req = tok.decode(toks[:-1] if ended else toks, skip_special_tokens=True).strip()
                ok = ended and bool(req) and len(req.split()) >= min_words and req not in seen
                f.write(json.dumps({"i": i, "text": req if ok else None}) + "\n")
                if ok:
                    seen.add(req)
                    if len(kept) < n:
                        kept.append(req)
                        bar.update(1)
            f.flush()
            os.fsync(f.fileno())
            tried = todo[-1] + 1
    bar.close()
    return kept[:n]


def _self_prompt_prefix(tok) -> list[int]:
    """The chat template's tokens before a user message: where the target starts writing one."""
    if not getattr(tok, "chat_template", None):
        raise SpecdraftError("the 'self' prompt source needs an instruct target with a chat template")
    marker = "\x00specdraft\x00"
    text = tok.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=False, tokenize=False
    )
    return tok(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def _self_prompts_path(pipe, prefix: list[int], *, seed: int, split: str, max_tokens: int, cache) -> Path:
    """The cache file of one (target, template, seed, split, length cap); its folder exists."""
    from specdraft.models.loading import cache_root

    key = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT,
                "target": pipe.target.name,
                "prefix": prefix,
                "seed": seed,
                "split": split,
                "max": max_tokens,
            }
        ).encode()
    ).hexdigest()[:12]
    path = (Path(cache) if cache else cache_root() / "design") / f"self-prompts-{key}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _read_self_prompts(path: Path) -> tuple[list[str], int]:
    """The requests kept so far and the number of samples tried, from a (killed) run's cache."""
    kept, tried = [], 0
    if path.exists():  # a killed run's cache: a half-written last line is dropped, as in the study store
        for lineno, rec in enumerate(read_rows(path, tolerate_truncated_tail=True), 1):
            if not isinstance(rec.get("i"), int) or not isinstance(rec.get("text", 0), (str, type(None))):
                raise SpecdraftError(
                    f"{path}: record {lineno} is not {{'i': int, 'text': str or null}}; "
                    "delete the file and rerun"
                )
            tried = max(tried, rec["i"] + 1)
            if rec["text"] is not None:
                kept.append(rec["text"])
        repair_tail(path)
    return kept, tried


# ------------------------------------------------------------------------------------ records
@dataclass
class TargetData:
    """Sequences answered by the target, with what distillation needs per response token.

    Attributes:
        tokens: per sequence ``(S,)`` int64, prompt then response.
        prompt_lens: per sequence, how many of ``tokens`` are prompt.
        topk_idx: per sequence ``(R, K)`` int64, R = response length.
        topk_logp: per sequence ``(R, K)`` float32 log-probabilities.
        hidden: per sequence ``(R, C)`` float32, or None when not recorded.
        prompt_hidden: per sequence ``(prompt_len - 1, C)`` float32, or None when not recorded.
        prompt_ids: per sequence, the index of its prompt in the prompt list.
    """

    tokens: list[torch.Tensor] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    topk_idx: list[torch.Tensor] = field(default_factory=list)
    topk_logp: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] | None = None
    prompt_hidden: list[torch.Tensor] | None = None
    prompt_ids: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_response_tokens(self) -> int:
        return sum(t.shape[0] for t in self.topk_idx)

    def extend(self, other: TargetData) -> None:
        self.tokens += other.tokens
        self.prompt_lens += other.prompt_lens
        self.topk_idx += other.topk_idx
        self.topk_logp += other.topk_logp
        self.prompt_ids += other.prompt_ids
        if other.hidden is not None:
            self.hidden = (self.hidden or []) + other.hidden
        if other.prompt_hidden is not None:
            self.prompt_hidden = (self.prompt_hidden or []) + other.prompt_hidden

    def response_tokens(self) -> torch.Tensor:
        """All response tokens, concatenated ``(N,)``."""
        return (
            torch.cat([t[p:] for t, p in zip(self.tokens, self.prompt_lens)])
            if self.tokens
            else torch.zeros(0, dtype=torch.int64)
        )

    def save(self, path: Path) -> None:
        """One safetensors shard, written atomically."""
        from safetensors.torch import save_file

        lens = torch.tensor([t.shape[0] for t in self.tokens], dtype=torch.int64)
        tensors = {
            "tokens": torch.cat(self.tokens).to(torch.int32),
            "seq_lens": lens,
            "prompt_lens": torch.tensor(self.prompt_lens, dtype=torch.int64),
            "prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.int64),
            "topk_idx": torch.cat(self.topk_idx).to(torch.int32),
            "topk_logp": torch.cat(self.topk_logp).to(torch.float16),
        }
        if self.hidden is not None:
            tensors["hidden"] = torch.cat(self.hidden).to(torch.float16)
        if self.prompt_hidden is not None:
            tensors["prompt_hidden"] = torch.cat(self.prompt_hidden).to(torch.float16)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp))
        durable.replace_file(tmp, path)

    @classmethod
    def load(cls, path: Path) -> TargetData:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            t = load_file(str(path))
            seq_lens = t["seq_lens"].tolist()
            plens = t["prompt_lens"].tolist()
            resp = [s - p for s, p in zip(seq_lens, plens)]
            data = cls(
                tokens=[x.long() for x in t["tokens"].split(seq_lens)],
                prompt_lens=plens,
                topk_idx=[x.long() for x in t["topk_idx"].split(resp)],
                topk_logp=[x.float() for x in t["topk_logp"].split(resp)],
                hidden=[x.float() for x in t["hidden"].split(resp)] if "hidden" in t else None,
                prompt_hidden=[x.float() for x in t["prompt_hidden"].split([p - 1 for p in plens])]
                if "prompt_hidden" in t
                else None,
                prompt_ids=t["prompt_ids"].tolist(),
            )
        except (SafetensorError, KeyError, RuntimeError, ValueError, OSError) as e:
            raise SpecdraftError(
                f"corrupted data shard {path} ({type(e).__name__}: {e}); delete it and rerun"
            ) from None
        return data


# ------------------------------------------------------------------------------------ generation
class _Recorder:
    """Wraps the target runtime; while ``on``, keeps top-k log-probs (and hidden) of the last position;
    otherwise (a prefill), with ``prompt_hidden``, the hidden state at every position it fed (``prefill``)."""

    def __init__(self, runtime, topk: int, hidden_layer: int | None, prompt_hidden: bool = False):
        self.runtime = runtime
        self.vocab_size = runtime.vocab_size
        self.max_context = runtime.max_context
        self.dtype = runtime.dtype
        self.topk = topk
        self.hidden_layer = hidden_layer
        self.on = False
        self.last: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.prompt_hidden = prompt_hidden
        self.prefill: torch.Tensor | None = None

    def new_state(self, batch_size: int, capacity: int):
        return self.runtime.new_state(batch_size, capacity)

    def forward(self, state, tokens, positions, **kw):
        out = self.runtime.forward(state, tokens, positions, **kw)
        if self.on:
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)  # (B, V)
            vals, idx = logp.topk(self.topk, dim=-1)  # (B, K)
            hid = out.hidden[self.hidden_layer][:, -1].float() if self.hidden_layer is not None else None
            self.last = (idx, vals, hid)
        elif self.prompt_hidden:
            self.prefill = out.hidden[self.hidden_layer].float()
        return out


def generate_target_data(
    runtime,
    prompts: list[list[int]],
    *,
    eos_ids: tuple[int, ...],
    max_new_tokens: int = 192,
    batch_size: int = 16,
    topk: int = 32,
    hidden_layer: int | None = None,
    prompt_hidden: bool = False,
    skip: set[int] | None = None,
    shard_size: int = 32,
    on_shard=None,
    progress: bool = True,
) -> TargetData:
    """Answer ``prompts`` greedily with the target through the engine; record distillation targets.

    Rows are refilled as others finish, so the batch stays full. Every ``shard_size`` finished
    sequences are handed to ``on_shard(TargetData)`` (the cache writes them); the return value
    holds everything generated in this call.

    Args:
        runtime: the target runtime.
        prompts: token ids per prompt.
        eos_ids: generation stops after any of these.
        max_new_tokens: response length cap.
        batch_size: rows decoded together.
        topk: K, how many of the target's most likely tokens to keep per position.
        hidden_layer: also keep this layer's hidden state (``-1``: after the final norm), at the
            answer's positions and (``prompt_hidden``) the prompt's.
        skip: prompt indices already done (a resumed run).
        shard_size: sequences per ``on_shard`` call.
    """
    from tqdm import tqdm

    rec = _Recorder(runtime, topk, hidden_layer, prompt_hidden and hidden_layer is not None)
    hidden_layers = (hidden_layer,) if hidden_layer is not None else ()
    engine = Engine(rec, None, FixedK(0), hidden_layers=hidden_layers)
    todo = deque(i for i in range(len(prompts)) if not (skip and i in skip))
    room = runtime.max_context - max_new_tokens - 4
    live: dict[int, dict] = {}  # request id -> what it has produced so far
    result, shard = TargetData(), TargetData()
    bar = tqdm(total=len(todo), desc="target answers", unit="seq", disable=not progress, dynamic_ncols=True)
    made, t0 = 0, time.perf_counter()

    def flush(final: bool = False):
        nonlocal shard
        if len(shard) >= shard_size or (final and len(shard)):
            if on_shard is not None:
                on_shard(shard)
            result.extend(shard)
            shard = TargetData()

    while todo or engine.active:
        if todo and engine.active < batch_size:
            batch = []
            while todo and len(batch) + engine.active < batch_size:
                i = todo.popleft()
                ids = prompts[i][-room:] if len(prompts[i]) > room else prompts[i]
                batch.append((i, Request(list(ids), max_new_tokens, eos_ids=eos_ids)))
            rec.prefill = None
            for j, (rid, (i, r)) in enumerate(zip(engine.add([r for _, r in batch]), batch)):
                live[rid] = {"prompt_id": i, "prompt": r.prompt, "out": [], "idx": [], "logp": [], "hid": []}
                if rec.prompt_hidden:  # none when every prompt of the batch is one token (no prefill)
                    n = len(r.prompt) - 1
                    live[rid]["pre"] = rec.prefill[j, :n].clone() if n else None
        rows = [r.id for r in engine.requests]
        rec.on = True
        events = engine.step()
        rec.on = False
        idx, logp, hid = rec.last
        for b, (rid, ev) in enumerate(zip(rows, events)):
            assert ev.request_id == rid and len(ev.tokens) == 1
            s = live[rid]
            s["out"] += ev.tokens
            s["idx"].append(idx[b])
            s["logp"].append(logp[b])
            if hid is not None:
                s["hid"].append(hid[b])
            if ev.finished:
                del live[rid]
                shard.tokens.append(torch.tensor(s["prompt"] + s["out"], dtype=torch.int64))
                shard.prompt_lens.append(len(s["prompt"]))
                shard.prompt_ids.append(s["prompt_id"])
                shard.topk_idx.append(torch.stack(s["idx"]))
                shard.topk_logp.append(torch.stack(s["logp"]))
                if hid is not None:
                    shard.hidden = (shard.hidden or []) + [torch.stack(s["hid"])]
                if rec.prompt_hidden:
                    pre = s["pre"] if s["pre"] is not None else hid.new_zeros(0, hid.shape[1])
                    shard.prompt_hidden = (shard.prompt_hidden or []) + [pre]
                bar.update(1)
                flush()
        made += len(rows)
        bar.set_postfix(tok_s=f"{made / (time.perf_counter() - t0):.0f}")
    flush(final=True)
    bar.close()
    return result


# ------------------------------------------------------------------------------------ cache
def _cache_key(target_name: str, vocab_size: int, spec: dict) -> str:
    h = hashlib.sha256(
        json.dumps(
            {"format": FORMAT, "target": target_name, "vocab": vocab_size, **spec}, sort_keys=True
        ).encode()
    )
    return h.hexdigest()[:12]


def target_data(
    pipe,
    *,
    n_prompts: int,
    split: str = "train",
    seed: int = 0,
    max_new_tokens: int = 192,
    batch_size: int = 16,
    topk: int = 32,
    hidden: bool = False,
    prompt_hidden: bool = False,
    sources: tuple[str, ...] = SOURCES,
    gen_dtype: torch.dtype | None = None,
    cache: Path | None = None,
    progress: bool = True,
) -> TargetData:
    """The target's answers to ``n_prompts`` training prompts: from the cache, generating what is missing.

    Args:
        pipe: a :class:`specdraft.api.Pipeline` holding the target (its drafter is not used).
        n_prompts: prompts to answer (see :func:`training_prompts`).
        split: ``train`` or ``val``.
        seed: prompt order.
        max_new_tokens: response cap.
        batch_size: rows decoded together.
        topk: K target log-probs kept per response token.
        hidden: also keep the target's final hidden states.
        prompt_hidden: with ``hidden``, the prompt's too.
        sources: prompt sources (:func:`training_prompts`).
        gen_dtype: answer with the target's weights in this dtype (e.g. bf16 through the native
            kernels: half the weight bytes of fp32, and what the bf16 runtime computes at
            inference); None: the pipeline's own runtime.
        cache: directory for the shards (default ``<cache>/design/``).
    """
    from specdraft.models.loading import cache_root

    if prompt_hidden and not hidden:
        raise SpecdraftError(
            "prompt_hidden needs hidden=True (the prompt's hidden states go beside the answer's)"
        )
    sources = parse_sources(sources)
    runtime = generation_runtime(pipe, gen_dtype)
    spec = {"split": split, "seed": seed, "max_new": max_new_tokens, "topk": topk, "hidden": hidden}
    if prompt_hidden:  # (only when asked, as for sources: older caches keep their keys)
        spec["prompt_hidden"] = True
    if sources != SOURCES:  # (the default keeps the keys of caches made before sources existed)
        spec["sources"] = list(sources)
    if runtime is not pipe.runtime:
        spec["gen_dtype"] = str(gen_dtype).removeprefix("torch.")
    read = {t for s in sources for t in (TASK_TEXTS if s == "tasks" else (s,)) if t in SOURCE_FILES}
    files = {s: data_file(SOURCE_FILES[s]) for s in sorted(read)}
    slices = {
        s: hashlib.sha256(f.read_bytes()).hexdigest()[:12] for s, f in files.items() if is_shipped_slice(f)
    }
    if slices:  # (prompts from a shipped slice are others than the full file's: another key)
        spec["slices"] = slices
    d, spec = _cache_dir(Path(cache) if cache else cache_root() / "design", pipe, spec)
    d.mkdir(parents=True, exist_ok=True)
    meta = {"target": pipe.target.name, "source": pipe.target.source, **spec}
    durable.write_text(d / "meta.json", json.dumps(meta, indent=2))

    texts = training_prompts(
        n_prompts, split, seed, sources=sources, pipe=pipe, runtime=runtime, progress=progress
    )

    def cached() -> TargetData:
        data = TargetData()
        for f in sorted(d.glob("shard-*.safetensors")):
            data.extend(TargetData.load(f))
        return _subset(data, [i for i, p in enumerate(data.prompt_ids) if p < len(texts)])

    data = cached()
    done = set(data.prompt_ids)
    if len(done) < len(texts):
        ids = [pipe.encode(t) for t in texts]
        counter = [1 + max((int(f.stem.split("-")[1]) for f in d.glob("shard-*.safetensors")), default=-1)]

        def write(shard: TargetData):
            shard.save(d / f"shard-{counter[0]:05d}.safetensors")
            counter[0] += 1

        hidden_layer = -1 if hidden else None
        generate_target_data(
            runtime,
            ids,
            eos_ids=pipe.eos_ids,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            topk=topk,
            hidden_layer=hidden_layer,
            prompt_hidden=spec.get("prompt_hidden", False),
            skip=done,
            on_shard=write,
            progress=progress,
        )
        data = cached()  # what is on disk (fp16 log-probs), the same on every later run
    if not prompt_hidden:
        data.prompt_hidden = None  # (read from a wider cache: not asked for)
    return _subset(data, sorted(range(len(data)), key=lambda i: data.prompt_ids[i]))


def _cache_dir(root: Path, pipe, spec: dict) -> tuple[Path, dict]:
    """The shards' folder for ``spec`` and the spec they are written with. A run with the answers'
    hidden states but not the prompt's reads a cache that also kept the prompt's when only that one
    exists (the same answers; the prompt's states are dropped after loading) and adds to it."""
    d = root / f"data-{_cache_key(pipe.target.name, pipe.runtime.vocab_size, spec)}"
    if spec["hidden"] and "prompt_hidden" not in spec and not any(d.glob("shard-*.safetensors")):
        wider = {**spec, "prompt_hidden": True}
        w = root / f"data-{_cache_key(pipe.target.name, pipe.runtime.vocab_size, wider)}"
        if any(w.glob("shard-*.safetensors")):
            return w, wider
    return d, spec


def generation_runtime(pipe, dtype: torch.dtype | None):
    """The runtime that answers training prompts: the pipeline's, or its target's weights in ``dtype``."""
    from specdraft.models.llama import LlamaRuntime
    from specdraft.models.runtime import make_runtime

    rt = pipe.runtime
    if dtype is None or not isinstance(rt, LlamaRuntime) or rt.dtype == dtype and rt.w.dtype == dtype:
        return rt
    return make_runtime(pipe.target, "compact", dtype)  # the target's family (Llama or Gemma 3)


def _subset(data: TargetData, order: list[int]) -> TargetData:
    return TargetData(
        tokens=[data.tokens[i] for i in order],
        prompt_lens=[data.prompt_lens[i] for i in order],
        topk_idx=[data.topk_idx[i] for i in order],
        topk_logp=[data.topk_logp[i] for i in order],
        hidden=[data.hidden[i] for i in order] if data.hidden is not None else None,
        prompt_hidden=[data.prompt_hidden[i] for i in order] if data.prompt_hidden is not None else None,
        prompt_ids=[data.prompt_ids[i] for i in order],
    )
