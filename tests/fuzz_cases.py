"""The differential fuzzer's cases (used by `test_fuzz_attention.py`): a seed draws a whole DAT model and its inputs
from the space the models accept, and `check_case` compares it with the float64 reference.

A case (`draw_case(seed)`) draws:
- the model: a causal LM or a bidirectional encoder; 1-3 layers; 0-4 sensory and 1-4 relational heads (or 1-4
  sensory and 0 relational), GQA on either head type, `num_relations` / `relation_dim`, symmetric relations, shared
  attention projections, the relation activation, every symbol retriever (shared or per layer, tied libraries),
  RoPE / learned / no positions;
- the relational bias of each head type in each layer: causal, full, one- and two-sided windows of 1-64 tokens,
  sparse graphs (blocks of 1-16, 0-3 global tokens, explicit edges), per-input graphs (with isolated nodes);
- the inputs: batch 1-3, 1-300 tokens (mostly short: the reference is O(n^2)), left padding per row (a row may be
  all padding but one token);
- the backends: sensory `eager` / `sdpa` / `flex_attention` x relational every registered name or automatic
  selection, and the sizes at which receivers go block by block (`masking_dat.RECEIVER_BLOCK`) and the reference
  splits its receivers (`relational_attention.BLOCK_ELEMENTS`), so that short inputs take the blocked paths too;
- what is checked: float32 against the float64 reference (eager, explicit stages), bf16 against it, or cached
  generation (dynamic, static, sliding-window ring caches) against recomputation without a cache, by scores.

Tolerances (logits of magnitude ~1-10, `initializer_range=0.2`): float32 `FP32_ATOL` + `FP32_RTOL` of the largest
reference logit (observed at most ~7e-6 over 1,500 cases); bf16 `BF16_TOL` of the largest reference logit
(`BF16_TOL_NARROW` below 8 features); where eager in the same dtype exceeds its bar itself, `FLOOR_FACTOR` times
eager's own error; cached vs recomputed float32 logits `CACHE_ATOL`.
FlexAttention runs uncompiled in drawn cases (PyTorch's own evaluation of the same `BlockMask`; compiling costs
~10 s per new shape on CPU); `test_fuzz_attention.py`'s regression cases run it compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import torch

from dat_hf import DATConfig, DATEncoderConfig, DATEncoderModel, DATForCausalLM
from dat_hf import relational_attention
import dat_hf.masking_dat as masking_dat
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS

FP32_ATOL, FP32_RTOL = 2e-5, 2e-5
FLOOR_FACTOR = 2  # (of eager's own error in the same dtype, where that exceeds the tolerance)
BF16_TOL, BF16_TOL_NARROW = 0.08, 0.25  # of the largest reference logit; narrow: `hidden_size` < 8, where a few
# bf16 roundings of 2-6 features move a norm's output by several percent (seed 848: 0.106 at hidden_size 2)
CACHE_ATOL = 1e-4
VOCAB = 61
SENSORY_BACKENDS = ("eager", "sdpa", "flex_attention")
CHECKS = ("fp32", "fp32", "fp32", "bf16", "cache")


@dataclasses.dataclass
class Case:
    seed: int
    config: dict
    encoder: bool
    batch: int
    length: int
    padding: list  # left padding per row
    sensory: str
    relational: str | None
    check: str
    receiver_block: int
    block_elements: int
    cache: str | None = None  # "dynamic", "static" (a ring where every layer is a sliding window)
    graph_density: float = 0.3

    def describe(self) -> str:
        return (f"seed={self.seed} check={self.check} cache={self.cache} encoder={self.encoder} batch={self.batch} "
                f"length={self.length} padding={self.padding} backends=({self.sensory}, {self.relational}) "
                f"receiver_block={self.receiver_block} block_elements={self.block_elements} config={self.config}")


def _bias(rng: random.Random, encoder: bool, length: int) -> str:
    choices = ["causal", "sliding_window", "sparse", "graph"] + (["full", "sliding_window_bidirectional"] if encoder
                                                                  else [])
    return rng.choice(choices)


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    check = rng.choice(CHECKS)
    encoder = check != "cache" and rng.random() < 0.3
    sensory_heads = rng.choice([0, 1, 2, 2, 3, 4])
    relational_heads = rng.choice([1, 2, 2, 4]) if sensory_heads == 0 or rng.random() < 0.9 else 0
    heads = sensory_heads + relational_heads
    positions = rng.choice(["rope", "rope", "learned", "none"])
    head_dim = rng.choice([2, 4, 6, 8])
    config = dict(vocab_size=VOCAB, hidden_size=head_dim * heads, num_hidden_layers=rng.choice([1, 2, 2, 3]),
                  num_sensory_heads=sensory_heads, num_relational_heads=relational_heads,
                  intermediate_size=rng.choice([8, 16, 32]), position_embedding_type=positions,
                  max_position_embeddings=320, initializer_range=0.2, hidden_act=rng.choice(["swiglu", "gelu"]),
                  norm_type=rng.choice(["rmsnorm", "layernorm"]), pre_norm=rng.random() < 0.8,
                  num_symbols=rng.choice([3, 8]), symbolic_attention_heads=rng.choice([1, 2]))
    if sensory_heads and rng.random() < 0.4:
        config["num_sensory_key_value_heads"] = rng.choice([d for d in (1, 2) if sensory_heads % d == 0])
    if relational_heads:
        if rng.random() < 0.4:
            config["num_relational_key_value_heads"] = rng.choice([d for d in (1, 2) if relational_heads % d == 0])
        if rng.random() < 0.5:
            config["num_relations"] = rng.choice([1, 2, 3, 5])
            config["relation_dim"] = rng.choice([1, 2, 4, 7])
        config["symmetric_relations"] = rng.random() < 0.25
        config["relation_activation"] = rng.choice(["identity"] * 4 + ["relu", "tanh", "gelu"])
        retrieval = rng.choice(["symbolic_attention", "positional", "position_relative"])
        config["symbol_retrieval"] = retrieval
        config["shared_symbol_retriever"] = rng.random() < 0.6
        if retrieval == "position_relative":
            config["max_relative_position"] = rng.choice([1, 3, 16])
        elif not config["shared_symbol_retriever"]:
            config["tie_symbol_library"] = rng.random() < 0.5
        if (sensory_heads == relational_heads and rng.random() < 0.2
                and config.get("num_sensory_key_value_heads") == config.get("num_relational_key_value_heads")):
            config["share_attention_params"] = True
    # inputs (mostly short; some long: the float64 reference is O(n^2) per layer)
    length = rng.choice([rng.randint(1, 24), rng.randint(1, 64), rng.randint(1, 64), rng.randint(65, 300)])
    if check == "cache":
        length = max(length, 2)
    batch = rng.randint(1, 3)
    padding = [0] * batch
    if rng.random() < 0.5:
        padding = [rng.choice([0, rng.randint(0, length - 1), length - 1]) for _ in range(batch)]
        padding[rng.randrange(batch)] = 0  # (one row without padding)
    # relational biases per head type, per layer or one for all
    layers = config["num_hidden_layers"]
    per_layer = rng.random() < 0.4
    sensory_bias = [_bias(rng, encoder, length) for _ in range(layers)] if per_layer else _bias(rng, encoder, length)
    relational_bias = None
    if rng.random() < 0.5:
        relational_bias = ([_bias(rng, encoder, length) for _ in range(layers)] if per_layer
                           else _bias(rng, encoder, length))
    if check == "cache":  # (a per-input graph takes no cache)
        sensory_bias = _no_graph(sensory_bias, rng)
        relational_bias = None if relational_bias is None else _no_graph(relational_bias, rng)
    config["relational_bias"] = sensory_bias
    config["relational_heads_bias"] = relational_bias
    config["sliding_window_size"] = rng.choice([1, 2, 3, 5, 7, 16, 31, 64])
    config["sparse_block_size"] = rng.choice([1, 3, 4, 5, 16])
    config["sparse_global_tokens"] = rng.choice([0, 0, 1, 3])
    if rng.random() < 0.3:
        config["sparse_edges"] = [[rng.randrange(length + 4), rng.randrange(length + 4)] for _ in range(rng.randint(1, 6))]
    relational = rng.choice([None, None, *sorted(RELATIONAL_ATTENTION_FUNCTIONS)])
    cache = rng.choice(["dynamic", "static"]) if check == "cache" else None
    return Case(seed, config, encoder, batch, length, padding, rng.choice(SENSORY_BACKENDS), relational, check,
                receiver_block=rng.choice([256, 256, 16, 7, 3]), block_elements=rng.choice([1 << 22, 1 << 22, 64, 997]),
                cache=cache, graph_density=rng.choice([0.05, 0.3, 0.8]))


def _no_graph(bias, rng):
    if isinstance(bias, list):
        return [b if b != "graph" else "sparse" for b in bias]
    return "sparse" if bias == "graph" else bias


def make_config(case: Case, attn: str, relational: str | None):
    cls = DATEncoderConfig if case.encoder else DATConfig
    config = cls(**case.config, relational_attn_implementation=relational if case.config["num_relational_heads"]
                 else None)
    config._attn_implementation = attn
    return config


def make_inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(1, VOCAB, (case.batch, case.length), generator=g)
    mask = torch.ones(case.batch, case.length, dtype=torch.long)
    for row, pad in enumerate(case.padding):
        mask[row, :pad] = 0
    graph = torch.rand(case.batch, case.length, case.length, generator=g) < case.graph_density
    return ids, mask, graph


@contextlib.contextmanager
def block_sizes(case: Case):
    """The case's receiver block and reference block sizes (so short inputs take the blocked paths)."""
    saved = masking_dat.RECEIVER_BLOCK, relational_attention.BLOCK_ELEMENTS
    masking_dat.RECEIVER_BLOCK, relational_attention.BLOCK_ELEMENTS = case.receiver_block, case.block_elements
    try:
        yield
    finally:
        masking_dat.RECEIVER_BLOCK, relational_attention.BLOCK_ELEMENTS = saved


@contextlib.contextmanager
def uncompiled_flex():
    """FlexAttention evaluated by PyTorch without compiling (same `BlockMask`), and without its warning about it."""
    import warnings

    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield


def build(case: Case, attn: str, relational: str | None, dtype, state=None):
    config = make_config(case, attn, relational)
    torch.manual_seed(case.seed)
    model = (DATEncoderModel if case.encoder else DATForCausalLM)(config).eval()
    if state is not None:
        model.load_state_dict(state)
    return model.to(dtype)


def outputs(model, case: Case, ids, mask, graph):
    kwargs = dict(attention_mask=mask)
    if any("graph" in pair for pair in model.config.layer_biases()):
        kwargs["graph_adjacency"] = graph
    with torch.no_grad():
        out = model(ids, **kwargs)
    return out.last_hidden_state if case.encoder else out.logits


def explicit_refusal(error: ValueError) -> bool:
    return "cannot run this call" in str(error)


def run_with_backends(case: Case, dtype, state, ids, mask, graph):
    """The case's model in `dtype` with its backends -> (outputs, backends used). An explicit relational backend that
    cannot run some call must refuse with a message saying why; the case then runs with automatic selection."""
    relational = case.relational
    try:
        model = build(case, case.sensory, relational, dtype, state)
        return outputs(model, case, ids, mask, graph), used_backends(model)
    except ValueError as error:
        if relational is None or not explicit_refusal(error):
            raise
    model = build(case, case.sensory, None, dtype, state)
    return outputs(model, case, ids, mask, graph), used_backends(model)


def used_backends(model):
    return {getattr(m, "relational_attention_backend", None) for m in model.modules()
            if type(m).__name__ == "RelationalAttention"} - {None}


def check_case(case: Case) -> str:
    """Run one case; raise AssertionError (with the case) when it disagrees. Returns a one-line summary."""
    with block_sizes(case), uncompiled_flex():
        ids, mask, graph = make_inputs(case)
        reference_model = build(case, "eager", "eager" if case.config["num_relational_heads"] else None,
                                torch.float64)
        state = reference_model.state_dict()
        expected = outputs(reference_model, case, ids, mask, graph)
        rows = mask.bool()
        assert torch.isfinite(expected).all(), f"float64 reference not finite: {case.describe()}"
        if case.check == "cache":
            return _check_cache(case, state, ids, mask)
        dtype = torch.bfloat16 if case.check == "bf16" else torch.float32
        got, backends = run_with_backends(case, dtype, state, ids, mask, graph)
        assert torch.isfinite(got).all(), f"non-finite outputs ({backends}): {case.describe()}"
        scale = expected[rows].abs().max().item() if rows.any() else 1.0
        diff = (got.double() - expected)[rows].abs().max().item() if rows.any() else 0.0
        bf16_tol = BF16_TOL if case.config["hidden_size"] >= 8 else BF16_TOL_NARROW
        tolerance = bf16_tol * max(scale, 1.0) if dtype == torch.bfloat16 else FP32_ATOL + FP32_RTOL * scale
        if diff > tolerance:
            # an ill-conditioned model (a norm over 2 features: seed 101052) loses float32 precision whatever the
            # backend, and a long bf16 case may exceed its bar in eager too (seed 1734396530: bf16 eager 0.570 > 0.559);
            # the backends must then be as close to float64 as the same dtype's own eager stages are
            eager = build(case, "eager", "eager" if case.config["num_relational_heads"] else None, dtype, state)
            floor = (outputs(eager, case, ids, mask, graph).double() - expected)[rows].abs().max().item()
            tolerance = max(tolerance, FLOOR_FACTOR * floor)
        assert diff <= tolerance, (f"{dtype} outputs differ from the float64 reference by {diff:.3g} > {tolerance:.3g} "
                                   f"(relational backends {sorted(backends)}): {case.describe()}")
        return f"{case.check} diff {diff:.2g} backends {sorted(backends)}"


def _check_cache(case: Case, state, ids, mask) -> str:
    """Greedy generation with the case's cache: the logits of every step equal one forward over the generated
    sequence without a cache."""
    relational = case.relational
    for attempt in (relational, None):
        model = build(case, case.sensory, attempt, torch.float32, state)
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                 cache_implementation=case.cache)
            break
        except ValueError as error:
            if attempt is None or not explicit_refusal(error):
                raise
    generated = torch.stack(out.logits, dim=1)
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], out.sequences.shape[1] - mask.shape[1])], dim=1)
    with torch.no_grad():
        expected = model(out.sequences[:, :-1], attention_mask=full_mask[:, :-1], use_cache=False).logits
    expected = expected[:, ids.shape[1] - 1:]
    diff = (generated - expected).abs().max().item()
    assert diff <= CACHE_ATOL, (f"cached generation ({case.cache} cache) differs from recomputation by {diff:.3g}: "
                                f"{case.describe()}")
    return f"cache {case.cache} diff {diff:.2g} backends {sorted(used_backends(model))}"
