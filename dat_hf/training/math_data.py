"""Offline data for the seq2seq math task: DeepMind's `mathematics_dataset` problems and a character tokenizer.

- `apply_compat_shims()`: `mathematics_dataset` 1.0.1 predates sympy >= 1.12 and numpy 2. In-process shims make
  every module generate again: `sympy.solvers.diophantine.base_solution_linear` (moved to
  `sympy.solvers.diophantine.diophantine`) is re-exported; `mathematics_dataset.sample.polynomials` gets a numpy
  proxy providing `np.object` and arrays with `.itemset` (both removed in numpy 2); and its `integers_with_sum`
  treats the entropy of a 0- or 1-term split as 0 (current numpy's Dirichlet sampler returns ~1e-300 where numpy 1
  gave exact zeros, tripping an `assert entropy == 0` in rare `algebra__linear_1d` problems). Nothing global in
  numpy is changed. These shims live here, in the data code only (never in the modeling files).
- `generate_problems(module, n, seed)`, `math_dataset(modules, n_train, n_test, seed)`: `datasets` objects with
  `input` (question) and `target` (answer) text columns; held-out problems never repeat a training question.
- `build_char_tokenizer()`: a character-level `PreTrainedTokenizerFast` built with `tokenizers` over the dataset's
  alphabet (space, letters, digits, punctuation) plus `<pad>`, `</s>`, `<unk>`, `<s>` (decoder start); it appends
  `</s>` to every encoded text and is saved with the model (`tokenizer.json`).
"""

import random
import string
import types

import numpy as np

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "bos_token": "<s>"}
# the characters of mathematics_dataset questions and answers (generate_settings.QUESTION_CHARS)
ALPHABET = " " + string.ascii_letters + string.digits + string.punctuation
DEFAULT_MODULES = ("arithmetic__add_or_sub", "algebra__linear_1d")

_SHIMS_APPLIED = False


class _ItemsetArray(np.ndarray):
    """ndarray with numpy 1's `itemset` (removed in numpy 2). A full index tuple addresses one element, so an
    object array stores a list value as one element, as `itemset` did."""

    def itemset(self, index, value):
        self[index] = value


def _numpy_proxy():
    """A namespace behaving like numpy for `mathematics_dataset.sample.polynomials`, with numpy 1's `object` alias
    and `zeros`/`empty` arrays that have `itemset`."""
    proxy = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
    proxy.object = object

    def zeros(shape, dtype=float, **kwargs):
        return np.zeros(shape, dtype=dtype, **kwargs).view(_ItemsetArray)

    def empty(shape, dtype=float, **kwargs):
        return np.empty(shape, dtype=dtype, **kwargs).view(_ItemsetArray)

    proxy.zeros, proxy.empty = zeros, empty
    return proxy


def apply_compat_shims():
    """Make `mathematics_dataset` 1.0.1 importable and runnable on current sympy / numpy (idempotent)."""
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return
    import importlib

    # (`sympy.solvers.diophantine` as an attribute is the function; the package is in sys.modules)
    diophantine_pkg = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(diophantine_pkg, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        diophantine_pkg.base_solution_linear = base_solution_linear
    from mathematics_dataset.sample import polynomials

    polynomials.np = _numpy_proxy()
    # numpy's newer Dirichlet sampler returns tiny non-zero shares where alpha is ~0 (numpy 1 gave exact zeros), so
    # a term count of 0 or 1 can arrive with entropy 1e-300 and trip `assert entropy == 0`: such terms carry none
    original = polynomials.integers_with_sum
    if not getattr(original, "_dat_hf_shim", False):

        def integers_with_sum(value, count, entropy):
            return original(value, count, 0 if count <= 1 else entropy)

        integers_with_sum._dat_hf_shim = True
        polynomials.integers_with_sum = integers_with_sum
    _SHIMS_APPLIED = True


def _entropy_fn(level: int, num_levels: int):
    """The entropy range restriction of `mathematics_dataset.generate` (level 0 of 3 = 'train-easy')."""
    lower, upper = level / num_levels, (level + 1) / num_levels

    def modify_entropy(range_):
        length = range_[1] - range_[0]
        return (range_[0] + lower * length, range_[0] + upper * length)

    return modify_entropy


DIFFICULTIES = {"easy": (0, 3), "medium": (1, 3), "hard": (2, 3), "all": (0, 1)}


def _module_fn(name: str, split: str = "train", difficulty: str = "easy"):
    """The problem generator of a flat module name such as `arithmetic__add_or_sub`."""
    apply_compat_shims()
    from mathematics_dataset.modules import modules

    if split == "train":
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"`difficulty` must be one of {list(DIFFICULTIES)}, got {difficulty!r}.")
        tree = modules.train(_entropy_fn(*DIFFICULTIES[difficulty]))
    elif split == "interpolate":
        tree = modules.test()
    elif split == "extrapolate":
        tree = modules.test_extra()
    else:
        raise ValueError(f"`split` must be 'train', 'interpolate' or 'extrapolate', got {split!r}.")
    node = tree
    for part in name.split("__"):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"Unknown mathematics_dataset module {name!r} for split {split!r}.")
        node = node[part]
    return node


def generate_problems(module: str, n: int, seed: int = 0, split: str = "train", difficulty: str = "easy",
                      exclude: set | None = None, max_question_length: int = 160, max_answer_length: int = 30):
    """`n` distinct (question, answer) string pairs from one module, reproducible from `seed`. Questions in
    `exclude` are skipped (held-out sets exclude the training questions)."""
    fn = _module_fn(module, split, difficulty)
    random.seed(seed)
    np.random.seed(seed % (2**32))
    exclude = exclude or set()
    seen, pairs, attempts = set(), [], 0
    while len(pairs) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"Could not generate {n} distinct problems for {module!r} (got {len(pairs)}).")
        problem = fn()
        question, answer = str(problem.question), str(problem.answer)
        if len(question) > max_question_length or len(answer) > max_answer_length:
            continue
        if question in seen or question in exclude:
            continue
        seen.add(question)
        pairs.append((question, answer))
    return pairs


def math_dataset(modules=DEFAULT_MODULES, n_train: int = 2000, n_test: int = 200, seed: int = 0,
                 difficulty: str = "easy", test_split: str = "train"):
    """A `datasets.DatasetDict` with `train` and `test` splits (columns `input`, `target`, `module`).

    `test_split='train'` draws the held-out problems from the training distribution (new seed, no question shared
    with the training set); 'interpolate' / 'extrapolate' use the dataset's test generators."""
    from datasets import Dataset, DatasetDict

    train, test = [], []
    for index, module in enumerate(modules):
        pairs = generate_problems(module, n_train, seed=seed * 1000 + index, difficulty=difficulty)
        questions = {q for q, _ in pairs}
        held_out = generate_problems(module, n_test, seed=seed * 1000 + index + 500, split=test_split,
                                     difficulty=difficulty, exclude=questions)
        train += [(q, a, module) for q, a in pairs]
        test += [(q, a, module) for q, a in held_out]
    rng = random.Random(seed)
    rng.shuffle(train)

    def to_dataset(rows):
        return Dataset.from_dict({"input": [r[0] for r in rows], "target": [r[1] for r in rows],
                                  "module": [r[2] for r in rows]})

    return DatasetDict(train=to_dataset(train), test=to_dataset(test))


def build_char_tokenizer(alphabet: str = ALPHABET, model_max_length: int = 512):
    """A character-level `PreTrainedTokenizerFast`: ids 0-3 are `<pad>`, `</s>`, `<unk>`, `<s>`, then one id per
    character of `alphabet`. Encoding appends `</s>`; decoding joins characters without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [SPECIAL_TOKENS[k] for k in ("pad_token", "eos_token", "unk_token", "bos_token")]
    vocab = {token: i for i, token in enumerate(specials)}
    for char in alphabet:
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False, **SPECIAL_TOKENS)


__all__ = ["apply_compat_shims", "generate_problems", "math_dataset", "build_char_tokenizer", "ALPHABET",
           "DEFAULT_MODULES", "SPECIAL_TOKENS"]
