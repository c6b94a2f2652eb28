"""``specdraft design``: derive a draft from a target (search, prune, build, export, compare).

specdraft design data     --prompts 512                      # the target's answers, cached
specdraft design search   --max-depth 4                      # which layers to keep (predicted tok/s)
specdraft design build    --layers 0 --head 8192 --steps 400 --out drafts/my-draft
specdraft design export   drafts/my-draft --out /tmp/my-draft-hf   # for transformers / vLLM / SGLang
specdraft design compare  --budget-layers 2 --deep 4             # depth vs width at equal parameters
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdraft import dtypes
from specdraft.commands import add_model_arguments, positive_int
from specdraft.errors import SpecdraftError

HELP = "design a draft from the target: search, prune, build (distil), export, compare"


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None


def _data_args(p: argparse.ArgumentParser, prompts: int) -> None:
    p.add_argument(
        "--prompts", type=int, default=prompts, help="training prompts answered by the target (see --sources)"
    )
    p.add_argument(
        "--sources",
        default="gsm8k,hellaswag",
        help="prompt sources, round-robin: gsm8k, hellaswag, self (requests the target writes itself, "
        "Magpie-style), tasks (summarize / translate / rewrite / list / read instructions over the gsm8k "
        "and hellaswag texts)",
    )
    p.add_argument("--gen-dtype", choices=dtypes.choices("gen"), default="same", help=dtypes.help_text("gen"))
    p.add_argument(
        "--val-prompts", type=int, default=48, help="held-out prompts for validation / calibration"
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=160, help="answer length cap when generating data"
    )
    p.add_argument("--gen-batch", type=int, default=32, help="rows decoded together when generating data")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)

    d = sub.add_parser("data", help="generate (or complete) the cached target answers")
    add_model_arguments(d, draft=False)
    _data_args(d, 512)
    _search_arguments(sub)
    _build_arguments(sub)
    _local_arguments(sub)
    e = sub.add_parser("export", help="write a self-contained transformers directory (embedding included)")
    e.add_argument("draft", help="draft directory or drafts/ name")
    add_model_arguments(e, draft=False)
    e.add_argument("--out", type=Path, required=True)
    _compare_arguments(sub)


def _search_arguments(sub) -> None:
    s = sub.add_parser(
        "search", help="search layer subsets by predicted throughput (untrained, layer-pruned)"
    )
    add_model_arguments(s, draft=False)
    _data_args(s, 0)
    s.add_argument("--max-depth", type=int, default=4)
    s.add_argument(
        "--beam", type=int, default=1, help="subsets kept per depth (0: evaluate only --candidates)"
    )
    s.add_argument(
        "--candidates",
        default=None,
        help="extra subsets to evaluate, e.g. '0,1,2,29;0,29' (default: first d-1 layers + last)",
    )
    s.add_argument("--k-max", type=int, default=8)
    s.add_argument("--json", type=Path, default=None, help="write every candidate here")


def _build_arguments(sub) -> None:
    b = sub.add_parser(
        "build", help="prune, shrink the head, distil (offline, then on-policy) and save a draft"
    )
    add_model_arguments(b, draft=False)
    _data_args(b, 512)
    b.add_argument(
        "--layers", type=_layers, required=True, help="target layers to start from, e.g. 0 or 0,1,2,29"
    )
    b.add_argument(
        "--head",
        type=int,
        default=8192,
        help="head size: the N most frequent answer tokens (0 = full vocabulary)",
    )
    b.add_argument(
        "--kind",
        choices=["layers", "feature", "dream", "diffusion", "ctc", "flex"],
        default="layers",
        help="layers: a token-level draft; feature: EAGLE-style, also reads the target's final hidden state; "
        "dream: DREAM-style, also cross-attends to intermediate target layers; diffusion: a block drafted "
        "in one pass with an adaptive length head (DFlash/AdaFlash style); ctc: a feature draft whose slots "
        "emit a blank-augmented sequence, CTC-collapsed into a token tree; flex: FlexDraft, mask tokens "
        "drafted inside the target's verification forward from layer --layers S (try --block 4)",
    )
    b.add_argument("--block", type=int, default=16, help="--kind diffusion: block size (anchor included)")
    b.add_argument(
        "--init-from",
        default=None,
        help="--kind ctc, dream or feature: start from this designed feature draft (its layers, fc and head)",
    )
    b.add_argument(
        "--prompt-pairs",
        type=int,
        default=0,
        help="--kind feature: prompt pairs the draft reads before the answer, in training and at inference "
        "(0: the answer's only)",
    )
    b.add_argument(
        "--second-weight",
        type=float,
        default=0.0,
        help="--kind feature: also train the second draft position, which reads the draft's own predicted "
        "feature, with this loss weight (EAGLE-3's training-time test, one step; 0: off)",
    )
    b.add_argument("--window", type=int, default=8, help="--kind diffusion: target features read as context")
    b.add_argument(
        "--feature-layers",
        type=_layers,
        default=None,
        help="--kind dream: target layers to cross-attend to, e.g. 6,14,22 (default: low/mid/high)",
    )
    b.add_argument("--kv-heads", type=int, default=None, help="width pruning: key/value head groups kept")
    b.add_argument("--q-per-kv", type=int, default=None, help="width pruning: query heads kept per group")
    b.add_argument("--ffn", type=int, default=None, help="width pruning: FFN channels kept")
    b.add_argument("--steps", type=int, default=400, help="offline distillation steps (0 = untrained)")
    b.add_argument("--batch-size", type=int, default=8)
    b.add_argument("--lr", type=float, default=3e-4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--checkpoint-every", type=int, default=25)
    b.add_argument("--eval-every", type=int, default=50)
    b.add_argument(
        "--on-policy-rounds", type=int, default=0, help="on-policy rounds after offline distillation"
    )
    b.add_argument("--on-policy-prompts", type=int, default=8, help="prompts decoded per on-policy round")
    b.add_argument("--save-dtype", choices=["fp32", "bf16"], default="fp32")
    b.add_argument("--out", type=Path, required=True, help="draft directory to write")
    b.add_argument(
        "--work", type=Path, default=None, help="checkpoint directory (default <out>.work); a rerun resumes"
    )


def _local_arguments(sub) -> None:
    lo = sub.add_parser(
        "local",
        help="make a DeLS-Spec local head (bigram or GRU) for a feature/dream draft and tune its fusion",
    )
    add_model_arguments(lo, draft=False)
    _data_args(lo, 512)
    lo.add_argument(
        "draft", help="the designed draft (name under drafts/ or a directory); the head lands there"
    )
    lo.add_argument(
        "--successors", type=int, default=16, help="successors kept per token in the bigram table"
    )
    lo.add_argument(
        "--local",
        choices=["bigram", "gru"],
        default="bigram",
        help="bigram: a counted table; gru: a 1-layer GRU over the target's embeddings, trained",
    )
    lo.add_argument("--gru-steps", type=int, default=300, help="--local gru: training steps (batch 256)")
    lo.add_argument("--window", type=int, default=8, help="--local gru: recent tokens the GRU reads")


def _compare_arguments(sub) -> None:
    c = sub.add_parser(
        "compare", help="depth vs width at equal parameter count: latency, acceptance, predicted throughput"
    )
    add_model_arguments(c, draft=False)
    _data_args(c, 0)
    c.add_argument(
        "--budget-layers", type=int, default=2, help="the shallow-wide draft: this many full-width layers"
    )
    c.add_argument(
        "--deep", type=_layers, default=[4], help="depths of the deep-narrow drafts (comma-separated)"
    )
    c.add_argument("--q-per-kv", type=int, default=None, help="query heads per group in the narrow drafts")
    c.add_argument("--kv-heads", type=int, default=None, help="key/value groups in the narrow drafts")
    c.add_argument("--steps", type=int, default=0, help="distillation steps for each draft (0 = untrained)")
    c.add_argument("--lr", type=float, default=1e-3)
    c.add_argument("--head", type=int, default=0, help="head size for every draft (0 = full vocabulary)")
    c.add_argument("--json", type=Path, required=True, help="write the result rows here")


def _pipe(args):
    from specdraft import api
    from specdraft.models.llama import LlamaRuntime

    # auto: what transformers' modules (the training path) compute in: fp32 unless bf16 is native
    dtype = api.resolve_dtype(args.dtype, runtime="hf")
    pipe = api.load(
        args.target, "none", dtype=dtype, runtime=args.runtime, threads=args.threads, needs=("design",)
    )
    if not isinstance(pipe.runtime, LlamaRuntime):
        raise SpecdraftError("designing drafts needs a Llama-family target on the compact runtime")
    return pipe


def _data_kw(args) -> dict:
    """target_data keywords shared by every design action."""
    from specdraft.design.data import parse_sources

    return {
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.gen_batch,
        "sources": parse_sources(args.sources),
        "gen_dtype": dtypes.torch_dtype(args.gen_dtype),
        "hidden": True,
        "progress": not args.quiet,
    }


def run(args: argparse.Namespace) -> int:
    actions = {
        "data": _data,
        "search": _search,
        "build": _build,
        "local": _local,
        "export": _export,
        "compare": _compare,
    }
    return actions[args.action](args)


def _data(args) -> int:
    from specdraft.design.data import target_data

    pipe = _pipe(args)
    for split, n in (("train", args.prompts), ("val", args.val_prompts)):
        d = target_data(pipe, n_prompts=n, split=split, **_data_kw(args))
        print(f"{split}: {len(d)} answers, {d.num_response_tokens} tokens")
    return 0


def _search(args) -> int:
    from specdraft.design.data import target_data
    from specdraft.design.search import search_layers

    pipe = _pipe(args)
    calib = target_data(pipe, n_prompts=args.val_prompts, split="val", **_data_kw(args))
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr))
    extra = [_layers(x) for x in args.candidates.split(";")] if args.candidates else None
    cands = search_layers(
        pipe.runtime.w,
        calib,
        max_depth=args.max_depth,
        beam=args.beam,
        k_max=args.k_max,
        extra=extra,
        log=log,
    )
    print(f"{'layers':<22} {'alpha':>6} {'T_draft ms':>10} {'k':>2} {'pred tok/s':>10} {'speedup':>7}")
    for c in cands[:10]:
        print(
            f"{','.join(map(str, c.layers)):<22} {c.alpha:6.3f} {c.t_draft * 1e3:10.2f} {c.k:2d} "
            f"{c.tokens_per_s:10.1f} {c.speedup:7.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"calibration_tokens": calib.num_response_tokens, "candidates": [c.as_dict() for c in cands]},
                indent=1,
            )
        )
    return 0


def _build(args) -> int:
    from specdraft.design.build import BuildConfig, build_draft
    from specdraft.design.data import parse_sources
    from specdraft.design.train import OnPolicyConfig, TrainConfig

    if args.out.exists() and any(args.out.iterdir()) and not (args.out / "specdraft.json").is_file():
        raise SpecdraftError(f"{args.out} exists and is not a draft directory; choose another --out")
    cfg = BuildConfig(
        layers=args.layers,
        head=args.head,
        kv_heads=args.kv_heads,
        q_per_kv=args.q_per_kv,
        ffn=args.ffn,
        prompts=args.prompts,
        val_prompts=args.val_prompts,
        max_new_tokens=args.max_new_tokens,
        gen_batch=args.gen_batch,
        sources=parse_sources(args.sources),
        gen_dtype=args.gen_dtype,
        train=TrainConfig(
            steps=max(args.steps, 1),
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            eval_every=args.eval_every,
        ),
        on_policy=OnPolicyConfig(
            rounds=args.on_policy_rounds, prompts_per_round=args.on_policy_prompts, seed=args.seed
        ),
        dtype=args.save_dtype,
        kind=args.kind,
        feature_layers=args.feature_layers,
        init_from=args.init_from,
        prompt_pairs=args.prompt_pairs,
        second_weight=args.second_weight,
        block=args.block,
        window=args.window,
    )
    if args.steps == 0:
        cfg.train.steps = 0
    build_draft(_pipe(args), cfg, args.out, work=args.work, progress=not args.quiet)
    return 0


def _local(args) -> int:
    from specdraft.design.artifact import resolve_draft_dir
    from specdraft.design.data import target_data
    from specdraft.design.local import build_local, long_model

    src = resolve_draft_dir(args.draft)
    pipe = _pipe(args)
    model = long_model(src, pipe.target.model)
    data = target_data(pipe, n_prompts=args.prompts, split="train", **_data_kw(args))
    val = target_data(pipe, n_prompts=args.val_prompts, split="val", **_data_kw(args))
    gru = None
    if args.local == "gru":
        gru = {
            "embed": pipe.target.model.get_input_embeddings().weight,
            "steps": args.gru_steps,
            "window": args.window,
            "progress": not args.quiet,
        }
    local, info = build_local(model, data, val, pipe.runtime.vocab_size, args.successors, gru=gru)
    print(f"wrote {local.save(src, info)}: use --draft local:designed:{args.draft}")
    return 0


def _export(args) -> int:
    from specdraft.design.artifact import (
        load_draft,
        read_meta,
        resolve_draft_dir,
        save_draft,
        speculators_config,
    )

    src = resolve_draft_dir(args.draft)
    pipe = _pipe(args)
    kind = read_meta(src).kind
    if kind in ("feature", "diffusion", "ctc", "flex"):  # (a flex draft has no Llama to load)
        raise SpecdraftError(
            f"{src} is a {kind} draft: it exports only in its own format (copy the directory)"
        )
    draft, meta, extra = load_draft(src, pipe.target.model)

    def add_files(d):  # the tokenizer lands with the draft (and a DREAM draft's speculators config)
        pipe.tokenizer.save_pretrained(str(d))
        if meta.kind == "dream":
            spec = speculators_config(draft, meta, pipe.target.model)
            (d / "speculators_config.json").write_text(json.dumps(spec, indent=1))

    save_draft(args.out, draft, read_meta(src), full=True, extra=extra or None, add_files=add_files)
    what = "its decoder layer" if meta.kind == "dream" else "it"
    print(
        f"wrote {args.out}: transformers AutoModelForCausalLM.from_pretrained loads {what} "
        "(embedding included)"
    )
    return 0


def _compare(args) -> int:
    from specdraft.design.compare import compare_depth_width

    pipe = _pipe(args)
    rows = compare_depth_width(
        pipe,
        budget_layers=args.budget_layers,
        deep=args.deep,
        kv_heads=args.kv_heads,
        q_per_kv=args.q_per_kv,
        steps=args.steps,
        lr=args.lr,
        head=args.head,
        prompts=args.prompts,
        val_prompts=args.val_prompts,
        data_kw=_data_kw(args),
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"kind": "depth_vs_width", "target": args.target, "rows": rows}, indent=1)
    )
    for r in rows:
        print(
            f"{r['name']:<28} params {r['params'] / 1e6:5.2f} M  T_draft {r['t_draft_ms']:6.2f} ms  "
            f"alpha {r['alpha']:.3f}  predicted {r['predicted_tokens_per_s']:6.1f} tok/s "
            f"({r['predicted_speedup']:.2f}x, k={r['k']})"
        )
    print(f"wrote {args.json}")
    return 0
