"""Designing drafts from a target: pruning, a smaller LM head, distillation, export.

The pipeline (``specdraft design build`` runs it end to end and records the recipe):

1. :mod:`~specdraft.design.data`: the target's own greedy answers to training prompts (gsm8k,
   hellaswag; never Spec-Bench), with its top-K log-probs and final hidden state per answer
   token, generated in batches through the engine and cached (resumable).
2. :mod:`~specdraft.design.search`: which layers to keep, by the analytic model's predicted
   throughput (teacher-forced acceptance on held-out training prompts, measured latency).
3. :mod:`~specdraft.design.prune`: depth pruning (layer subset at full width) and width pruning
   (heads and FFN channels by importance) for deep-narrow drafts of equal parameter count;
   :mod:`~specdraft.design.compare` puts the two side by side.
4. :mod:`~specdraft.design.vocab`: a head over the N most frequent answer tokens (lossless: the
   target verifies over its full vocabulary; see :mod:`specdraft.models.subset_head`).
5. :mod:`~specdraft.design.train`: offline distillation (CE + KL to the target's top-K) and
   on-policy distillation (Draft-OPD style replay of real speculative decoding), checkpointed.
   :mod:`~specdraft.design.feature`: the EAGLE-style feature-conditioned variant.
6. :mod:`~specdraft.design.artifact`: the draft directory (transformers config + safetensors of the
   draft's own weights + ``specdraft.json``); ``--full`` exports a self-contained transformers model.
7. :mod:`~specdraft.design.build`: the recipe that ties it together.
"""
