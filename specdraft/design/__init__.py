"""Designing drafts from a target: pruning, a smaller LM head, distillation, export.

- :mod:`~specdraft.design.data`: the target's own answers to training prompts, cached.
"""
