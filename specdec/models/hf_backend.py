"""Generic backend on transformers' AutoModelForCausalLM: any architecture, and the native one's reference.

Each slot owns a DynamicCache; rollback is DynamicCache.crop. Rows are run one at a time (a batch of
sessions at different positions would need padding and per-row position ids that not every architecture
accepts), so this backend is simple rather than fast.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Sequence

import torch

from specdec.errors import CacheFull, ContextOverflow, InvalidArgument
from specdec.models.base import ModelInfo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFModel:
    """The CausalLM protocol (specdec.models.base) over transformers."""

    def __init__(
        self,
        path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        num_slots: int = 8,
        max_context: int | None = None,
        attn_implementation: str = "sdpa",
        name: str | None = None,
    ):
        from transformers import AutoModelForCausalLM, DynamicCache

        if dtype not in DTYPES:
            raise InvalidArgument(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        if num_slots < 1:
            raise InvalidArgument(f"num_slots must be >= 1, got {num_slots}")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation
        ).to(self.device).eval()
        config = self.model.config.get_text_config(decoder=True)
        limit = getattr(config, "max_position_embeddings", None)
        max_context = max_context or min(limit or 2048, 2048)
        if limit and max_context > limit:
            raise InvalidArgument(
                f"max_context {max_context} exceeds the model's max_position_embeddings {limit}; choose a smaller one"
            )
        _check_sliding_window(config, max_context)
        self._new_cache = lambda: DynamicCache(config=self.model.config)
        self._cache_kwarg = cache_kwarg(self.model)
        self._caches: list = [None] * num_slots  # None = free slot
        self._lengths = [0] * num_slots
        self.packs_ragged_rows = True  # rows run one at a time: a step costs each row its own tokens
        self.info = ModelInfo(
            name=name or str(path), architecture=getattr(config, "model_type", "unknown"),
            vocab_size=int(config.vocab_size), max_context=max_context, dtype=dtype,
            device=str(self.device), backend="hf",
        )

    @property
    def num_slots(self) -> int:
        return len(self._caches)

    @property
    def num_free_slots(self) -> int:
        return sum(c is None for c in self._caches)

    def allocate(self) -> int:
        for slot, cache in enumerate(self._caches):
            if cache is None:
                self._caches[slot] = self._new_cache()
                self._lengths[slot] = 0
                return slot
        raise CacheFull(f"all {self.num_slots} slots are in use; free a session first or start with more slots")

    def free(self, slot: int) -> None:
        self._check_range(slot)
        self._caches[slot] = None
        self._lengths[slot] = 0

    def length(self, slot: int) -> int:
        self._check_allocated(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        current = self.length(slot)
        if not 0 <= length <= current:
            raise InvalidArgument(f"slot {slot} holds {current} tokens; truncate to 0..{current}, not {length}")
        if length < current:
            # A negative argument means "remove this many tokens" in transformers 4.x and 5.x alike.
            self._caches[slot].crop(length - current)
            self._lengths[slot] = length

    def fork(self, src: int, dst: int, length: int) -> None:
        if not 0 <= length <= self.length(src):
            raise InvalidArgument(f"slot {src} holds {self._lengths[src]} tokens; fork 0..{self._lengths[src]}")
        self._check_allocated(dst)
        if src != dst:
            self._caches[dst] = copy.deepcopy(self._caches[src])
            self._lengths[dst] = self._lengths[src]
        self.truncate(dst, length)

    def forward(
        self,
        slots: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        num_logits: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        if len(slots) != len(token_ids) or (num_logits is not None and len(num_logits) != len(slots)):
            raise InvalidArgument("slots, token_ids and num_logits must have equal lengths")
        if len(set(slots)) != len(slots):
            raise InvalidArgument(f"a slot may appear once per forward; got slots {list(slots)}")
        counts = [len(row) for row in token_ids]
        num_logits = list(num_logits) if num_logits is not None else counts
        for slot, n, k in zip(slots, counts, num_logits):
            start = self.length(slot)
            if n == 0 or not 0 <= k <= n:
                raise InvalidArgument(f"each row needs >= 1 token and 0 <= num_logits <= its length; got {n}, {k}")
            if start + n > self.info.max_context:
                raise ContextOverflow(
                    f"slot {slot} holds {start} tokens; appending {n} would pass max_context "
                    f"{self.info.max_context} (at most {self.info.max_context - start} more fit)"
                )
        # clone(): tensors made under inference_mode refuse in-place edits outside it.
        return [self._run_row(s, row, k).clone() for s, row, k in zip(slots, token_ids, num_logits)]

    @torch.inference_mode()
    def _run_row(self, slot: int, row: Sequence[int], keep: int) -> torch.Tensor:
        start, n = self._lengths[slot], len(row)
        ids = torch.tensor([list(row)], dtype=torch.long, device=self.device)  # [1, n]
        positions = torch.arange(start, start + n, device=self.device)[None]  # [1, n]
        out = self.model(
            input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=max(keep, 1),
            **{self._cache_kwarg: self._caches[slot]},
        )
        self._lengths[slot] += n
        logits = out.logits[0, -keep:] if keep else out.logits[0, :0]
        return logits.float()  # [keep, vocab]

    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument(f"slot {slot} does not exist; slots are 0..{self.num_slots - 1}")

    def _check_allocated(self, slot: int) -> None:
        self._check_range(slot)
        if self._caches[slot] is None:
            raise InvalidArgument(f"slot {slot} is not allocated; call allocate() first")


def cache_kwarg(model) -> str:
    """The name of a transformers model's forward argument for its KV cache: transformers 5 renamed
    `past_key_values` to `cache` (the old name warns, and goes in 5.40); either release is accepted."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _check_sliding_window(config, max_context: int) -> None:
    # A sliding-window cache drops old entries, so cropping it back cannot restore them; refuse
    # contexts where the window would ever apply instead of silently giving wrong rollbacks.
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    active = window and (not layer_types or "sliding_attention" in layer_types)
    if active and window < max_context:
        raise InvalidArgument(
            f"{config.model_type} uses a sliding attention window of {window} tokens; rollback needs the "
            f"full cache, so choose max_context <= {window}"
        )
