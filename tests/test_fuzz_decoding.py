"""The decoding fuzzer: random small DAT causal LMs decode greedily along routes that must agree
(`decoding_cases.py` says what a seed draws and how close "agree" is):

- (a) `generate` with the fast paths `import dat_hf` installs (compiled relational backends, the whole-step decoding
  ops, fused projections, RoPE and SwiGLU kernels) against `generate` with every one of them set aside
  (`conftest.set_fast_paths_aside`, as remote code runs without dat_hf): the same tokens, scores within tolerance;
- (b) the static cache against the dynamic cache: the same;
- (c) continuous batching (`generate_batch`, every 4th seed) against `generate` on each prompt alone: the same
  tokens and log-probabilities; a config it refuses (`continuous_batching_limits()`) is refused by name, and counted.

- `test_fuzz_decoding_fixed_seeds`: a fixed seed set, the same every run (the first 100 of `FIXED_SEEDS`; all 500 with
  `-m slow`), 25 a test; in each 25 some cases must run the whole-step CPU decoding ops (`layer_step`,
  `dual_attention_step`, counted by wrappers of their registry entries) and the `cpu` relational backend, and some
  must check continuous batching: else the fuzzer would prove nothing about them;
- `test_fuzz_decoding_fresh_seed`: one fresh seed per run (the run's `fuzz seed`, shared with
  `test_fuzz_attention.py`), in any failure with its replay command,
  `pytest tests/test_fuzz_decoding.py --fuzz-seed N`; that case checks continuous batching whatever it drew;
- `test_fuzz_decoding_many` (`-m slow`): `--fuzz-cases` random cases (default 2,000) from the run's seed, every
  failing seed listed;
- the checker itself: a whole-step op off by 1e-3 fails (a), set-aside fast paths run no kernel; the generator
  replays a seed and draws every field's values over the fixed seeds;
- what the fuzzer found, pinned as a regression test.
"""

import collections
import copy
import dataclasses
import time

import pytest
import torch
from conftest import PYTORCH_RELATIONAL_BACKENDS, set_fast_paths_aside
from decoding_cases import STEP_OPS, VOCAB, Case, build, check_case, counting_kernels, draw_case
from transformers import ContinuousBatchingConfig, GenerationConfig

from dat_hf.kernel_hooks import BACKENDS
from dat_hf.relational_biases import RELATIONAL_BIASES

FIXED_SEEDS = range(500)  # the first DEFAULT_SEEDS run by default, the rest with `-m slow`
DEFAULT_SEEDS = 100
CHUNK = 25


def _run(seeds, **kwargs):
    failures, outcomes = [], []
    for seed in seeds:
        try:
            outcomes.append(check_case(draw_case(seed), **kwargs))
        except Exception as error:  # (every failing seed of the chunk is reported, with its replay option)
            failures.append(f"--fuzz-seed {seed}: {type(error).__name__}: {error}")
    return failures, outcomes


def _tally(outcomes) -> dict:
    """{what: cases}: the cases in which each whole-step op computed a step and the relational heads ran on the `cpu`
    backend, each way (c) went; the rows whose tokens parted at a tie; the largest difference of each route."""
    tally = collections.Counter(outcome.continuous for outcome in outcomes)
    for kind in STEP_OPS:
        tally[kind] = sum(bool(outcome.kernels.get(kind)) for outcome in outcomes)
    tally["cpu backend"] = sum("cpu" in outcome.backends for outcome in outcomes)
    tally["ties"] = sum(outcome.ties for outcome in outcomes)
    for route in "abc":
        tally[f"largest {route}"] = float(f"{max([o.differences.get(route, 0.0) for o in outcomes] or [0.0]):.2g}")
    return dict(tally)


@pytest.mark.parametrize("start", [start if start < DEFAULT_SEEDS else pytest.param(start, marks=pytest.mark.slow)
                                   for start in range(FIXED_SEEDS.start, FIXED_SEEDS.stop, CHUNK)])
def test_fuzz_decoding_fixed_seeds(start):
    failures, outcomes = _run(range(start, start + CHUNK))
    assert not failures, "\n".join(failures)
    assert len(outcomes) == CHUNK
    tally = _tally(outcomes)
    print(f"seeds {start}-{start + CHUNK - 1}: {tally}")
    # the fast paths under test did run: the whole-step ops took decoding steps, continuous batching was compared
    for kind in (*STEP_OPS, "cpu backend"):
        assert tally[kind] >= 1, f"no case of seeds {start}-{start + CHUNK - 1} ran `{kind}`: {tally}"
    assert tally.get("checked", 0) >= 2, f"continuous batching was checked in too few cases: {tally}"


def test_fuzz_decoding_fresh_seed(fuzz_seed):
    case = draw_case(fuzz_seed)
    print(f"fuzz seed {fuzz_seed}: {case.describe()}")
    try:
        outcome = check_case(case, continuous=True)
    except Exception as error:
        raise AssertionError(f"replay with `pytest tests/test_fuzz_decoding.py --fuzz-seed {fuzz_seed}`: "
                             f"{error}") from error
    assert outcome.continuous != "not drawn"
    print(outcome.summary)


@pytest.mark.slow
def test_fuzz_decoding_many(request, fuzz_seed):
    cases = request.config.getoption("--fuzz-cases")
    start = time.perf_counter()
    failures, outcomes = _run(range(fuzz_seed, fuzz_seed + cases))
    print(f"decoding fuzz: {cases} cases from seed {fuzz_seed} in {time.perf_counter() - start:.0f} s, "
          f"{len(failures)} failed; {_tally(outcomes)}")
    assert not failures, "\n".join(failures)


# ---- the generator itself ------------------------------------------------------------------------------------------
def test_fuzz_case_replays_the_same_draw():
    """A printed seed replays: the same seed draws the same case, different seeds different ones."""
    assert draw_case(12345) == draw_case(12345)
    assert len({repr(dataclasses.astuple(draw_case(seed))) for seed in range(20)}) == 20


def test_the_draws_cover_every_decoder_bias_and_field():
    """The biases drawn are every registered one a causal LM's generation takes (a bias registered later must be
    added to `DECODER_BIASES`), and over the default fixed seeds every field that matters to a decoder takes each of
    its values (a change to the generator that stops drawing one fails here)."""
    from decoding_cases import DECODER_BIASES

    decodable = {name for name, bias in RELATIONAL_BIASES.items() if bias.decoder and not bias.inputs
                 and not bias.cross}
    assert set(DECODER_BIASES) == decodable
    cases = [draw_case(seed) for seed in range(DEFAULT_SEEDS)]
    seen = collections.defaultdict(set)
    for case in cases:
        for field, value in case.config.items():
            for one in (value if isinstance(value, list) and field != "sparse_edges" else [value]):
                seen[field].add(repr(one))
        seen["backends"].add((case.sensory, case.relational))
        seen["padded"].add(any(case.padding))
    expected = {
        "num_sensory_heads": {"0", "1", "2", "3"}, "position_embedding_type": {"'rope'", "'learned'", "'none'"},
        "symbol_retrieval": {"'symbolic_attention'", "'positional'", "'position_relative'"},
        "hidden_act": {"'swiglu'", "'gelu'"}, "norm_type": {"'rmsnorm'", "'layernorm'"},
        "pre_norm": {"True", "False"}, "shared_symbol_retriever": {"True", "False"},
        "tie_symbol_library": {"True", "False"}, "symmetric_relations": {"True", "False"},
        "share_attention_params": {"True"}, "attention_bias": {"True", "False"},
        "attention_out_bias": {"True", "False"}, "mlp_bias": {"True", "False"},
        "relational_bias": {repr(name) for name in decodable},
        "relational_heads_bias": {"None", *(repr(name) for name in decodable)},
        "relation_activation": {"'identity'", "'relu'", "'tanh'", "'gelu'"},
        "num_hidden_layers": {"1", "2", "3"}, "padded": {True, False},
    }
    for field, values in expected.items():
        assert values <= seen[field], f"{field}: {sorted(values - seen[field])} never drawn in the fixed seeds"
    for field in ("num_sensory_key_value_heads", "num_relational_key_value_heads", "num_relations", "relation_dim",
                  "max_relative_position", "sparse_edges"):
        assert seen[field], f"{field} never drawn"
    assert {sensory for sensory, _ in seen["backends"]} == {"sdpa", "eager", "flex_attention"}
    assert {relational for _, relational in seen["backends"]} == {None, "eager", "sdpa", "flex_attention"}


# a case the whole-step ops take (the defaults: pre-norm RMSNorm layers with a SwiGLU MLP, both head types, symbolic
# attention, `sdpa` and automatic selection, no padding)
PLAIN = Case(7, dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_sensory_heads=2, num_relational_heads=2,
                     intermediate_size=16, num_symbols=4, symbolic_attention_heads=2, max_position_embeddings=32,
                     initializer_range=0.2), batch=2, length=5, padding=[0, 0], new_tokens=4, sensory="sdpa",
             relational=None, continuous=False)


def test_a_broken_whole_step_op_is_caught(monkeypatch):
    """The checker fails when a fast path computes something else: the whole-step op's output off by 1e-3 (which
    moves no greedy token) is caught by the scores of (a), the case named."""
    outcome = check_case(PLAIN)
    assert outcome.kernels.get("layer_step", 0) >= 2 * (PLAIN.new_tokens - 1), outcome  # (both layers, every step)
    table = BACKENDS.of("layer_step")
    for name, entry in list(table.items()):
        def off(*args, _function=entry.function, **kwargs):
            out = _function(*args, **kwargs)
            return None if out is None else out + 1e-3
        monkeypatch.setitem(table, name, entry._replace(function=off))
    with pytest.raises(AssertionError, match=r"\(a\) fast paths against none: scores of row 0 differ by .*seed=7 "):
        check_case(PLAIN)


def test_the_fast_paths_are_set_aside_in_the_reference():
    """While `conftest.set_fast_paths_aside` holds, no kernel runs (the counting wrappers are gone with the entries)
    and the relational heads run on a PyTorch backend; afterwards every entry is back."""
    before = {kind: dict(table) for kind, table in BACKENDS.kinds.items()}
    model = build(PLAIN)
    ids = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    with counting_kernels() as counts, pytest.MonkeyPatch.context() as patch:
        set_fast_paths_aside(patch)
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert not counts, counts
        assert {m.relational_attention_backend for m in model.modules()
                if hasattr(m, "relational_attention_backend")} <= set(PYTORCH_RELATIONAL_BACKENDS)
    assert {kind: dict(table) for kind, table in BACKENDS.kinds.items()} == before
    with counting_kernels() as counts:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert counts["layer_step"] == 2 * 2  # (2 layers, the 2 steps after the prefill)


# ---- what the fuzzer found -----------------------------------------------------------------------------------------
FLEX_SENSORY = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_sensory_heads=2, num_relational_heads=2,
                    intermediate_size=16, num_symbols=4, symbolic_attention_heads=2, max_position_embeddings=32,
                    initializer_range=0.2)


def test_continuous_batching_limits_name_flex_attention_sensory_heads():
    """A model whose sensory heads run on `flex_attention` is one continuous batching cannot serve: its
    `continuous_batching_limits()` (the one list `init_continuous_batching` and the server read) names it, and
    `init_continuous_batching` refuses it by DAT's message. (Found by the fuzzer: fixed seeds 48, 144, 252 drew such
    models, which the server would have put on continuous batching.)"""
    model = build(Case(48, dict(FLEX_SENSORY), batch=1, length=3, padding=[0], new_tokens=3, sensory="flex_attention",
                       relational=None, continuous=True))
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    limits = model.continuous_batching_limits()
    try:
        model.generate_batch([[1, 2, 3]], generation_config=copy.deepcopy(config),
                             continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=16,
                                                                                 max_batch_tokens=32))
        served = True
    except ValueError as error:
        served, refusal = False, str(error)
    # either it is served (then it needs no limit) or the limits say why, and DAT refuses it by name
    assert served or (any("flex_attention" in limit for limit in limits)
                      and "Continuous batching cannot serve" in refusal), (limits, None if served else refusal)
