# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Faster cache layers, registered by `import dat_hf` in `cache_dat.CACHE_LAYERS` (the one registry's table
`BACKENDS.of("cache_layers")`), where `cache_dat.prepare_cache` takes them for Transformers' layers:

- "dynamic": `InPlaceCacheLayer`, a `DynamicLayer` writing into buffers with spare room (a decoding step copies one
  token instead of the whole cache), which takes a dual-attention layer's parts unpacked (`update_packed`, the hook
  `cache_dat.packed_update` looks for);
- "static_sliding": `RingSlidingWindowLayer`, a `DATStaticSlidingWindowLayer` kept as a ring (a decoding step writes
  one slot instead of rolling the window, and one compiled graph serves every step), whose keys come in slot order:
  masks ask it for `to_slots`, position-relative symbols for `receiver_slots`.

The model files never import this module: without it (remote code alone) the caches keep Transformers' `DynamicLayer`s
and roll the sliding window oldest first, with the same results.
"""

import torch
from transformers.cache_utils import DynamicLayer

from ..cache_dat import CACHE_LAYERS, DATStaticSlidingWindowLayer


class InPlaceCacheLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are prefix views of buffers with spare room (`capacity`, doubled when
    full): a decoding step copies only the new token. If anything else replaced `keys`/`values` (crop, beam
    reordering, device moves), the next update copies into fresh buffers, so earlier views are never overwritten."""

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity
        self._length = 0
        self._buffers = None  # keys `[..., capacity, d_k]`, values `[..., capacity, d_v]`

    def update(self, key_states, value_states, *args, **kwargs):
        if torch.compiler.is_compiling():
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._owns(length, key_states, value_states):
            self._reallocate(length, length + new, key_states, value_states)
        key_buffer, value_buffer = self._buffers
        key_buffer[..., length:length + new, :].copy_(key_states)
        value_buffer[..., length:length + new, :].copy_(value_states)
        self.keys, self.values = key_buffer[..., :length + new, :], value_buffer[..., :length + new, :]
        self._length = length + new
        return self.keys, self.values

    def update_packed(self, packed, key_states, values: list):
        """A `PackedCache` layer's update without packing: keys `[b, h_k, n, d_h]` and flat values `[b, n, width]`
        are written into the buffers, and the views `packed.views` gives are cut from views of the whole buffers
        kept with them -> (keys per head type, values) over the cached tokens, as `packed.unpack(*update(...))`."""
        length, new = self._length, key_states.shape[-2]
        if (torch.compiler.is_compiling() or key_states.shape[1] != sum(packed.key_heads)
                or not self.has_room_for(key_states.shape[0], new, packed, key_states.dtype, key_states.device)
                or any(value.dtype != key_states.dtype for value in values)):
            return packed.unpack(*self.update(*packed.pack([key_states], values)))
        key_buffer, value_buffer = self._buffers
        key_buffer.narrow(-2, length, new).copy_(key_states)
        rows, keys, parts = self._packed_views(packed, value_buffer)
        torch.cat(values, dim=-1, out=rows.narrow(1, length, new)) if len(values) > 1 else \
            rows.narrow(1, length, new).copy_(values[0])
        self._length = total = length + new
        self.keys, self.values = key_buffer.narrow(-2, 0, total), value_buffer.narrow(-2, 0, total)
        return ([key.narrow(2, 0, total) for key in keys],
                [part.narrow(2 if heads else 1, 0, total) for part, heads in zip(parts, packed.value_heads)])

    def slots_for(self, batch_size: int, new: int, packed, dtype, device) -> tuple | None:
        """Where a kernel writes `new` tokens of a `PackedCache` layer's states itself (`batch_size` rows, `dtype`, on
        `device`): (key buffer `[b, h_k, capacity, d_h]`, value buffer `[b, 1, capacity, width]`, the slot of the
        first new token), or None when the buffers have no room (then `update_packed` makes it). After writing, the
        kernel calls `appended(new)`."""
        if not self.has_room_for(batch_size, new, packed, dtype, device):
            return None
        return (*self._buffers, self._length)

    def appended(self, new: int) -> None:
        """The layer holds the `new` tokens a kernel wrote into the buffers `slots_for` gave."""
        key_buffer, value_buffer = self._buffers
        self._length = total = self._length + new
        self.keys, self.values = key_buffer.narrow(-2, 0, total), value_buffer.narrow(-2, 0, total)

    def has_room_for(self, batch_size: int, new: int, packed, dtype, device) -> bool:
        """Whether `new` tokens of a `PackedCache` layer's states (`batch_size` rows, `dtype`, on `device`) can be
        written into the buffers at the current length (which `keys`/`values` still cover)."""
        if self._buffers is None or not self.is_initialized or self._length != self.keys.shape[-2]:
            return False
        key_buffer, value_buffer = self._buffers
        return (self.keys.data_ptr() == key_buffer.data_ptr() and self.values.data_ptr() == value_buffer.data_ptr()
                and self.keys.stride() == key_buffer.stride() and self.values.stride() == value_buffer.stride()
                and self._length + new <= key_buffer.shape[-2] and key_buffer.shape[0] == batch_size
                and key_buffer.shape[1] == sum(packed.key_heads) and key_buffer.shape[-1] == packed.head_dim
                and value_buffer.shape[-1] == sum(packed.value_widths)
                and key_buffer.dtype == value_buffer.dtype == dtype and key_buffer.device == device)

    def _packed_views(self, packed, value_buffer):
        """(value rows `[b, capacity, width]`, keys per head type and values over the whole buffers), made once per
        buffers and layout."""
        views = self.__dict__.get("_views")
        if views is None or views[0] is not packed or views[1] is not self._buffers:
            rows = value_buffer[:, 0]
            keys, parts = packed.views(self._buffers[0], list(rows.split(packed.value_widths, dim=-1)))
            views = self._views = (packed, self._buffers, (rows, keys, parts))
        return views[2]

    def _owns(self, length, key_states, value_states) -> bool:
        """Whether `keys`/`values` are still this layer's prefix views with room for the new states."""
        if self._buffers is None or length != self._length:
            return False
        for cached, buffer, new in zip((self.keys, self.values), self._buffers, (key_states, value_states)):
            if (cached.data_ptr() != buffer.data_ptr() or cached.stride() != buffer.stride()
                    or new.shape[:-2] != buffer.shape[:-2] or new.shape[-1] != buffer.shape[-1]
                    or new.dtype != buffer.dtype or new.device != buffer.device
                    or length + new.shape[-2] > buffer.shape[-2]):
                return False
        return True

    def _reallocate(self, length, needed, key_states, value_states):
        capacity = max(needed, self.capacity or 0)
        if self._buffers is not None and needed > (self.capacity or 0):
            capacity = max(capacity, 2 * needed)  # growing past the hint: double
        buffers = []
        for cached, new in ((self.keys, key_states), (self.values, value_states)):
            dtype = new.dtype if length == 0 else torch.promote_types(cached.dtype, new.dtype)
            buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1], dtype=dtype)
            if length > 0:
                buffer[..., :length, :].copy_(cached)
            buffers.append(buffer)
        self._buffers = tuple(buffers)

    def reset(self) -> None:
        """Drop keys, values and buffers without zeroing them in place (earlier views keep their values)."""
        self._buffers, self._length = None, 0
        self.keys = self.values = None
        self.is_initialized = False
        super().reset()


class RingSlidingWindowLayer(DATStaticSlidingWindowLayer):
    """A `DATStaticSlidingWindowLayer` kept as a ring: position t lives in slot t mod `max_cache_len`. A one-token
    update writes its slot without branching (the count is a tensor, so one compiled step serves every token) and
    returns the slots in ring order (`to_slots` rotates its mask, `receiver_slots` gives the receivers' slots);
    longer updates run eagerly and return the window oldest first."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        size, new = self.max_cache_len, key_states.shape[-2]
        if new == 1:
            slot = (self.cumulative_length % size).view(1)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            self.cumulative_length.add_(1)
            return self.keys, self.values
        if torch.compiler.is_compiling():
            raise ValueError(
                f"A compiled step may add one token at a time to a sliding-window static cache (got {new}); run longer "
                "steps eagerly (`generate` with a compile config compiles the chunks of `prefill_chunk_size`: leave it "
                "unset)."
            )
        seen = int(self.cumulative_length)
        if seen + new <= size:  # the window is not full yet: slots are positions
            for cache, state in ((self.keys, key_states), (self.values, value_states)):
                cache[:, :, seen:seen + new].copy_(state)
            self.cumulative_length.add_(new)
            return self.keys, self.values
        # return up to `size - 1` earlier tokens and the new ones; keep the last `size`
        earlier = torch.arange(seen - min(seen, size - 1), seen, device=self.device) % size
        kept = torch.arange(seen + new - size, seen + new, device=self.device) % size
        states = []
        for cache, state in ((self.keys, key_states), (self.values, value_states)):
            states.append(torch.cat((cache.index_select(2, earlier), state), dim=-2))
            cache.index_copy_(2, kept, states[-1][:, :, -size:])
        self.cumulative_length.add_(new)
        return tuple(states)

    def get_seq_length(self):
        """The tokens seen, as a tensor (a compiled step does not specialize on it)."""
        return self.cumulative_length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if torch.compiler.is_compiling():
            raise ValueError(
                "The masks of a sliding-window static cache are built outside the compiled step (they depend on the "
                "tokens seen): pass `attention_mask=model.create_masks_for_generate(...)`, as `generate` does."
            )
        self.cumulative_length_int = int(self.cumulative_length) if self.is_initialized else 0
        return super().get_mask_sizes(query_length)

    def to_slots(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """A mask `[..., q, kv]` built oldest first -> in the order of the keys the next update returns."""
        seen, size = self.cumulative_length_int, self.max_cache_len
        if mask is None or mask.shape[-2] != 1 or seen < size:
            return mask
        return mask.roll((seen + 1) % size, dims=-1)

    def receiver_slots(self, query_length: int) -> dict:
        """Where the next update's receivers sit among the keys it returns (`cache_dat.receiver_slots`): the first
        one's index (a copy: the count is updated in place) and the ring's size."""
        seen, size = self.cumulative_length, self.max_cache_len
        first = seen % size if query_length == 1 else seen.clamp(max=size - 1)
        return {"offset": first.clone(), "ring": size}


def register() -> None:
    """Install the layers in `cache_dat.CACHE_LAYERS`."""
    CACHE_LAYERS.register("dynamic", InPlaceCacheLayer)
    CACHE_LAYERS.register("static_sliding", RingSlidingWindowLayer)


__all__ = ["InPlaceCacheLayer", "RingSlidingWindowLayer", "register"]
