# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""DAT's cache in one module: one layer's packed layout (`PackedCache`: keys `[b, h_kv, n, d_h]` and one flat value
slot `[b, 1, n, width]`, so keys and values have their own head counts), the layers that hold it in Transformers'
caches (`prepare_cache`), and continuous batching (`PagedCache` over Transformers' `PagedAttentionCache`, each bias's
mask over the packed requests, `continuous_batching_limits`: what it cannot serve).

The model meets it through one object per forward, `ForwardCache` (`open_cache`; `PagedCache` for continuous
batching): the forward asks it for its masks, each layer for its write and read (`update`), its receivers' slots and
its cross-attention's source; it never asks which cache it has.

The layers DAT gives Transformers' caches (`prepare_cache`): in a `DynamicCache`, `InPlaceCacheLayer`s (buffers with
spare room: a decoding step copies one token; a dual-attention layer's parts written unpacked, `update_packed`); in a
`StaticCache`, `DATStaticLayer`s (keys and values with their own head counts) and, for sliding windows, the ring
`RingSlidingWindowLayer` (a step writes one slot, one compiled graph serves every step; its keys come in slot order:
masks ask it for `to_slots`, position-relative symbols for `receiver_slots`). A layer is asked for these by name, never
by class, so any layer with Transformers' `update` serves.
"""

from functools import lru_cache, partial

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache,
                                      StaticCache, StaticLayer, StaticSlidingWindowLayer)
from transformers.masking_utils import and_masks, sliding_window_causal_mask_function

from .kernel_hooks import check_inputs
from .masking_dat import (AttentionMask, build_masks, prebuilt_masks, transformers_window, uses_flex_attention,
                          with_row_validity)
from .relational_biases import RELATIONAL_BIASES, mask_function_of, pair_mask, relational_bias
from .transformers_compat import PagedAttentionCache, attention_implementation, paged_cache_limits


# ---- the packed layout ----------------------------------------------------------------------------------------------
class PackedCache:
    """One cache layer's layout: keys `[b, h_kv_r + h_kv_s, n, d_h]` (relational first) and one flat value slot
    `[b, 1, n, width]` = sensory values | symbol values | relation keys (those the layer has)."""

    def __init__(self, sensory, relational, head_dim: int, shared_keys: bool = False):
        self.head_dim = head_dim
        self.key_heads = tuple(m.num_kv_heads for m in (relational, sensory)
                               if m is not None and not (m is sensory and shared_keys))
        value_heads = (sensory.num_kv_heads,) if sensory is not None else ()  # 0: relation keys `[b, n, R, d_r]`
        if relational is not None:
            value_heads += ((relational.num_kv_heads,) if not relational.relative_symbols else ()) + (0,)
            self.relation_shape = (relational.num_relations, relational.relation_dim)
        self.value_heads = value_heads
        self.value_widths = tuple(h * head_dim if h else self.relation_shape[0] * self.relation_shape[1]
                                  for h in value_heads)

    def pack(self, keys: list, values: list):
        """Keys `[b, h_kv, n, d_h]`, flat values `[b, n, width]` -> `[b, sum h_kv, n, d_h]`, `[b, 1, n, sum width]`."""
        return (torch.cat(keys, dim=1) if len(keys) > 1 else keys[0],
                (torch.cat(values, dim=-1) if len(values) > 1 else values[0])[:, None])

    def unpack(self, key_cache, value_cache):
        """-> (keys per head type `[b, h_kv, N, d_h]`, values: see `views`)."""
        return self.views(key_cache, value_cache[:, 0].split(self.value_widths, dim=-1))

    def views(self, key_cache, values: list):
        """Keys `[b, sum h_kv, N, d_h]`, flat values -> keys per head type `[b, h_kv, N, d_h]`, `value_views`."""
        return key_cache.split(self.key_heads, dim=1), self.value_views(values)

    def value_views(self, values: list) -> list:
        """Flat values `[b, N, width]` -> sensory/symbol values `[b, h_kv, N, d_h]`, relation keys `[b, N, R, d_r]`."""
        return [part.view(*part.shape[:2], heads, self.head_dim).transpose(1, 2) if heads
                else part.view(*part.shape[:2], *self.relation_shape) for heads, part in zip(self.value_heads, values)]


def packed_update(cache, packed: PackedCache, keys, values: list, layer_idx: int):
    """Write one layer's keys `[b, h_k, n, d_h]` and flat values `[b, n, width]` (`packed`'s order) into `cache` (a
    forward's `ForwardCache`, or none) and read back all it holds -> `packed.views`' keys per head type and values."""
    return forward_cache(cache).update(packed, keys, values, layer_idx)


# ---- the layers of Transformers' caches -------------------------------------------------------------------------
class DATStaticLayer(StaticLayer):
    """A `StaticLayer` with keys `[b, h_kv, max_len, d_h]` and values `[b, 1, max_len, width]`;
    `max_cache_len=None`: the first update's length (cross-attention)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.max_cache_len is None:
            self.max_cache_len = key_states.shape[-2]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys = key_states.new_zeros(self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim)
        self.values = value_states.new_zeros(self.batch_size, value_states.shape[1], self.max_cache_len,
                                             self.v_head_dim)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():  # fixed addresses for cudagraphs
            for tensor in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(tensor)
        self.is_initialized = True


class DATStaticSlidingWindowLayer(DATStaticLayer, StaticSlidingWindowLayer):
    """A `StaticSlidingWindowLayer` with DAT's packed values: Transformers' updates and mask sizes (the window kept
    oldest first, rolled by each token once full), DAT's lazy initialization. `RingSlidingWindowLayer` is what
    `prepare_cache` gives; this is Transformers' own behaviour, which the ring's tests are held to."""


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


# the layers `prepare_cache` gives a fresh cache's unused full and sliding layers (Transformers' own behaviour, which
# the tests hold these to: `DynamicLayer`, `DATStaticSlidingWindowLayer`)
DYNAMIC_LAYER = InPlaceCacheLayer
STATIC_SLIDING_LAYER = RingSlidingWindowLayer


def prepare_cache(cache: Cache | None, capacity: int | None = None, in_place: bool = True,
                  cross_attention: bool = False) -> Cache | None:
    """Give a fresh cache's unused layers DAT's: `DATStaticLayer`s and ring sliding layers (`STATIC_SLIDING_LAYER`)
    in a `StaticCache`; in a `DynamicCache`, with `in_place`, in-place layers (`DYNAMIC_LAYER`, `capacity`: expected
    length); an `EncoderDecoderCache`'s cross-attention half gets full layers. Returns `cache`."""
    if isinstance(cache, EncoderDecoderCache):
        prepare_cache(cache.self_attention_cache, capacity, in_place)
        prepare_cache(cache.cross_attention_cache, None, in_place, cross_attention=True)
    elif type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        faster = DYNAMIC_LAYER if in_place and DYNAMIC_LAYER is not DynamicLayer else None
        full = DynamicLayer if faster is None else partial(faster, capacity)
        for i, layer in enumerate(cache.layers):
            if not layer.is_initialized and (type(layer) is DynamicLayer and faster is not None
                                             or type(layer) is DynamicSlidingWindowLayer and cross_attention):
                cache.layers[i] = full()
        if cache.layer_class_to_replicate is DynamicLayer:
            cache.layer_class_to_replicate = full
    elif isinstance(cache, StaticCache):
        sliding = STATIC_SLIDING_LAYER
        for i, layer in enumerate(cache.layers):
            unused = not layer.is_initialized or _initialized_ahead(layer)
            if type(layer) is StaticLayer and unused:
                cache.layers[i] = DATStaticLayer(layer.max_cache_len)
            elif type(layer) is StaticSlidingWindowLayer and unused:
                cache.layers[i] = (DATStaticLayer(None) if cross_attention
                                   else sliding(layer.max_cache_len, sliding_window=layer.max_cache_len))
    return cache


def _initialized_ahead(layer) -> bool:
    """Whether a static layer was initialized ahead and holds no token (DAT resizes it); never while tracing."""
    if not layer.is_initialized or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return int(layer.cumulative_length) == 0


def check_cache(cache: Cache) -> None:
    """Raise for caches whose layers cannot hold DAT's packed keys and values."""
    caches = ([cache.self_attention_cache, cache.cross_attention_cache] if isinstance(cache, EncoderDecoderCache)
              else [cache])
    for part in caches:
        for layer in part.layers:
            if isinstance(layer, StaticLayer) and not isinstance(layer, DATStaticLayer):
                raise ValueError(
                    f"This cache's {type(layer).__name__}s were filled by another model, or initialized ahead with one "
                    "shape for keys and values while exporting: DAT caches need their own layers (keys and values "
                    "with different head counts, sized at their first update); pass a fresh cache. To export with a "
                    "static cache (Transformers' `TorchExportableModuleForDecoderOnlyLM`), use "
                    "`dat_hf.export.DATExportableModuleForDecoderOnlyLM`."
                )


def self_attention_cache(cache):
    """The cache of the layers' own keys and values: an `EncoderDecoderCache`'s self-attention half, else `cache`."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


class ForwardCache:
    """One forward's cache, as the forward asks of it (`open_cache`): Transformers' cache (dynamic, static, sliding
    window; for the seq2seq decoder an `EncoderDecoderCache`, its own half and the source's), or none. It answers:
    the masks of the forward's biases (`masks`), a layer's write and read (`update`), where its receivers sit among
    the keys (`receiver_slots`), the cross-attention's source keys and values (`source`), whether rows are requests
    (`rows_are_requests`), the padding the inputs are checked against (`padding`), and what the forward returns
    (`cache`). Continuous batching's `PagedCache` answers the same."""

    rows_are_requests = False  # (continuous batching's decoding steps: each row is one request's receiver)

    def __init__(self, cache: Cache | None = None):
        self.cache = cache
        self.own = self_attention_cache(cache)  # (the layers' own keys and values)
        self.cross = cache.cross_attention_cache if isinstance(cache, EncoderDecoderCache) else None
        self.past_seen = 0 if self.own is None else self.own.get_seq_length()

    def padding(self, attention_mask):
        """The caller's mask, as the inputs' padding to check."""
        return attention_mask

    def masks(self, biases, config, inputs_embeds, attention_mask, position_ids=None, graph_adjacency=None,
              causal: bool = True) -> dict:
        """`{bias: AttentionMask}` for each distinct bias: built once (`masking_dat.build_masks`), or handed over
        (`attention_mask` a dict `{bias: mask}` from `create_masks_for_generate`)."""
        if isinstance(attention_mask, dict):
            return prebuilt_masks(attention_mask, biases, causal, uses_flex_attention(config))
        check_inputs("graph_inputs", biases, graph_adjacency, inputs_embeds.shape[0], inputs_embeds.shape[1], self.own)
        return build_masks(biases, config, inputs_embeds, attention_mask, self.own, position_ids, graph_adjacency,
                           causal=causal)

    def layer(self, layer_idx: int):
        """The cache layer (Transformers' layer object) of self-attention layer `layer_idx`, or None."""
        layers = () if self.own is None else self.own.layers
        return layers[layer_idx] if layer_idx < len(layers) else None

    def update(self, packed: PackedCache, keys, values: list, layer_idx: int):
        """`packed_update`: no cache, the new states' views; a layer with an `update_packed` (`InPlaceCacheLayer`)
        takes the parts unpacked; any other layer packs them (`Cache.update`)."""
        if self.own is None:
            return packed.views(keys, values)
        update_packed = getattr(self.layer(layer_idx), "update_packed", None)
        if update_packed is not None:
            return update_packed(packed, keys, values)
        return packed.unpack(*self.own.update(*packed.pack([keys], values), layer_idx))

    def receiver_slots(self, layer_idx: int, query_length: int, clip: int) -> dict:
        """Where this step's receivers sit among the keys `update` returns for `layer_idx` (read before it), for
        position-relative symbols (`RelativeSymbols`' fields): `offset` (the first receiver's index) and `ring` (a ring
        layer's slots); none without a cache."""
        if self.own is None:
            return {}
        slots = getattr(self.layer(layer_idx), "receiver_slots", None)  # (a ring layer's)
        if slots is not None:
            return slots(query_length)
        # (a copy: a static layer's count is updated in place)
        offset = self.own.get_query_offset(layer_idx) - self.own.get_mask_sizes(query_length, layer_idx)[1]
        return {"offset": torch.as_tensor(offset).clone()}

    def source(self, packed: PackedCache, layer_idx: int, project):
        """The cross-attention keys and values of layer `layer_idx`: those its cache layer holds, else `project()`'s
        (keys per head type `[b, h_kv, m, d_h]`, flat values `[b, m, width]`), stored in the cache if there is one ->
        keys per head type, value views (`PackedCache.value_views`)."""
        cross = self.cross
        if cross is not None and self.cache.is_updated.get(layer_idx):
            layer = cross.layers[layer_idx]
            return packed.unpack(layer.keys, layer.values)
        keys, values = project()
        if cross is None:
            return keys, packed.value_views(values)
        self.cache.is_updated[layer_idx] = True
        return packed.unpack(*cross.update(*packed.pack(keys, values), layer_idx))

    def holds_source(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s cross-attention cache layer holds the source's keys and values already."""
        return self.cross is not None and bool(self.cache.is_updated.get(layer_idx))


NO_CACHE = ForwardCache()


def forward_cache(cache) -> ForwardCache:
    """`cache` as a `ForwardCache`: itself, the no-cache view for None, else a view of the Transformers cache."""
    if isinstance(cache, ForwardCache):
        return cache
    return NO_CACHE if cache is None else ForwardCache(cache)


def open_cache(cache, config, position_ids, start: bool, kwargs: dict) -> ForwardCache:
    """The cache one decoder forward reads and writes, as a `ForwardCache`: continuous batching's
    `PagedAttentionCache` as this batch's `PagedCache` (its arguments taken out of `kwargs`); with `start`, a new
    `DynamicCache` (an `EncoderDecoderCache` for an encoder-decoder config); a given cache with DAT's layers where
    unused (`prepare_cache`), checked (`check_cache`)."""
    if isinstance(cache, PagedAttentionCache):
        arguments = {name: kwargs.pop(name) for name in PAGED_ARGUMENTS if name in kwargs}
        return PagedCache(cache, arguments, position_ids, config)
    if config.is_encoder_decoder and cache is not None and not isinstance(cache, EncoderDecoderCache):
        raise ValueError(f"The seq2seq decoder needs an `EncoderDecoderCache` as `cache`, got {type(cache).__name__}.")
    if start:
        cache = DynamicCache(config=config)
        if config.is_encoder_decoder:  # (the seq2seq decoder: its own keys and values, the source's)
            cache = EncoderDecoderCache(cache, DynamicCache(config=config))
    if cache is None:
        return NO_CACHE
    check_cache(prepare_cache(cache, in_place=start))  # (a user's dynamic cache keeps its layers)
    return ForwardCache(cache)


def receiver_slots(cache, layer_idx: int, query_length: int, clip: int) -> dict:
    """`ForwardCache.receiver_slots` of `cache` (a forward's view, or none)."""
    return forward_cache(cache).receiver_slots(layer_idx, query_length, clip)


# ---- continuous batching -----------------------------------------------------------------------------------------
# what continuous batching hands the forward for its paged cache (besides ids, positions, mask)
PAGED_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "read_index", "write_index",
                   "block_table", "is_causal", "logits_indices", "logits_processor_args")


class PagedCache(ForwardCache):
    """One continuous-batching forward over Transformers' `PagedAttentionCache` (`cache`), as a `ForwardCache`: one
    packed row of M new tokens of many requests (`position_ids` `[1, M]`). DAT's packed token is zero-padded to
    `2 * num_key_value_heads * head_dim` and stored as the cache's key and value halves."""

    def __init__(self, cache, arguments: dict, position_ids: torch.Tensor, config):
        self.cache, self.arguments, self.own, self.cross, self.past_seen = cache, arguments, None, None, 0
        self.position_ids = position_ids.reshape(-1)  # [M]
        # decoding steps: relational heads attend one receiver per row (`per_request`), except relative symbols
        self.rows_are_requests = (arguments.get("max_length_q") == 1
                                  and config.symbol_retrieval != "position_relative")
        self._relative_index, self._key_positions = {}, {}

    def padding(self, attention_mask):
        """None: continuous batching's mask is each layer type's over the packed requests, not padding."""
        return None

    def masks(self, biases, config, inputs_embeds, attention_mask, *args, **kwargs) -> dict:
        """Each bias's mask over the packed requests (`paged_masks`)."""
        return paged_masks(attention_mask, config, self)

    def receiver_slots(self, layer_idx: int, query_length: int, clip: int) -> dict:
        """`index`: relative-symbol rows per (receiver, key) pair, long `[M, N]`."""
        return {"index": self.relative_position_index(layer_idx, clip)}

    def source(self, packed, layer_idx: int, project):
        raise ValueError("Continuous batching serves decoder-only models (no cross-attention).")

    def update(self, packed, keys: torch.Tensor, values: list, layer_idx: int):
        """Keys `[1, h_k, M, d_h]` and flat values `[1, M, width]` (a `PackedCache`'s order) -> as `packed.views`
        for the N tokens the receivers may read: keys per head type `[1, h_kv, N, d_h]`, values (`paged_views`)."""
        _, key_heads, m, d = keys.shape
        parts = [keys.transpose(1, 2).reshape(1, m, key_heads * d), *values]
        widths = tuple(part.shape[-1] for part in parts)
        width = sum(widths)
        heads = -(-width // (2 * d))  # `num_key_value_heads`: each half holds `heads * d` of a token
        half = heads * d
        if 2 * half > width:
            parts.append(keys.new_zeros(1, m, 2 * half - width))
        tokens = torch.cat(parts, dim=-1)  # [1, M, 2 half]
        # the halves as `[1, heads, M, d]` views; the cache rewrites its kwargs, so each layer gets a copy
        new = [tokens.as_strided((1, heads, m, d), (m * 2 * half, d, 2 * half, 1), tokens.storage_offset() + i * half)
               for i in (0, 1)]
        return paged_views(packed, self.cache.update(*new, layer_idx, dict(self.arguments)), widths)

    def key_positions(self, layer_type: str) -> torch.Tensor:
        """The positions of the N keys the layers of `layer_type` read: each request's keys, in order, the last at
        its last query's position -> long `[N]`."""
        if layer_type not in self._key_positions:
            starts = self.arguments["cu_seq_lens_k"]
            starts = (starts[layer_type] if isinstance(starts, dict) else starts).long()
            ends_q = self.arguments["cu_seq_lens_q"][1:].long() - 1
            lengths = starts[1:] - starts[:-1]
            request = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
            column = torch.arange(int(starts[-1]), device=starts.device)
            self._key_positions[layer_type] = self.position_ids[ends_q][request] - (starts[1:][request] - 1 - column)
        return self._key_positions[layer_type]

    def relative_position_index(self, layer_idx: int, clip: int) -> torch.Tensor:
        """Relative-symbol rows per (receiver, key) pair: long `[M, N]`, `clip(key pos - receiver pos, -K, K) + K`."""
        layer_type = self.cache.layer_to_allocator[layer_idx].layer_type
        if layer_type not in self._relative_index:
            offsets = self.key_positions(layer_type)[None, :] - self.position_ids[:, None]
            self._relative_index[layer_type] = offsets.clamp(-clip, clip) + clip
        return self._relative_index[layer_type]


def _token_rows(read: torch.Tensor):
    """A half read back, `[1, heads, N, d]` -> (tensor with each token's `heads * d` elements contiguous, token
    stride, token 0's storage offset)."""
    if read.stride(3) != 1 or read.stride(1) != read.shape[3]:
        read = read.transpose(1, 2).contiguous().transpose(1, 2)
    return read, read.stride(2), read.storage_offset()


@lru_cache(maxsize=None)
def paged_layout(widths: tuple[int, ...], head_dim: int) -> tuple[int, int, tuple]:
    """A packed token of parts `widths` in the cache's two halves -> (heads, zero padding, per part (half, start,
    end), or (None, start in the first half, end in the second) for the part across them)."""
    width = sum(widths)
    heads = -(-width // (2 * head_dim))
    half, pieces, start = heads * head_dim, [], 0
    for part in widths:
        end = start + part
        if end <= half:
            pieces.append((0, start, end))
        elif start >= half:
            pieces.append((1, start - half, end - half))
        else:
            pieces.append((None, start, end - half))
        start = end
    return heads, 2 * half - width, tuple(pieces)


def paged_views(packed: PackedCache, halves, widths: tuple) -> tuple:
    """The cache's key and value halves read back, `[1, heads, N, d_h]` each, holding N packed tokens of parts
    `widths` -> `packed.views` of them: keys per head type `[1, h_kv, N, d_h]`, values; strided views of the pages,
    without a copy (except the one part that straddles the halves, joined)."""
    d = packed.head_dim
    heads, _, pieces = paged_layout(widths, d)
    half = heads * d
    read = [_token_rows(part) for part in halves]
    n = read[0][0].shape[2]
    # per part: (element offset, heads; 0: relation keys), keys one per head type
    part_views = [[(sum(packed.key_heads[:i]) * d, h) for i, h in enumerate(packed.key_heads)]]
    part_views += [[(0, h)] for h in packed.value_heads]
    views = []
    for (h, start, end), width, offsets in zip(pieces, widths, part_views):
        if h is None:  # across the halves: both pieces, `[N, width]`
            (first, row0, at0), (second, row1, at1) = read
            base = torch.cat((first.as_strided((n, half - start), (row0, 1), at0 + start),
                              second.as_strided((n, end), (row1, 1), at1)), dim=-1)
            row, at = width, base.storage_offset()
        else:
            base, row, at = read[h]
            at += start
        for offset, heads in offsets:  # `[1, heads, N, d]`, or relation keys `[1, N, R, d_r]`
            size, stride = (((heads, n, d), (d, row, 1)) if heads else
                            ((n, *packed.relation_shape), (row, packed.relation_shape[1], 1)))
            views.append(base.as_strided((1, *size), (n * row, *stride), at + offset))
    return views[:len(packed.key_heads)], views[len(packed.key_heads):]


def paged_masks(attention_mask, config, cache) -> dict[str, AttentionMask]:
    """Continuous batching's additive mask `[1, 1, M, N]` (or `{layer type: mask}`: causal order, or the window in
    sliding layers, within each request) -> `{bias: AttentionMask}`: each bias's graph over the packed tokens'
    positions (`PagedCache.position_ids`, `key_positions`) within its layers' mask: its mask function, a window in
    full-attention layers. Raises ValueError without a mask."""
    if attention_mask is None:
        raise ValueError("Continuous batching gave no attention mask: DAT's heads run with 'sdpa' or 'eager' "
                         "(`attn_implementation`), for which Transformers' manager builds one.")
    masks = {}
    for pair, kind in zip(config.layer_biases(), config.layer_types):
        for bias in pair:
            if bias in masks:  # (a bias's layers are all of one type: `DATConfig.layer_types`)
                continue
            mask = attention_mask[kind] if isinstance(attention_mask, dict) else attention_mask
            allowed = mask if mask.dtype == torch.bool else mask == 0
            graph = _paged_graph(relational_bias(bias), kind, config, cache, mask.device)
            if graph is not None:
                allowed = allowed & graph[None, None]
            # receiver blocks skip other requests' senders (not looked for under two blocks of receivers)
            masks[bias] = with_row_validity(allowed, is_causal=False, min_blocks=2)
    return masks


def _paged_graph(entry, kind: str, config, cache, device) -> torch.Tensor | None:
    """Bias `entry`'s graph beyond its layers' paged mask (which holds causal order, and the window in sliding
    layers), over receivers at `cache.position_ids` and the keys of `kind` -> bool `[M, N]` on `device`, or None if
    none."""
    functions = []
    if entry.window and kind != "sliding_attention":  # (a window in full-attention layers)
        functions.append(sliding_window_causal_mask_function(transformers_window(config.sliding_window_size, False)))
    function = mask_function_of(entry, config, device)
    if function is not None:
        functions.append(function)
    if not functions:
        return None
    senders = cache.key_positions(kind)
    return pair_mask(and_masks(*functions), cache.position_ids, senders)


def continuous_batching_limits(config, tp_size: int = 1) -> list[str]:
    """Why continuous batching (packed requests over a paged cache, each bias's graph built over their positions:
    `paged_masks`) cannot serve a model of `config` over `tp_size` tensor-parallel ranks: one line per reason, empty
    when it can. The one list of what it refuses (a model's `continuous_batching_limits`: `init_continuous_batching`
    raises it; `python -m dat_hf.serve` serves such models by `generate`)."""
    if config.is_encoder_decoder:
        limits = [f"{type(config).__name__} is an encoder-decoder (continuous batching serves decoder-only models)"]
    else:
        limits = []
        for name in ("relational_bias", "relational_heads_bias"):
            value = getattr(config, name)
            for bias in dict.fromkeys(value if isinstance(value, list) else [value]):
                if bias is not None and (reason := paging_limit(bias)) is not None:
                    limits.append(f"`{name}`={bias!r}: {reason} (continuous batching serves {paged_biases()})")
        # (Transformers' manager refuses it: "Implementation flex_attention is not supported for continuous batching")
        if attention_implementation(config) == "flex_attention":
            limits.append("`attn_implementation`='flex_attention' (Transformers' continuous batching runs 'sdpa' or "
                          "'eager' heads over its paged cache)")
        # CODEPATH: a refusal, no checkpoint: no released config sets `relational_attn_implementation`.
        if config.relational_attn_implementation == "flex_attention":
            limits.append("`relational_attn_implementation`='flex_attention' (continuous batching's masks are "
                          "tensors; leave it unset or use 'sdpa'/'eager')")
        if tp_size > 1:
            limits.append(f"a tensor-parallel DAT model (tp_size={tp_size}): the paged cache would split DAT's packed "
                          "cache layer by key/value heads (call `generate` instead)")
    release = paged_cache_limits()
    return limits + ([release] if release else [])


def paging_limit(name: str) -> str | None:
    """Why continuous batching cannot serve bias `name` (packed requests, its graph over their positions); None when
    it can."""
    bias = relational_bias(name)
    if bias.inputs:
        return f"its graph comes with each input (`{bias.inputs[0]}`), which packed requests do not carry"
    if not bias.decoder:
        return "not a graph for decoders"
    return None


def paged_biases() -> list[str]:
    """The biases continuous batching serves (`paging_limit`)."""
    return [name for name, bias in RELATIONAL_BIASES.items() if not bias.cross and paging_limit(name) is None]


__all__ = ["DATStaticLayer", "DATStaticSlidingWindowLayer", "DYNAMIC_LAYER", "ForwardCache", "InPlaceCacheLayer",
           "NO_CACHE", "RingSlidingWindowLayer", "STATIC_SLIDING_LAYER", "PAGED_ARGUMENTS", "PackedCache",
           "PagedCache", "check_cache", "forward_cache", "continuous_batching_limits", "open_cache", "packed_update",
           "paged_biases", "paged_layout", "paged_masks", "paged_views", "paging_limit", "prepare_cache",
           "receiver_slots", "self_attention_cache"]
