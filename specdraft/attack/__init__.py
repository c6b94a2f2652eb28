"""Acceleration-collapse attacks on speculative decoding (issue 17; Mistletoe, arXiv 2605.14005).

Inputs crafted so that the draft's proposals are rejected while the target's answer stays the
same. One file per piece:

- :mod:`~specdraft.attack.losses`: degradation (the draft's expected acceptance of the target's own
  continuation), preservation (KL of the target's distributions, clean vs attacked) and the
  projection of the first's gradient onto the null space of the second's;
- :mod:`~specdraft.attack.continuous`: a bounded perturbation of the prompt's input embeddings
  (white-box);
- :mod:`~specdraft.attack.discrete`: a short token suffix found by GCG-style search (text a client
  can send);
- :mod:`~specdraft.attack.lookup`: decoy phrases against prompt lookup's n-gram matches;
- :mod:`~specdraft.attack.run`: per prompt, clean vs attacked through the engine, and the output
  files (``specdraft attack``, :mod:`specdraft.commands.attack`);
- :mod:`~specdraft.attack.report`: the attack section of ``specdraft report``.
"""
