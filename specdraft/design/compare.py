"""Depth vs width at equal parameter count: shallow-wide and deep-narrow drafts side by side.

The shallow-wide draft keeps ``budget_layers`` target layers at full width; each deep-narrow draft
keeps more layers, each narrowed (key/value groups, query heads, FFN channels by importance) so its
own parameter count matches. Layers are spread evenly over the target (first and last included).
For every draft the rows report its parameters, measured latency per draft token (interleaved with
the target's forwards), validation acceptance alpha (teacher-forced, greedy) and the analytic
model's throughput at the best k.

Rows (``--json``; read by the study report)::

    {"name", "depth", "layers", "kv_heads", "q_per_kv", "ffn", "params", "head", "steps",
     "t_draft_ms", "alpha", "k", "predicted_tokens_per_s", "predicted_speedup",
     "t_target_ms": {n: ms}}
"""

from __future__ import annotations

from specdraft.bench.profile import measure_latency
from specdraft.design.data import target_data
from specdraft.design.prune import depth_prune, ffn_for_budget, importance, param_count, width_prune
from specdraft.design.search import predict
from specdraft.design.train import DraftLM, TrainConfig, train_offline, validate
from specdraft.models.llama import LlamaRuntime
from specdraft.models.subset_head import SubsetHeadRuntime, draft_weights


def spread(n_layers: int, depth: int) -> list[int]:
    """``depth`` layer ids spread evenly over ``0..n_layers - 1`` (first and last included)."""
    if depth == 1:
        return [0]
    return sorted({round(i * (n_layers - 1) / (depth - 1)) for i in range(depth)})


def compare_depth_width(
    pipe,
    *,
    budget_layers=2,
    deep=(4,),
    kv_heads=None,
    q_per_kv=None,
    steps=0,
    lr=1e-3,
    head=0,
    prompts=0,
    val_prompts=48,
    data_kw: dict | None = None,
    work=None,
    progress=True,
) -> list[dict]:
    """Build (and optionally distil) each draft, then measure it; returns the result rows.

    ``data_kw``: :func:`~specdraft.design.data.target_data` keywords (answer length, batch, sources...)."""
    from specdraft.design.build import head_subset, prompt_token_counts

    target = pipe.target.model
    cfg = target.config
    n = cfg.num_hidden_layers
    kw = {"hidden": True, "progress": progress, **(data_kw or {})}
    val = target_data(pipe, n_prompts=val_prompts, split="val", **kw)
    data = target_data(pipe, n_prompts=prompts, **kw) if (steps or head) else None
    sub = (
        head_subset(data, head, cfg.vocab_size, pipe.eos_ids, prompt_token_counts(pipe))
        if data is not None and head
        else None
    )

    wide = depth_prune(target, spread(n, budget_layers))
    budget = param_count(wide)
    G, r = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    drafts = [(f"shallow-wide {budget_layers}L", wide, None)]
    for depth in deep:
        layers = spread(n, depth)
        kv, q = kv_heads or max(G * 2 // 3, 1), q_per_kv or r
        ffn = ffn_for_budget(target, depth, budget, kv_heads=kv, q_per_kv=q)
        scores = importance(target, val.tokens[:8], layers)
        drafts.append(
            (
                f"deep-narrow {depth}L",
                width_prune(target, layers, scores, kv_heads=kv, q_per_kv=q, ffn=ffn),
                {"kv_heads": kv, "q_per_kv": q, "ffn": ffn},
            )
        )

    rows, runtimes = [], {}
    for name, draft, width in drafts:
        model = DraftLM(draft, sub.token_ids if sub else None)
        if steps:
            import tempfile

            with tempfile.TemporaryDirectory(dir=work) as tmp:
                train_offline(
                    model,
                    data,
                    None,
                    TrainConfig(steps=steps, lr=lr, warmup=max(steps // 10, 1), eval_every=0),
                    tmp,
                    progress=progress,
                )
        alpha = validate(model, val)["alpha"]
        w = draft_weights(draft, pipe.runtime.w, sub.token_ids if sub else None, pipe.runtime.dtype)
        rt = LlamaRuntime(w)
        runtimes[name] = SubsetHeadRuntime(rt, sub.token_ids, cfg.vocab_size) if sub else rt
        c = draft.config
        rows.append(
            {
                "name": name,
                "depth": c.num_hidden_layers,
                "layers": spread(n, c.num_hidden_layers),
                "kv_heads": c.num_key_value_heads,
                "q_per_kv": c.num_attention_heads // c.num_key_value_heads,
                "ffn": c.intermediate_size,
                "params": param_count(draft),
                "head": len(sub) if sub else cfg.vocab_size,
                "steps": steps,
                "alpha": round(alpha, 4),
            }
        )
    lat = measure_latency(pipe.runtime, runtimes)
    t_target = lat.curve().time
    for row in rows:
        t_d = lat.draft[row["name"]]
        p = predict(row["alpha"], t_d, t_target)
        row.update(
            {
                "t_draft_ms": round(t_d * 1e3, 3),
                "k": p["k"],
                "predicted_tokens_per_s": round(p["tokens_per_s"], 2),
                "predicted_speedup": round(p["speedup"], 3),
                "t_target_ms": {k: round(v * 1e3, 3) for k, v in lat.target.items()},
            }
        )
    return rows
