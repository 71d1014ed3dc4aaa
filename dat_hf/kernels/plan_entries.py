"""The attention plan's entries as `import dat_hf` installs them (`attention_plan.PLAN_ENTRIES`; the model files never
import this module: remote code alone runs `PlannedSensory` and `PlannedRelational`, with the same results).

- Both head types attend block by block over a mask with receiver blocks (`receiver_blocks.ReceiverBlocks`).
- The relational heads fall back from a compiled backend whose kernel fails (`RelationalBackendUnavailable`) to the
  next one, dropping it on that device type for the process with one `RuntimeWarning` (a requested backend re-raises).
"""

import warnings

import torch

from ..attention_plan import PLAN_ENTRIES, PlannedRelational, PlannedSensory
from ..masking_dat import AttentionMask
from ..relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalBackendUnavailable
from .receiver_blocks import ReceiverBlocks


class BlockedSensory(ReceiverBlocks, PlannedSensory):
    """Sensory heads, block by block over a mask with receiver blocks."""

    def __call__(self, module, query, key, value, dropout: float = 0.0, **kwargs):
        if self.blocks is None:
            return super().__call__(module, query, key, value, dropout, **kwargs)
        return self._zero_isolated(self._by_blocks(lambda mask, receivers, senders: self._run(
            module, *receivers, *senders, mask, dropout, **kwargs), [(query, 2)], [(key, 2), (value, 2)]))


class BlockedRelational(ReceiverBlocks, PlannedRelational):
    """Relational heads, block by block over a mask with receiver blocks (not for position-relative symbols, whose
    rows follow each receiver's position); where a compiled backend's kernel fails to compile or launch
    (`RelationalBackendUnavailable`), the next backend takes over.
    """

    def __call__(self, module, *args, **kwargs):
        if torch.compiler.is_compiling():
            return super().__call__(module, *args, **kwargs)
        while True:
            try:
                return super().__call__(module, *args, **kwargs)
            except RelationalBackendUnavailable as error:
                self._fall_back(error)

    def _blockable(self, source: AttentionMask) -> bool:
        return not self.call.relative_symbols and super()._blockable(source)

    def _attend(self, query, key, symbol_values, relation_queries, relation_keys, relation_proj, spec, dropout,
                symbols_at):
        if self.blocks is None or self.per_request:
            return super()._attend(query, key, symbol_values, relation_queries, relation_keys, relation_proj, spec,
                                   dropout, symbols_at)

        def attend_block(mask, receivers, senders):
            (query_part, relation_query_part), (key_part, symbol_part, relation_key_part) = receivers, senders
            return self.function(query_part, key_part, symbol_part, relation_query_part, relation_key_part,
                                 relation_proj, mask, spec, dropout)[0]

        return self._zero_isolated(self._by_blocks(attend_block, [(query, 2), (relation_queries, 1)],
                                                   [(key, 2), (symbol_values, 2), (relation_keys, 1)]))

    def _fall_back(self, error: RelationalBackendUnavailable):
        """Drop the failed backend on this device type for the process (one `RuntimeWarning`) and take the next;
        re-raise for a requested backend."""
        device, failed = self.call.device, self.name
        if (self.requested is not None or failed == "eager"
                or (failed, device) in RELATIONAL_ATTENTION_FUNCTIONS.unavailable):
            raise error
        RELATIONAL_ATTENTION_FUNCTIONS.unavailable[(failed, device)] = str(error)
        self.__init__(self.source, self.call, self.requested, self.attn_implementation, self.per_request)
        warnings.warn(f"dat_hf: the {failed!r} relational attention backend is not used on {device} from now on in "
                      f"this process; {self.name!r} runs instead. {error}", RuntimeWarning, stacklevel=3)


def register() -> None:
    """Install the entries into the attention plan."""
    PLAN_ENTRIES.register("sensory", BlockedSensory)
    PLAN_ENTRIES.register("relational", BlockedRelational)


__all__ = ["BlockedRelational", "BlockedSensory", "register"]
