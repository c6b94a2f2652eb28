"""Evaluation: Spec-Bench-style benchmarks (:mod:`.runner`), prompt files (:mod:`.prompts`),
transformers and llama.cpp baselines (:mod:`.hf_baselines`, :mod:`.llamacpp_baselines`) and the latency
profiler (:mod:`.profile`)."""
