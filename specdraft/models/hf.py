"""A runtime over any transformers causal LM (e.g. Gemma 3), for architectures without a compact
forward. Batch size 1; rollback crops the transformers cache to the first position being fed.
"""

from __future__ import annotations

import inspect

import torch

from specdraft.errors import SpecdraftError
from specdraft.models.runtime import ForwardOutput


class HFState:
    """A transformers cache for one row and how many positions it holds."""

    def __init__(self, batch_size: int):
        if batch_size != 1:
            raise SpecdraftError(
                "the transformers adapter runs one sequence at a time; use a Llama-family target "
                "(compact runtime) for batch size > 1"
            )
        self.batch_size = 1
        self.cache = None
        self.length = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        if len(rows) != 1:
            raise SpecdraftError("the transformers adapter cannot drop rows from a batch of one")

    def append(self, other: HFState) -> None:
        raise SpecdraftError("the transformers adapter runs one sequence at a time (batch size 1)")


class HFRuntime:
    """Adapter from the runtime protocol to ``model(input_ids, position_ids, past_key_values)``."""

    def __init__(self, model):
        self.model = model.eval()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = getattr(cfg, "max_position_embeddings", 2048)
        self.dtype = next(model.parameters()).dtype
        self.num_layers = cfg.num_hidden_layers
        # transformers 5.2x renamed past_key_values to cache; accept either
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def __repr__(self) -> str:
        return f"HFRuntime({type(self.model).__name__}, dtype={self.dtype})"

    def new_state(self, batch_size: int, capacity: int) -> HFState:
        return HFState(batch_size)

    @torch.inference_mode()
    def forward(
        self, state: HFState, tokens, positions, *, hidden_layers=(), attn_mask=None, logits_index=None
    ):
        from transformers import DynamicCache

        if attn_mask is not None:
            raise SpecdraftError("custom attention masks need the compact runtime")
        start = int(positions[0, 0])
        if state.cache is None:
            state.cache = DynamicCache(config=self.model.config)
            # sliding-window layers (Gemma 3) drop states past the window unless told to keep them
            # until the next crop; without this a rollback past the window cannot be undone
            state.cache.activate_past_recording()
        if start < state.length:
            # rollback: forget everything from the first position fed. transformers 5.2x's crop
            # takes a negative count of positions to remove (a positive length raises)
            state.cache.crop(start - state.length)
        elif start > state.length:
            raise SpecdraftError(f"positions skip from {state.length} to {start}")
        T = tokens.shape[1]
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            cache_position=torch.arange(start, start + T),
            use_cache=True,
            **{self._cache_kw: state.cache},
            output_hidden_states=bool(hidden_layers),
        )
        state.length = start + T
        logits = out.logits.float()
        if logits_index is not None:
            logits = logits.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        hidden = {}
        for layer in hidden_layers:
            # transformers: hidden_states[0] is the embedding output, [i + 1] after layer i
            hidden[layer] = out.hidden_states[layer + 1 if layer >= 0 else -1]
        return ForwardOutput(logits=logits, hidden=hidden)
