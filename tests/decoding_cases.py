"""The decoding fuzzer's cases (used by `test_fuzz_decoding.py`): a seed draws a small DAT causal LM, its prompts and
how it decodes, and `check_case` compares greedy decoding along three routes that must agree.

A case (`draw_case(seed)`) draws:
- the model (`DATConfig`, `initializer_range=0.2` so that logits are spread, not flat): 1-3 layers of 2-8 features a
  head; 0-3 sensory and 1-4 relational heads (or 1-3 sensory and 0 relational), GQA on either head type,
  `num_relations` / `relation_dim`, symmetric relations, shared attention projections, the relation activation, every
  symbol retriever (shared or per layer, tied libraries; position-relative with its clipping distance), the MLP's
  activation (SwiGLU or any other), RMSNorm or LayerNorm, pre- or post-norm, RoPE / learned / no positions, the
  biases of the attention input and output projections and of the MLP;
- the relational bias of each head type, in each layer or one for all, among those a causal LM's generation takes
  (`DECODER_BIASES`: causal, sliding windows of 1-8 tokens, sparse graphs with blocks of 1-8, 0-2 global tokens and
  explicit edges; `graph` comes with each input, which generation does not carry);
- the backends: sensory `sdpa` / `eager` / `flex_attention` (evaluated uncompiled) x relational automatic selection
  (the `cpu` backend and the whole-step decoding ops where the config allows them) or one PyTorch backend (an explicit
  one that refuses a call by name is replaced by automatic selection);
- the prompts: batch 1-3 of 1-12 tokens, left padding per row (one row without); 3-6 new tokens;
- for continuous batching (the seeds divisible by `CONTINUOUS_EVERY`: it costs ~0.5 s a case), the page size and the
  tokens of a batch (small enough, sometimes, that a prompt is prefilled in chunks).
How far a case strays from the defaults is drawn first (swarm testing): two cases in five keep the defaults of the
fields the whole-step ops decline (symbols, positions, projection biases, relational biases, backends, padding), and
the layer's norms and MLP stray on their own, so that the ops run in about a fifth of the cases (`layer_step`) and
alone in another (`dual_attention_step`: the layer's norms or MLP differ); the other cases vary a few or many fields
at once.

What is checked (greedy, `output_scores=True`):
- (a) `generate` with the fast paths `import dat_hf` installs against `generate` with every one of them set aside
  (`conftest.set_fast_paths_aside`, what remote code runs): the same tokens, scores within `SCORE_ATOL` +
  `SCORE_RTOL` of the largest reference score; no kernel ran in the reference (counted);
- (b) the static cache (`cache_implementation="static"`) against the dynamic cache, both with the fast paths: the
  same;
- (c) continuous batching (`generate_batch`) against `generate` on each prompt alone: the same tokens, their
  log-probabilities within the same tolerance; a config `continuous_batching_limits()` refuses is refused by
  `init_continuous_batching` with its reason, and counted.
Tokens may part only at a step where the reference's two best scores are within twice the tolerance of each other (a
tie the tolerance cannot order; that step's scores are compared, the later ones not) and each is counted (`ties`):
none met in the 4,300 cases whose counts were recorded.

Tolerances: the fast paths (the `cpu` backend, the whole-step ops, fused projections, RoPE and SwiGLU kernels) sum in
other orders than PyTorch's reference modules; float32 scores of magnitude ~1-20 then differ by ~1e-6 (observed at
most 5.4e-6 for (a), 3.1e-6 for (b) and 1.2e-6 for (c) over 4,300 recorded cases), so `SCORE_ATOL = 1e-4` plus
`SCORE_RTOL = 1e-5` of the largest reference score: 20 times what the order of sums gave, far below what a wrong step
moves (a cached token missed or a head's weights swapped moves scores by ~0.1-1; an op's output off by 1e-3 is
caught: `test_fuzz_decoding.py`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import random

import pytest
import torch
from conftest import set_fast_paths_aside
from fuzz_cases import uncompiled_flex, used_backends

from dat_hf import DATConfig, DATForCausalLM
from dat_hf.kernel_hooks import BACKENDS, HEAD_TYPES

SCORE_ATOL, SCORE_RTOL = 1e-4, 1e-5
VOCAB = 61
DECODER_BIASES = ("causal", "sliding_window", "sparse")  # (every bias a causal LM's generation takes)
STEP_OPS = ("layer_step", "dual_attention_step")  # the kernels that take over a whole decoding step
CONTINUOUS_EVERY = 4  # (c) runs for the seeds divisible by it


@dataclasses.dataclass
class Case:
    seed: int
    config: dict
    batch: int
    length: int
    padding: list  # left padding per row
    new_tokens: int
    sensory: str  # attn_implementation
    relational: str | None  # relational_attn_implementation (None: automatic)
    continuous: bool  # whether (c) runs
    page_size: int = 16
    max_batch_tokens: int = 32

    def describe(self) -> str:
        return (f"seed={self.seed} batch={self.batch} length={self.length} padding={self.padding} "
                f"new_tokens={self.new_tokens} backends=({self.sensory}, {self.relational}) "
                f"continuous={self.continuous} page_size={self.page_size} max_batch_tokens={self.max_batch_tokens} "
                f"config={self.config}")


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    # how far the case strays from the defaults (where the whole-step ops run), field by field (swarm testing: some
    # cases stay at the defaults, others vary many fields at once); the layer's norms and MLP stray on their own, so
    # that the step ops run alone too (`dual_attention_step`: the layer's own modules around it)
    odd, layer_odd = rng.choice([0.0, 0.0, 0.1, 0.3, 0.5]), rng.choice([0.0, 0.2, 0.5])

    def pick(default, *others, rate=None):
        return rng.choice(others) if rng.random() < (odd if rate is None else rate) else default

    def chance(p):
        return rng.random() < p * odd / 0.3

    sensory_heads = rng.choice([0, 1, 2, 2, 3])
    relational_heads = rng.choice([1, 2, 2, 3, 4]) if sensory_heads == 0 or rng.random() < 0.9 else 0
    heads = sensory_heads + relational_heads
    head_dim = rng.choice([2, 4, 6, 8])
    layers = rng.choice([1, 2, 2, 3])
    config = dict(vocab_size=VOCAB, hidden_size=head_dim * heads, num_hidden_layers=layers,
                  num_sensory_heads=sensory_heads, num_relational_heads=relational_heads,
                  intermediate_size=rng.choice([8, 16, 32]), max_position_embeddings=32, initializer_range=0.2,
                  position_embedding_type=pick("rope", "learned", "none"),
                  hidden_act=pick("swiglu", "gelu", "gelu_pytorch_tanh", "relu", "silu", "tanh", "sigmoid",
                                  rate=layer_odd),
                  norm_type=pick("rmsnorm", "layernorm", rate=layer_odd), pre_norm=pick(True, False, rate=layer_odd),
                  mlp_bias=pick(False, True, rate=layer_odd),
                  num_symbols=rng.choice([3, 8]), symbolic_attention_heads=rng.choice([1, 2]),
                  attention_bias=pick(False, True), attention_out_bias=pick(False, True))
    if sensory_heads and rng.random() < 0.4:
        config["num_sensory_key_value_heads"] = rng.choice([d for d in (1, 2, 3) if sensory_heads % d == 0])
    if relational_heads:
        if rng.random() < 0.4:
            config["num_relational_key_value_heads"] = rng.choice([d for d in (1, 2) if relational_heads % d == 0])
        if rng.random() < 0.4:
            config["num_relations"] = rng.choice([1, 2, 3, 5])
            config["relation_dim"] = rng.choice([1, 2, 4, 7])
        config["symmetric_relations"] = rng.random() < 0.25
        config["relation_activation"] = pick("identity", "relu", "tanh", "gelu", "silu", "sigmoid")
        retrieval = pick("symbolic_attention", "positional", "position_relative")
        config["symbol_retrieval"] = retrieval
        config["shared_symbol_retriever"] = pick(True, False)
        if retrieval == "position_relative":
            config["max_relative_position"] = rng.choice([1, 2, 4, 16])
        elif not config["shared_symbol_retriever"]:
            config["tie_symbol_library"] = rng.random() < 0.5
        if (sensory_heads == relational_heads and chance(0.4)
                and config.get("num_sensory_key_value_heads") == config.get("num_relational_key_value_heads")):
            config["share_attention_params"] = True
    # the relational biases: one for all layers or one per layer, for both head types or the relational heads apart
    per_layer = rng.random() < 0.4
    biases = [pick("causal", *DECODER_BIASES) for _ in range(layers if per_layer else 1)]
    config["relational_bias"] = biases if per_layer else biases[0]
    biases = [rng.choice(DECODER_BIASES) for _ in range(layers if per_layer else 1)]
    config["relational_heads_bias"] = pick(None, biases if per_layer else biases[0])
    config["sliding_window_size"] = rng.choice([1, 2, 3, 5, 8])
    config["sparse_block_size"] = rng.choice([1, 2, 3, 4, 8])
    config["sparse_global_tokens"] = rng.choice([0, 0, 1, 2])
    # the prompts
    length = rng.choice([rng.randint(1, 4), rng.randint(1, 12), rng.randint(2, 12)])
    if rng.random() < 0.25:
        config["sparse_edges"] = [[rng.randrange(length + 6), rng.randrange(length + 6)]
                                  for _ in range(rng.randint(1, 4))]
    batch = rng.randint(1, 3)
    padding = [0] * batch
    if chance(0.5):
        padding = [rng.choice([0, rng.randint(0, length - 1), length - 1]) for _ in range(batch)]
        padding[rng.randrange(batch)] = 0  # (one row without padding)
    new_tokens = rng.randint(3, 6)
    sensory = pick("sdpa", "eager", "eager", "flex_attention")
    relational = pick(None, "eager", "sdpa", "flex_attention") if relational_heads else None
    return Case(seed, config, batch, length, padding, new_tokens, sensory, relational,
                continuous=seed % CONTINUOUS_EVERY == 0, page_size=rng.choice([4, 16]),
                max_batch_tokens=rng.choice([8, 32]))


def build(case: Case) -> DATForCausalLM:
    config = DATConfig(**case.config, relational_attn_implementation=case.relational,
                       attn_implementation=case.sensory)
    torch.manual_seed(case.seed)
    return DATForCausalLM(config).eval()


def make_inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(1, VOCAB, (case.batch, case.length), generator=g)
    mask = torch.ones(case.batch, case.length, dtype=torch.long)
    for row, pad in enumerate(case.padding):
        mask[row, :pad] = 0
    return ids, mask


def greedy(model, ids, mask, new_tokens: int, **kwargs):
    """Greedy decoding -> (new tokens `[b, new]`, scores `[b, new, vocab]`)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, dim=1)


# ---- counting what the installed kernels computed -------------------------------------------------------------------
def _counted(function, kind: str, counts: collections.Counter):
    def counting(*args, **kwargs):
        out = function(*args, **kwargs)
        if out is not None:  # (a whole-step op returns None where it leaves the step to the layer)
            counts[kind] += 1
        return out

    return counting


@contextlib.contextmanager
def counting_kernels():
    """Every kernel registered for a replaceable function (`kernel_hooks.BACKENDS`, all kinds but the head types)
    wrapped to count, per kind, the calls in which it computed something -> the `Counter`."""
    counts = collections.Counter()
    with pytest.MonkeyPatch.context() as patch:
        for kind, table in BACKENDS.kinds.items():
            if kind not in HEAD_TYPES:
                for name, entry in list(table.items()):
                    patch.setitem(table, name, entry._replace(function=_counted(entry.function, kind, counts)))
        yield counts


# ---- the checks -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    summary: str
    differences: dict  # "a", "b", "c" -> the largest score (c: log-probability) difference
    kernels: dict  # kind -> calls that computed something, in the runs with the fast paths
    backends: set  # the relational backends those runs used
    continuous: str  # (c): "checked", "refused" (by `continuous_batching_limits()`) or "not drawn"
    ties: int = 0


def tolerance(scores: torch.Tensor) -> float:
    finite = scores[torch.isfinite(scores)]
    return SCORE_ATOL + SCORE_RTOL * (finite.abs().max().item() if finite.numel() else 0.0)


def difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got - expected|: equal entries (infinities of one sign too) 0, a NaN on either side infinite."""
    delta = (got - expected).abs().masked_fill(got == expected, 0.0)
    return delta.nan_to_num(nan=float("inf")).max().item() if delta.numel() else 0.0


def parting(tokens: torch.Tensor, got: torch.Tensor, scores: torch.Tensor, atol: float, what: str,
            case: Case) -> int:
    """The steps of one row to compare: all of them where the tokens agree; else up to the first step where they
    part, which must be a tie of the reference's scores `[n, vocab]` (its best two within `2 * atol`)."""
    parted = (tokens != got).nonzero()
    if parted.numel() == 0:
        return tokens.shape[0]
    step = parted[0, 0].item()
    top = scores[step].topk(2).values
    margin = (top[0] - top[1]).item()
    assert margin <= 2 * atol, (f"{what}: tokens part at step {step} ({tokens.tolist()} != {got.tolist()}) where the "
                                f"reference's best two scores are {margin:.3g} apart: {case.describe()}")
    return step + 1


def compare(expected, got, what: str, case: Case) -> tuple[float, int]:
    """Tokens equal and scores close, row by row (`expected`, `got`: (tokens `[b, n]`, scores `[b, n, vocab]`)) ->
    (largest score difference, rows that parted at a tie). Raises AssertionError with the case."""
    (tokens, scores), (got_tokens, got_scores) = expected, got
    assert got_tokens.shape == tokens.shape and got_scores.shape == scores.shape, (
        f"{what}: shapes {tuple(got_tokens.shape)}, {tuple(got_scores.shape)} != {tuple(tokens.shape)}, "
        f"{tuple(scores.shape)}: {case.describe()}")
    atol, worst, ties = tolerance(scores), 0.0, 0
    for row in range(tokens.shape[0]):
        steps = parting(tokens[row], got_tokens[row], scores[row], atol, what, case)
        ties += not torch.equal(tokens[row], got_tokens[row])
        diff = difference(got_scores[row, :steps], scores[row, :steps])
        worst = max(worst, diff)
        assert diff <= atol, (f"{what}: scores of row {row} differ by {diff:.3g} > {atol:.3g} (tokens "
                              f"{tokens[row].tolist()}): {case.describe()}")
    return worst, ties


def check_case(case: Case, continuous: bool | None = None) -> Outcome:
    """Run one case: (a), (b) and, where the case draws it (or `continuous` says so), (c). Raises AssertionError
    (with the case) when two routes disagree."""
    continuous = case.continuous if continuous is None else continuous
    ids, mask, refused = *make_inputs(case), None
    model = build(case)
    with uncompiled_flex():
        with counting_kernels() as counts:
            try:
                fast = greedy(model, ids, mask, case.new_tokens)
            except ValueError as error:
                # an explicit relational backend that cannot run some call refuses it with a message saying why; the
                # case then runs with automatic selection
                if case.relational is None or "cannot run this call" not in str(error):
                    raise
                refused, case = case.relational, dataclasses.replace(case, relational=None)
                model = build(case)
                counts.clear()
                fast = greedy(model, ids, mask, case.new_tokens)
            static = greedy(model, ids, mask, case.new_tokens, cache_implementation="static")
            kernels, backends = dict(counts), used_backends(model)
            with pytest.MonkeyPatch.context() as patch:
                set_fast_paths_aside(patch)
                alone = greedy(model, ids, mask, case.new_tokens)
            assert counts == kernels, f"a kernel ran with the fast paths set aside: {counts}: {case.describe()}"
        assert torch.isfinite(alone[1]).all(), f"non-finite reference scores: {case.describe()}"
        diff_a, ties = compare(alone, fast, "(a) fast paths against none", case)
        diff_b, ties_b = compare(fast, static, "(b) static cache against dynamic", case)
        outcome = Outcome(f"fast {diff_a:.2g}, static {diff_b:.2g}", {"a": diff_a, "b": diff_b}, kernels, backends,
                          "not drawn", ties + ties_b)
        if continuous:
            outcome.continuous, diff_c, ties_c = _check_continuous(case, model, ids, mask)
            outcome.ties += ties_c
            if diff_c is not None:
                outcome.summary += f", continuous {diff_c:.2g}"
                outcome.differences["c"] = diff_c
    steps = ", ".join(f"{kind} {kernels.get(kind, 0)}" for kind in STEP_OPS)
    outcome.summary += f"; {outcome.continuous}; steps: {steps}; relational {sorted(backends)}"
    if refused is not None:
        outcome.summary += f"; relational {refused} refused a call: automatic selection"
    return outcome


def _check_continuous(case: Case, model, ids, mask) -> tuple[str, float | None, int]:
    """(c): `generate_batch` over the case's prompts (unpadded) against `generate` on each alone -> (how it went, the
    largest log-probability difference, prompts whose tokens parted at a tie)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=case.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    limits = model.continuous_batching_limits()
    if limits:
        with pytest.raises(ValueError, match="Continuous batching cannot serve") as refusal:
            model.init_continuous_batching(generation_config=copy.deepcopy(config))
        assert limits[0] in str(refusal.value), f"refused for another reason: {refusal.value}: {case.describe()}"
        return "refused", None, 0
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    batching = ContinuousBatchingConfig(page_size=case.page_size, num_blocks=64, return_logprobs=True,
                                        max_batch_tokens=case.max_batch_tokens)
    outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=batching)
    outputs = [outputs[key] for key in sorted(outputs, key=lambda key: int(key.split("_")[1]))]
    assert len(outputs) == len(prompts), f"(c): {len(outputs)} outputs for {len(prompts)} prompts: {case.describe()}"
    what, worst, ties = "(c) continuous batching against generate alone", 0.0, 0
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, f"{what}: {output.error}: {case.describe()}"
        assert output.prompt_ids == prompt, f"{what}: prompt {output.prompt_ids} != {prompt}: {case.describe()}"
        tokens, scores = (t[0] for t in greedy(model, torch.tensor([prompt]), None, case.new_tokens))
        got = torch.tensor(output.generated_tokens)
        assert got.shape == tokens.shape, f"{what}: tokens {got.tolist()} != {tokens.tolist()}: {case.describe()}"
        atol = tolerance(scores)
        steps = parting(tokens, got, scores, atol, f"{what} (prompt {prompt})", case)
        ties += not torch.equal(tokens, got)
        # (continuous batching returns the log-probabilities of the chosen tokens: those of `generate`'s scores)
        expected = scores.log_softmax(-1).gather(-1, got[:, None])[:steps, 0]
        diff = difference(torch.tensor(output.logprobs[:steps]), expected)
        worst = max(worst, diff)
        assert diff <= atol, (f"{what}: log-probabilities differ by {diff:.3g} > {atol:.3g} (prompt {prompt}, tokens "
                              f"{tokens.tolist()}): {case.describe()}")
    return "checked", worst, ties
