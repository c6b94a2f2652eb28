"""Evaluation: Spec-Bench-style benchmarks (:mod:`.runner`), prompt files (:mod:`.prompts`),
transformers baselines (:mod:`.hf_baselines`) and the latency profiler (:mod:`.profile`)."""
